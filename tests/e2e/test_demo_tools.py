"""The tool-use demo learns: `rlhf up` on configs/demo-tools.yaml as a user runs it (the environment service with
builtin:calculator, episodes on the vLLM replica, GRPO on the loss mask), for the demo's own length. GRPO learns the
tool's use and the reward follows: both the tool calls per episode and the reward trend upward over the 60 steps
(least-squares slope, t >= 3 each; a policy that does not learn passes one such check about 0.2% of the time). On a
2-core AMD EPYC both had t near 9 (docs/environments.md); the warm start is short enough that either CPU measured
leaves room to learn. Every step's episodes are multi-turn records, and the completions log shows whole episodes (the
tool's turn inside the response)."""

from __future__ import annotations

import json

import pytest

from tests.support.up import demo_config, rlhf_up

pytestmark = pytest.mark.slow


def test_rlhf_up_demo_tools_reward_rises(tmp_path, tiny_models):
    cfg = demo_config("demo-tools", "e2e-demo-tools", tmp_path)
    steps = cfg["training"]["train_iters"]
    cfg["training"]["save_interval"] = steps
    out, run_dir = rlhf_up(cfg, tmp_path, timeout=720)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    assert all(r["episode/ended_by_done"] + r.get("episode/ended_by_max_turns", 0) > 0.9 for r in rows)
    assert all(r["episode/environment_tokens"] > 0 and r["reward/failed_fraction"] == 0 for r in rows)
    rewards = [r["reward/mean"] for r in rows]
    calls = [r["episode/tool_calls"] for r in rows]
    (reward_rise, reward_t), (calls_rise, calls_t) = _trend(rewards), _trend(calls)
    print(
        f"demo-tools GRPO reward {sum(rewards[:10]) / 10:.3f} -> {sum(rewards[-10:]) / 10:.3f} (trend "
        f"{reward_rise:+.3f}, t {reward_t:.2f}); tool calls per episode {sum(calls[:10]) / 10:.2f} -> "
        f"{sum(calls[-10:]) / 10:.2f} (trend {calls_rise:+.3f}, t {calls_t:.2f})"
    )
    assert calls_t >= 3 and calls_rise > 0, (calls_rise, calls_t, calls)
    assert reward_t >= 3 and reward_rise > 0, (reward_rise, reward_t, rewards)
    logged = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert any("\nTool: " in c["response"] for c in logged)  # an episode's tool turn, inside the response


def _trend(ys: list[float]) -> tuple[float, float]:
    """The least-squares line through ``ys`` (one per step): its rise over the run and its slope's t statistic."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in range(n))
    slope = sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in enumerate(ys)) / (n - 2)
    return slope * (n - 1), slope / (resid / sxx) ** 0.5 if resid > 0 else float("inf")
