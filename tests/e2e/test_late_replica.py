"""A rollout replica that starts after the trainer's last push serves the initial weights: it must take no job until
the trainer brings it up to date, or its samples would be as many versions stale as it is behind.

The ring is synchronous (``max_staleness: 0``) and the replica starts only after the trainer has published its
version, so the regular per-step push never comes (no experience, no step): only the trainer's catch-up push can
start the run, and a replica that took jobs at version 0 would show in the samples' versions.
"""

from __future__ import annotations

import re
import urllib.request

import pytest

from rlhf.transport import publish_policy_version
from tests.e2e._ring import TOKEN

pytestmark = pytest.mark.slow


def test_late_replica_waits_for_the_catch_up_push(rings):
    ring = rings("e2e-late", stage="ray_grpo", n=2, train_iters=3)
    # An earlier life of the run had published version 3 (and left no checkpoint).
    ring.redis_call(lambda r: publish_policy_version(r, ring.run_id, 3))
    trainer = ring.start_trainer()  # pushes its weights as version 4 to a replica that is not there yet
    ring.wait_for(
        lambda: "starting over from the initial weights as version 4" in trainer.log_text(), 60, "trainer start"
    )
    ring.start(trainer=False)
    ring.wait_trained(timeout=240)
    replica_log = ring.rollouts[0].log_text()
    assert "serving weights version 0, the run is at 4: waiting for the trainer's push" in replica_log
    assert "weights version 4: taking jobs" in replica_log
    assert "is at 4: pushing version 4" in trainer.log_text()
    metrics = ring.metrics()
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["staleness/max"] == 0 for m in metrics), [m["staleness/max"] for m in metrics]


def test_a_replica_added_to_a_running_ring_starts_at_the_current_version(rings):
    """A scale-up mid-run: the second replica (in the trainer's address list from the start, as a Deployment's new
    pod is behind its headless Service) starts after several pushes. It loads the newest checkpoint, takes no job
    until it serves the published version (the trainer's catch-up push), and the staleness bound holds."""
    ring = rings("e2e-scale", stage="ray_grpo", n=2, train_iters=30, replicas=2, max_staleness=1)

    def admin(what: str) -> None:
        req = urllib.request.Request(
            f"{ring.trainer.http_url}/v1/{what}", method="POST", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        urllib.request.urlopen(req, timeout=10).read()

    first_job = re.compile(r"first job with weights version (\d+) \(the run published (\d+)\)")
    ring.start(replicas=1)
    ring.wait_steps(3, timeout=240)
    admin("pause")  # the tiny ring trains faster than a replica starts: hold it while the new one starts
    ring.start_replica(1)
    admin("resume")
    ring.wait_for(lambda: first_job.search(ring.rollouts[1].log_text()), 240, "job on the late replica")
    ring.wait_trained(timeout=300)
    late = ring.rollouts[1].log_text()
    m = first_job.search(late)
    served, published = int(m.group(1)), int(m.group(2))
    assert published >= 3 and served >= published  # never a job at the initial weights
    loaded = re.search(r"loaded checkpoint .* as weights version (\d+)", late)
    assert loaded and int(loaded.group(1)) >= 2, late[-3000:]  # the run's newest checkpoint, before any job
    metrics = ring.metrics()
    assert [m["step"] for m in metrics] == list(range(1, 31))
    assert all(m["staleness/max"] <= 1 for m in metrics), [m["staleness/max"] for m in metrics]


def test_with_the_trainer_down_a_new_replica_serves_the_newest_checkpoint(rings):
    """The trainer has stopped (here: finished its run): a replica that starts now loads the run's newest complete
    checkpoint, the weights a trainer resumes from, and reports that version."""
    ring = rings(
        "e2e-down", stage="ray_grpo", n=2, train_iters=3, replicas=2, rollout_env={"RLHF_ROLLOUT_CATCH_UP_WAIT_S": "1"}
    )
    ring.start(replicas=1)
    ring.wait_trained(timeout=240)
    ring.trainer.proc.wait(timeout=60)  # the trainer exits after train_iters: it is down from here on
    state = ring.state()
    ring.start_replica(1)
    assert ring.served_version(1) == state["policy_version"] > 0
    log_text = ring.rollouts[1].log_text()
    assert f"loaded checkpoint {ring.checkpoint_dir()}" in log_text
