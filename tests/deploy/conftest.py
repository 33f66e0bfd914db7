"""Fixtures for the static deployment tests (run by `make deploy-check`, not `make test`: they need the helm binary
that `make deploy-tools` installs into .tools/). Nothing here needs a cluster or a Docker engine."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from deploy_support import COMPOSE_FILES, RENDERS, ROOT, Rendered, render, require_helm


@pytest.fixture(scope="session")
def helm() -> str:
    return require_helm()


@pytest.fixture(scope="session")
def rendered(helm: str) -> dict[str, Rendered]:
    """default, gpu and npu renders of the chart."""
    return {name: render(helm, *args) for name, args in RENDERS.items()}


@pytest.fixture(scope="session")
def compose_files() -> dict[str, dict[str, Any]]:
    """Each compose file parsed as YAML (anchors and merge keys resolved)."""
    return {name: yaml.safe_load((ROOT / name).read_text()) for name in COMPOSE_FILES}
