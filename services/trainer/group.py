"""The command protocol of a torchrun trainer group: rank 0 leads, every other rank follows.

Rank 0 sends one command at a time (step, gather the policy, save, load, no-op, stop) with what it needs (a batch,
a checkpoint path); the other ranks wait in :meth:`Commands.follow` and run the same collectives for it, in the same
order. Commands and batches go as tensors through ``rlhf.distributed`` broadcasts: no pickle. What a command does is
the caller's (the engine passes its handlers to ``follow``); this module only keeps both sides in step.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from rlhf import distributed as dist
from services.trainer.batch import RolloutBatch

NOOP, STEP, GATHER, STOP, SAVE, LOAD = 0, 1, 2, 3, 4, 5


class Commands:
    """Both ends of the protocol on one rank's ``device``."""

    def __init__(self, device: torch.device):
        self.device = device
        # Rank 0's commands (a step, a weight gather, a checkpoint, a heartbeat) go one at a time, each with its
        # collectives: they come from different threads (the step's, a push's, the loop's).
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def lead(self, cmd: int, batch: RolloutBatch | None = None, path: Path | None = None) -> Iterator[None]:
        """Rank 0: send ``cmd`` (with the batch of a step, the folder of a save or load), then hold the group for
        the collectives the body runs: no other command comes between them."""
        with self._lock:
            dist.broadcast_ints([cmd], 1, self.device)
            if batch is not None:
                dist.broadcast_ints([batch.context_length], 1, self.device)
                dist.broadcast_tensors(batch.wire_tensors(), len(RolloutBatch.WIRE_FIELDS), self.device)
            if path is not None:
                dist.broadcast_text(str(path), self.device)
            yield

    def follow(
        self,
        step: Callable[[RolloutBatch], object],
        gather: Callable[[], None],
        save: Callable[[Path], None],
        load: Callable[[Path], None],
    ) -> None:
        """Ranks other than 0: run each command rank 0 sends with its handler, until it sends STOP."""
        while True:
            (cmd,) = dist.broadcast_ints(None, 1, self.device)
            if cmd == STOP:
                return
            if cmd == STEP:
                step(self._receive_batch())
            elif cmd == GATHER:
                gather()
            elif cmd in (SAVE, LOAD):
                path = Path(dist.broadcast_text(None, self.device))
                (save if cmd == SAVE else load)(path)
            elif cmd != NOOP:
                raise RuntimeError(f"trainer group: unknown command {cmd} from rank 0")

    def _receive_batch(self) -> RolloutBatch:
        (context_length,) = dist.broadcast_ints(None, 1, self.device)
        return RolloutBatch.from_wire(
            context_length, dist.broadcast_tensors(None, len(RolloutBatch.WIRE_FIELDS), self.device)
        )
