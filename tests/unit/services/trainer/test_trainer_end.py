"""services.trainer.loop.Trainer: a failed step or a stopping rule ends the run without a checkpoint (its last step may
be half done: trained, not yet in the ledger), cancels the trainer's loops at once and leaves the exit code for
services/trainer/main.py; a SIGTERM stop still checkpoints."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from rlhf import runlog
from rlhf.config import parse_config
from rlhf.serving import NotReady, ServiceSettings
from services.trainer.loop import Trainer


def _trainer(tmp_path) -> Trainer:
    """A Trainer whose engine is past its last checkpoint (step 3 of 10), with a runner that records the stop and a
    checkpoint that records itself."""
    runner = SimpleNamespace(stop_requested=False)
    runner.request_stop = lambda: setattr(runner, "stop_requested", True)
    t = Trainer(parse_config({"training": {"train_iters": 10}}), ServiceSettings(run_dir=str(tmp_path)), runner)
    t.engine = SimpleNamespace(step_count=3, group=None)
    t.saved = []

    async def checkpoint():
        t.saved.append(t.engine.step_count)

    t._checkpoint = checkpoint
    return t


async def _run_until_the_step_fails(t: Trainer, fail) -> asyncio.Task:
    """Start the training loop beside another loop of the trainer; the first step calls ``fail``."""

    async def next_batch():
        return []

    async def train_step(batch, t0, wait_s):
        fail(t)

    t._next_batch, t._train_step = next_batch, train_step
    other = asyncio.create_task(asyncio.sleep(60))  # the publisher's loop, say
    t.tasks = [asyncio.create_task(t._train_loop()), other]
    await asyncio.wait(t.tasks)
    return other


def _raise(t: Trainer) -> None:
    raise RuntimeError("a broken step")


def _rule(t: Trainer) -> None:
    t._stop_ring("a rule says so")


@pytest.mark.parametrize("fail, code", [(_raise, 1), (_rule, runlog.EXIT_STOPPED_BY_RULE)])
def test_a_failed_step_or_a_stopping_rule_ends_the_run_without_a_checkpoint(tmp_path, caplog, fail, code):
    t = _trainer(tmp_path)

    async def main():
        other = await _run_until_the_step_fails(t, fail)
        assert other.cancelled()  # the other loops stop at once, not after the servers' grace
        assert t.exit_code == code and t.runner.stop_requested
        with pytest.raises(NotReady, match="the run has ended"):
            await t.checkpoint()  # an admin call in the servers' grace period
        await t.stop()  # what the runner does then

    with caplog.at_level(logging.INFO, logger="rlhf.trainer"):
        asyncio.run(main())
    assert t.saved == []
    failed = [r for r in caplog.records if r.getMessage() == "training failed"]
    assert len(failed) == (code == 1)  # a rule is not a failure: its own line says why
    if code == runlog.EXIT_STOPPED_BY_RULE:
        assert "stopping the run: a rule says so" in caplog.text


def test_a_sigterm_stop_checkpoints_the_steps_since_the_last_checkpoint(tmp_path):
    t = _trainer(tmp_path)

    async def main():
        t.tasks = [asyncio.create_task(asyncio.sleep(60))]
        await t.stop()

    asyncio.run(main())
    assert t.saved == [3] and t.exit_code is None
