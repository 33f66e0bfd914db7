"""A ring that cannot go on says so (issue 26, item 5).

- A replica that refuses the trainer's weights as not fitting its model (no retry can fix that) stops the run at
  once: the trainer exits with EXIT_STOPPED_BY_RULE and a message naming the replica, the tensors and what to change.
- While no replica serves the newest version (a replica down), the trainer writes one "waiting" event, takes no new
  job and stays near idle; when the replica is back and caught up, a "resumed" event, and the run finishes.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from rlhf import runlog
from rlhf.tiny import TinySpec, build_tiny
from tests.e2e._ring import Ring, write_config

pytestmark = pytest.mark.slow


def _events(ring: Ring) -> list[dict]:
    path = ring.run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_replica_that_cannot_load_the_weights_stops_the_run(rings, tmp_path):
    other = build_tiny(tmp_path / "three-layers", TinySpec(num_hidden_layers=3)).policy  # not the trainer's model
    ring = rings("e2e-refused", train_iters=20)
    cfg = json.loads(json.dumps(ring.cfg))
    cfg["actor_rollout_ref"]["actor_rollout"]["load"] = str(other)
    ring.rollouts[0].config = str(write_config(tmp_path / "rollout.yaml", cfg))
    ring.start()
    trainer = ring.trainer
    deadline = time.monotonic() + 120
    while trainer.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert trainer.proc.returncode == runlog.EXIT_STOPPED_BY_RULE, trainer.log_tail()
    log = trainer.log_text()
    assert "stopping the run: replica" in log and "refused version 1" in log, log[-3000:]
    assert "model.layers.2" in log  # the tensors the update lacks are named
    assert "give rollout the same model as the trainer" in log
    assert [e["event"] for e in _events(ring)] == ["stopped"]
    assert len(ring.metrics()) <= 1  # it stopped after the first push, not after 20 steps of stale drops


def test_a_ring_without_a_current_replica_waits_idle_and_resumes(rings):
    """The replica comes back with the wrong API token: it serves and takes jobs, but refuses every push (a refusal
    a retry may fix: the token can be corrected). Its samples would all be stale: the ring waits, idle, until the
    replica, restarted with the right token, serves the newest weights."""
    # no checkpoint until the end: a restarted replica starts from the initial weights and needs the trainer's push
    ring = rings("e2e-waits", train_iters=4, save_interval=50)
    replica = ring.rollouts[0]
    ring.start()
    ring.wait_for(lambda: len(ring.metrics()) >= 1, 180, "first step")
    replica.stop()
    token = replica.env["RLHF_API_TOKEN"]
    replica.env["RLHF_API_TOKEN"] = "not-the-token"
    ring.start_replica(0)
    ring.wait_for(lambda: any(e["event"] == "waiting" for e in _events(ring)), 120, "waiting event")
    waiting = next(e for e in _events(ring) if e["event"] == "waiting")
    assert f"waiting for {replica.grpc_addr} to load version" in waiting["message"], waiting
    pid = ring.trainer.proc.pid
    before, t0 = _cpu_seconds(pid), time.monotonic()
    time.sleep(4)
    busy = (_cpu_seconds(pid) - before) / (time.monotonic() - t0)
    assert busy < 0.25, f"the waiting trainer used {busy:.2f} of a core"
    steps = len(ring.metrics())
    replica.stop()
    replica.env["RLHF_API_TOKEN"] = token
    ring.start_replica(0)
    ring.wait_trained(timeout=240)
    log = ring.trainer.log_text()
    events = _events(ring)
    kinds = [e["event"] for e in events]
    # one event per change of state (down, starting, up with the wrong token), not one per retry every 2 s
    assert 1 <= kinds.count("waiting") <= 4 and kinds[-1] == "resumed", kinds
    assert any("UNAUTHENTICATED" in e.get("message", "") for e in events), events
    assert log.count("pushing version") <= 4, "the catch-up loop's retries are not logged one by one"
    assert len(ring.metrics()) == 4 and steps < 4
    assert log.count("weight sync to") <= 4
