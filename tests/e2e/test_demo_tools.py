"""The tool-use demo learns: `rlhf up` on configs/demo-tools.yaml as a user runs it (the environment service with
builtin:calculator, episodes on the vLLM replica, GRPO on the loss mask), for the demo's own length; the mean reward of
the last 5 steps is above the first 5, every step's episodes are multi-turn records, and the completions log shows
whole episodes (the tool's turn inside the response)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_rlhf_up_demo_tools_reward_rises(tmp_path, tiny_models):
    cfg = yaml.safe_load((REPO / "configs" / "demo-tools.yaml").read_text())
    steps = cfg["training"]["train_iters"]
    cfg["run_id"] = "e2e-demo-tools"
    cfg["training"].update(save_interval=steps, save=str(tmp_path / "checkpoints"))
    config = tmp_path / "demo-tools.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--config", str(config), "--run-dir", str(run_dir), "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=720,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    assert all(r["episode/ended_by_done"] + r.get("episode/ended_by_max_turns", 0) > 0.9 for r in rows)
    assert all(r["episode/environment_tokens"] > 0 and r["reward/failed_fraction"] == 0 for r in rows)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    calls = [r["episode/tool_calls"] for r in rows]
    print(
        f"demo-tools GRPO reward: first-5 mean {first:.3f}, last-5 mean {last:.3f}, margin {last - first:+.3f}; "
        f"tool calls per episode {sum(calls[:5]) / 5:.2f} -> {sum(calls[-5:]) / 5:.2f}"
    )
    assert last > first + 0.05, (first, last, rewards)
    logged = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert any("\nTool: " in c["response"] for c in logged)  # an episode's tool turn, inside the response
