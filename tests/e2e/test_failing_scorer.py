"""A user's reward function that raises on every item: the reward service logs it with its traceback, and the run
stops with a message naming the scorer (instead of training on nothing, or dying with a message that names no one).
"""

from __future__ import annotations

import pytest

from rlhf import runlog
from tests.e2e._ring import CHILD_ENV, base_config
from tests.integration._procs import ServiceProc, write_config

pytestmark = pytest.mark.slow


def test_a_ring_whose_scorer_always_raises_stops_naming_it(rings, tmp_path):
    (tmp_path / "myreward.py").write_text("def score(prompt, response, label, **kw):\n    return len(response) / 0\n")
    cfg = base_config("e2e-badscorer")
    cfg["reward"] = {"scorers": [{"type": "rule", "name": "myreward:score"}]}
    config = write_config(tmp_path / "reward.yaml", cfg)
    # cwd: the reward service imports the module from its folder
    reward = rings.own(ServiceProc("reward", config, tmp_path / "logs", env=dict(CHILD_ENV), cwd=tmp_path))
    reward.start(wait_ready=False)
    ring = rings("e2e-badscorer", reward=reward, stage="ray_grpo", n=2, train_iters=10)
    ring.cfg["reward"]["failed_patience"] = 2
    write_config(ring.config_path, ring.cfg)
    reward.wait_ready(180)
    ring.start()
    ring.wait_for(lambda: ring.trainer.proc.poll() is not None, 240, "the trainer to stop")
    assert ring.trainer.proc.returncode == runlog.EXIT_STOPPED_BY_RULE, ring.trainer.log_tail()
    log = ring.trainer.log_text()
    assert "stopping the run: more than 50% of the samples failed scoring for 2 steps in a row" in log
    assert "scorer 'score' failed" in log and "ZeroDivisionError" in log, log[-2000:]
    assert ring.metrics() == []  # no update was made from a reward that never scored
    reward_log = reward.log_text()
    assert "scorer 'score' raised ZeroDivisionError" in reward_log
    assert "return len(response) / 0" in reward_log  # the traceback, with the user's line
