"""docs/configuration.md's field tables are the ones tools/gen_config_docs.py renders from rlhf/config.py (as
tests/unit/rlhf/test_proto.py does for rlhf/v1): a field added, renamed or redescribed without regenerating fails
here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pydantic import BaseModel

from rlhf.config import ExperimentConfig

ROOT = Path(__file__).resolve().parents[3]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "tools" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_page_is_fresh():
    gen = _generator()
    page = gen.PAGE.read_text()
    assert gen.updated(page) == page, (
        "docs/configuration.md's field tables are stale: run `.venv/bin/python tools/gen_config_docs.py` and commit"
    )


def test_every_field_has_a_description_and_a_row():
    gen = _generator()
    rendered = gen.render()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            sub = gen._section(field.annotation)
            if sub is not None:
                list_of = "[]" if field.annotation is not sub else ""
                if list_of:
                    assert f"| `{prefix}{name}` |" in rendered, prefix + name
                walk(sub, f"{prefix}{name}{list_of}.")
            else:
                assert f"| `{prefix}{name}` |" in rendered, prefix + name

    walk(ExperimentConfig, "")
