"""A rollout replica that starts after the trainer's last push serves the initial weights: it must take no job until
the trainer brings it up to date, or its samples would be as many versions stale as it is behind.

The ring is synchronous (``max_staleness: 0``) and the replica starts only after the trainer has published its
version, so the regular per-step push never comes (no experience, no step): only the trainer's catch-up push can
start the run, and a replica that took jobs at version 0 would show in the samples' versions.
"""

from __future__ import annotations

import pytest
from _ring import Redis, Ring

from rlhf.transport import publish_policy_version

pytestmark = pytest.mark.slow


def test_late_replica_waits_for_the_catch_up_push(scorers, tmp_path):
    redis = Redis(tmp_path / "redis").start()
    reward, reference = scorers.get()
    ring = Ring("e2e-late", tmp_path / "ring", redis, reward.grpc_addr, reference.grpc_addr, stage="ray_grpo", n=2,
                train_iters=3)  # fmt: skip
    try:
        # An earlier life of the run had published version 3 (and left no checkpoint).
        ring.redis_call(lambda r: publish_policy_version(r, ring.run_id, 3))
        trainer = ring.start_trainer()  # pushes its weights as version 4 to a replica that is not there yet
        ring.wait_for(lambda: "starting over from the initial weights as version 4" in trainer.log_text(), 60,
                      "trainer start")  # fmt: skip
        ring.start(trainer=False)
        ring.wait_trained(timeout=240)
        replica_log = ring.rollouts[0].log_text()
        assert "serving weights version 0, the run is at 4: waiting for the trainer's push" in replica_log
        assert "weights version 4: taking jobs" in replica_log
        assert "is at 4: pushing version 4" in trainer.log_text()
        metrics = ring.metrics()
        assert [m["step"] for m in metrics] == [1, 2, 3]
        assert all(m["staleness/max"] == 0 for m in metrics), [m["staleness/max"] for m in metrics]
    finally:
        ring.stop()
        redis.stop()
