"""A ring whose trainer pushes by collective broadcast (``RLHF_WEIGHTS_TRANSPORT=collective``, gloo on CPU) to two
rollout replicas at once, one on the ``hf`` engine and one on vLLM: every push reaches both, each verifies every
bucket's sha256 before it swaps (so both serve bit-identical bytes), and the run learns as over the data plane."""

from __future__ import annotations

import pytest

from tests.e2e._ring import http_json

pytestmark = pytest.mark.slow


def test_collective_pushes_reach_an_hf_and_a_vllm_replica(rings):
    ring = rings("e2e-coll", stage="ray_grpo", n=2, train_iters=4, replicas=2)
    ring.trainer_env["RLHF_WEIGHTS_TRANSPORT"] = "collective"
    ring.rollouts[1].env["RLHF_ROLLOUT_ENGINE"] = "vllm"
    ring.start()
    ring.wait_trained(timeout=300)
    trainer_log = ring.trainer.log_text()
    assert "weight sync to" not in trainer_log, trainer_log[-3000:]  # no push failed
    served = [http_json(r.http_url + "/v1/weights/version") for r in ring.rollouts]
    assert [s["engine"] for s in served] == ["hf", "vllm"]
    assert served[0]["version"] == served[1]["version"] == ring.state()["policy_version"] >= 4
    assert served[0]["checksum"] == served[1]["checksum"] != "initial"  # the same verified bytes
    assert [m["step"] for m in ring.metrics()] == [1, 2, 3, 4]
