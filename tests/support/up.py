"""``rlhf up`` in a child process, as a user starts a whole ring: a shipped config as a dict, written as YAML, the
repository on the path, and the test's own redis-server left out (the launcher starts the run's own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def demo_config(name: str, run_id: str, directory: Path | None = None, **training: Any) -> dict[str, Any]:
    """configs/NAME.yaml as a user runs it, with its own ``run_id``, its checkpoints in ``directory`` (when given)
    and ``training`` options over the file's."""
    cfg = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
    cfg["run_id"] = run_id
    if directory is not None:
        cfg["training"]["save"] = str(Path(directory) / "checkpoints")
    cfg["training"].update(training)
    return cfg


def run_up(
    cfg: dict[str, Any], directory: Path, run_dir: Path, *args: str, env: dict[str, str] | None = None, timeout=540
) -> subprocess.CompletedProcess:
    """Write ``cfg`` to ``directory/<run_id>.yaml`` and run ``rlhf up --config ... --run-dir run_dir *args`` there to
    its end (text output captured; ``env`` over the test's environment)."""
    config = Path(directory) / f"{cfg.get('run_id', 'run')}.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    child = {k: v for k, v in os.environ.items() if k != "RLHF_REDIS_URL"} | (env or {})
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), child.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "services.cli", "up", "--config", str(config), "--run-dir", str(run_dir), *args]
    return subprocess.run(argv, cwd=directory, env=child, capture_output=True, text=True, timeout=timeout)


def rlhf_up(cfg: dict[str, Any], directory: Path, timeout: float) -> tuple[subprocess.CompletedProcess, Path]:
    """``rlhf up --quiet`` of ``cfg`` in ``directory`` to its end: the finished process and the run folder."""
    run_dir = Path(directory) / "run"
    return run_up(cfg, directory, run_dir, "--quiet", timeout=timeout), run_dir
