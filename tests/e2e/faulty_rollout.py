"""A rollout replica that acknowledges weight pushes without loading them, for tests only: ``python -m
tests.e2e.faulty_rollout serve rollout ...`` is ``rlhf serve rollout`` whose engine skips the install of every swap
yet reports success and advances the served version, as a replica whose load failed silently would. The trainer must
catch it by the trainer-inference mismatch (tests/e2e/test_mismatch_ring.py). Production code has no such switch."""

from __future__ import annotations

import logging
import sys

from services.rollout import main as rollout_main
from services.rollout.factory import make_engine

log = logging.getLogger("rlhf.rollout")


def make_skip_load_engine(cfg, **kw):
    engine = make_engine(cfg, **kw)

    async def skip(staged) -> None:
        log.warning("FAULT INJECTION: weights acknowledged, not loaded")

    engine._load_weights = skip  # the swap's install step, nothing else of the engine changed
    return engine


if __name__ == "__main__":
    from services.cli import main

    rollout_main.make_engine = make_skip_load_engine
    sys.exit(main())
