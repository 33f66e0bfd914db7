"""``rlhf up`` in a child process, as a user starts a whole ring: a config dict written as YAML, the repository on
the path, and the test's own redis-server left out (the launcher starts the run's own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def demo_config(run_id: str) -> dict[str, Any]:
    """``configs/demo.yaml`` as a dict, with ``run_id`` set."""
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["run_id"] = run_id
    return cfg


def run_up(cfg: dict[str, Any], tmp_path: Path, run_dir: Path, *args: str, timeout: float = 540):
    """Write ``cfg`` to ``tmp_path/<run_id>.yaml`` and run ``rlhf up --config ... --run-dir run_dir *args`` to its end
    (a CompletedProcess with text output)."""
    config = tmp_path / f"{cfg.get('run_id', 'run')}.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "RLHF_REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "services.cli", "up", "--config", str(config), "--run-dir", str(run_dir), *args]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
