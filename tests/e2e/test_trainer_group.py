"""`rlhf up --trainer-procs 2`: the demo PPO run with a 2-process FSDP2 trainer (torch.distributed.run, gloo), and
rank 1 killed -9 mid-run. torchrun ends the group, `rlhf up` restarts it, it resumes from its last checkpoint; the
run learns as the 1-process demo does (tests/e2e/test_demo_learns.py: same steps, same margin) and its ledger holds
every job exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
STEPS = 60  # the demo's own, as test_demo_learns.py (at 40 one make test run missed the +0.2 margin: +0.18)
KILL_AFTER = 14  # steps: after the checkpoint at step 10, before the one at 20

pytestmark = pytest.mark.slow


def _rank_pids(run_id: str, rank: int) -> list[int]:
    """Trainer processes of this run with torchrun's RANK (their environment says both)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = dict(
                x.split("=", 1) for x in (d / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in x
            )
        except OSError:
            continue
        if env.get("RLHF_RUN_ID") == run_id and env.get("RANK") == str(rank) and "LOCAL_RANK" in env:
            out.append(int(d.name))
    return out


def _steps(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def test_two_trainer_procs_learn_and_survive_kill_of_rank_1(tmp_path, tiny_models):
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["run_id"] = run_id = f"e2e-group-{os.getpid()}"
    cfg["training"].update(train_iters=STEPS, save_interval=10, save=str(tmp_path / "checkpoints"))
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = tmp_path / "run"
    log = (tmp_path / "up.log").open("w")
    env = {**os.environ, "RLHF_RUN_ID": run_id}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "up",
            "--config",
            str(config),
            "--run-dir",
            str(run_dir),
            "--quiet",
            "--trainer-procs",
            "2",
        ],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        deadline = time.monotonic() + 480
        while len(_steps(run_dir / "metrics.jsonl")) < KILL_AFTER:
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no progress"
            time.sleep(0.5)
        pids = _rank_pids(run_id, 1)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        rc = up.wait(timeout=600)
    finally:
        if up.poll() is None:
            up.kill()
        log.close()
    out = (tmp_path / "up.log").read_text()
    assert rc == 0, out[-3000:]
    assert "trainer exited with" in out and "restarting it (1/" in out, out[-3000:]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert "resumed from" in trainer_log and "step_10" in trainer_log
    # every job trained exactly once: STEPS batches of distinct job ids, none twice across the restart
    ids = [
        j
        for line in (run_dir / "trained_jobs.jsonl").read_text().splitlines()
        if line.strip()
        for j in json.loads(line).get("job_ids", [])
    ]
    assert len(ids) == len(set(ids)) == STEPS * cfg["training"]["global_batch_size"], (len(ids), len(set(ids)))
    rewards = [m["reward/mean"] for m in _steps(run_dir / "metrics.jsonl")]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    print(f"2-process trainer, rank 1 killed at step {KILL_AFTER}: reward first-5 {first:.3f}, last-5 {last:.3f}")
    assert last > first + 0.2, (first, last, rewards)


def test_a_trainer_group_stopped_by_a_rule_ends_whole_and_is_not_restarted(tmp_path, tiny_models):
    """Rank 0 meets a stopping rule (every sample fails scoring) and ends the run while rank 1 may be inside a
    collective: the whole group must exit, `rlhf up` must still see "stopped by a rule" (torchrun reports a failed rank
    as a failure of its own) and not restart the trainer into the same rule."""
    (tmp_path / "myreward.py").write_text("def score(prompt, response, label, **kw):\n    return len(response) / 0\n")
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["run_id"] = run_id = f"e2e-group-rule-{os.getpid()}"
    cfg["training"].update(train_iters=20, save=str(tmp_path / "checkpoints"))
    cfg["reward"] = {"scorers": [{"type": "rule", "name": "myreward:score"}], "failed_patience": 2}
    config = tmp_path / "demo.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = tmp_path / "run"
    env = {**os.environ, "RLHF_RUN_ID": run_id, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    up = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--config", str(config), "--run-dir", str(run_dir)]
        + ["--quiet", "--trainer-procs", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
        timeout=480,
    )
    out = up.stdout + up.stderr
    assert up.returncode == 1, out[-3000:]
    assert "the trainer stopped the run: more than 50% of the samples failed scoring" in out, out[-3000:]
    assert "restarting it" not in out, out[-3000:]
    assert _rank_pids(run_id, 0) == [] and _rank_pids(run_id, 1) == []  # no rank outlives the run
    assert _steps(run_dir / "metrics.jsonl") == []  # nothing trained on rewards that never scored
