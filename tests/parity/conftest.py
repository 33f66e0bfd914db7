"""TRL parity suite setup: seeds, determinism, and the largest-difference report printed at the end of the session.

Runs in its own environment (``.venv-parity``: trl 1.12.0, transformers 5.24.0, torch 2.13.0 CPU):
``PYTHONPATH=. HF_HUB_OFFLINE=1 .venv-parity/bin/python -m pytest tests/parity``. Seeds come from
``--parity-seeds 11,12,13`` or ``RLHF_PARITY_SEEDS=11,12,13`` (default 1,2,3).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # trl.experimental.{ppo,online_dpo} is what we compare with

ROOT = Path(__file__).resolve().parents[2]
REPORT_PATH = Path(os.environ.get("RLHF_PARITY_REPORT", "/tmp/parity_max_diffs.json"))
DEFAULT_SEEDS = "1,2,3"

# metric -> {"max_abs_diff", "tolerance", "run"}: the largest difference seen for each metric over the session.
MAX_DIFFS: dict[str, dict] = {}


def pytest_addoption(parser):
    parser.addoption(
        "--parity-seeds",
        default=None,
        help=f"comma-separated seeds for the TRL parity tests (else $RLHF_PARITY_SEEDS, else {DEFAULT_SEEDS})",
    )


def _seeds(config) -> list[int]:
    raw = config.getoption("--parity-seeds") or os.environ.get("RLHF_PARITY_SEEDS") or DEFAULT_SEEDS
    seeds = [int(s) for s in raw.replace(" ", "").split(",") if s]
    if not seeds:
        raise pytest.UsageError(f"no parity seeds in {raw!r}")
    return seeds


def pytest_configure(config):
    # TRL decides that vLLM is installed when a directory named `vllm` is importable (the repo root is on sys.path).
    if (ROOT / "vllm").is_dir():
        raise pytest.UsageError(f"{ROOT / 'vllm'} exists: TRL would take it for an installed vLLM; remove it")
    # transformers 5.24 deprecates the name TRL's configs still set; nothing to act on here
    config.addinivalue_line("filterwarnings", "ignore:`gradient_checkpointing` is deprecated:FutureWarning")
    config.addinivalue_line("filterwarnings", "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def pytest_generate_tests(metafunc):
    if "seed" in metafunc.fixturenames:
        seeds = _seeds(metafunc.config)
        metafunc.parametrize("seed", seeds, ids=[f"seed{s}" for s in seeds])


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.parity)


@pytest.fixture(scope="session")
def parity_report() -> dict[str, dict]:
    return MAX_DIFFS


@pytest.fixture(autouse=True)
def _fp32_cpu_single_thread():
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    np.random.seed(0)
    yield


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not MAX_DIFFS:
        return
    REPORT_PATH.write_text(json.dumps({"seeds": _seeds(config), "max_diffs": MAX_DIFFS}, indent=2, sort_keys=True))
    tr = terminalreporter
    tr.section("TRL parity: largest |ours - TRL| per metric over all seeds and settings")
    width = max(len(k) for k in MAX_DIFFS)
    tr.write_line(f"{'metric':<{width}}  {'max abs diff':>12}  {'tolerance':<22} worst run")
    for metric in sorted(MAX_DIFFS):
        row = MAX_DIFFS[metric]
        run = row["run"] if row["max_abs_diff"] > 0 else "- (0 in every run)"
        tr.write_line(f"{metric:<{width}}  {row['max_abs_diff']:12.3e}  {row['tolerance']:<22} {run}")
    tr.write_line(f"(written to {REPORT_PATH})")
