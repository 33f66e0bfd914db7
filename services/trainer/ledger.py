"""Which prompt jobs the trainer has consumed (trained on, or dropped as stale), and which experience entries wait for
a checkpoint before they are acknowledged: the ``Ledger``.

The job ids consumed since the last checkpoint form a window. A checkpoint closes it: the window goes to the run's
``trained_jobs.jsonl`` (before the checkpoint, so a checkpoint never covers jobs the ledger file lacks) and stays in
the duplicate filter for ``KEEP_WINDOWS`` checkpoints. Older windows are forgotten: their experience was acknowledged
before the next checkpoint began, so no record of them can come back, and the trainer's memory, its checkpoints and
Redis stay bounded however long the run is.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from rlhf import runlog
from rlhf.v1 import experience_pb2

LEDGER = "trained_jobs.jsonl"  # in the run folder: per checkpoint, the job ids trained since the one before
KEEP_WINDOWS = 2  # checkpoint windows of trained job ids kept for the duplicate filter


class Ledger:
    def __init__(self, run_dir: Path):
        self.path = run_dir / LEDGER
        self.trained_job_ids: set[str] = set()  # the duplicate filter: the jobs of the last few checkpoint windows
        self._window: set[str] = set()  # consumed since the last checkpoint
        self._window_stale: set[str] = set()  # of those, dropped as stale
        self._windows: collections.deque[tuple[int, set[str]]] = collections.deque()  # (checkpoint step, job ids)
        self.unacked: list[str] = []  # experience entries consumed, acknowledged once a checkpoint covers them

    def restore(self, state: dict[str, Any]) -> None:
        """The duplicate filter of a checkpoint's ``state.json`` (older checkpoints: one window of every id)."""
        windows = state.get("trained_job_windows") or [[state["step"], state.get("trained_job_ids", [])]]
        self._windows = collections.deque((int(st), set(ids)) for st, ids in windows)
        self.trained_job_ids = set().union(*(ids for _, ids in self._windows))

    def truncate_after(self, step: int) -> None:
        """A restart from the checkpoint of ``step``: the later windows are trained again."""
        runlog.truncate_after(self.path, step)

    def consumed(self, records: list[tuple[str, experience_pb2.Experience]], stale: bool = False) -> None:
        """``records`` (entry id, record) are done with: trained on, or (``stale``) dropped unread. A duplicate
        record of one of them is dropped too."""
        ids = [e.job_id for _, e in records]
        self.trained_job_ids.update(ids)
        self._window.update(ids)
        if stale:
            self._window_stale.update(ids)
        self.unacked.extend(entry for entry, _ in records)

    def duplicates(self, entry_ids: list[str]) -> None:
        """Entries of jobs already consumed: acknowledged with the next checkpoint, never trained."""
        self.unacked.extend(entry_ids)

    def close_window(self, step: int) -> set[str]:
        """At the checkpoint of ``step``: write the window to the ledger file and keep it in the duplicate filter.
        Returns the job ids the filter forgets now (windows older than ``KEEP_WINDOWS``)."""
        dropped: set[str] = set()
        if not self._window:
            return dropped
        line = {"step": step, "job_ids": sorted(self._window - self._window_stale)}
        if self._window_stale:
            line["dropped_stale"] = sorted(self._window_stale)
        runlog.append(self.path, line)
        if self._windows and self._windows[-1][0] == step:
            self._windows[-1][1].update(self._window)
        else:
            self._windows.append((step, self._window))
        self._window, self._window_stale = set(), set()
        while len(self._windows) > KEEP_WINDOWS:
            dropped |= self._windows.popleft()[1]
        self.trained_job_ids -= dropped
        return dropped

    def checkpoint_fields(self) -> dict[str, Any]:
        """The duplicate filter as ``state.json`` holds it."""
        return {
            "trained_job_ids": sorted(self.trained_job_ids),
            "trained_job_windows": [[st, sorted(ids)] for st, ids in self._windows],
        }

    def acked(self, n: int) -> None:
        """The first ``n`` unacknowledged entries were acknowledged (more may have come meanwhile)."""
        self.unacked = self.unacked[n:]
