"""A run's ``metrics.jsonl``: one JSON object per training step, appended by the trainer.

A trainer that resumes from the checkpoint of step N trains steps N+1... again, so it first cuts the file back to
step N (:func:`truncate_after`): the file then holds each step once, in order, whatever crashes the run went through.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# The trainer's exit code when the run stopped itself by one of its rules (for example its reward failing for too
# many steps): a supervisor should not restart it, since a restart would fail the same way.
EXIT_STOPPED_BY_RULE = 3


class StoppedByRule(Exception):
    """Raised in the trainer once one of its rules has stopped the run (logged, a ``stopped`` event written): it
    unwinds the step, push or loop that met the rule, and the trainer exits ``EXIT_STOPPED_BY_RULE`` without a
    checkpoint (services/trainer/loop.py: ``Trainer._stop_ring``)."""


def append(path: str | Path, record: dict) -> None:
    """One JSON line at the end of ``path``; its folder is made if needed (a trainer's first events can come before
    its first checkpoint makes the run folder)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def truncate_after(path: str | Path, step: int) -> int:
    """Cut ``path`` (in place, same file) just before the first record whose ``step`` exceeds ``step``, and any
    half-written last line; returns how many lines were removed (0 when the file is missing or already ends there)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    keep = 0
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if not line.strip():
            keep += len(line) + 1
            continue
        try:
            rec = json.loads(line)
            s = int(rec["step"])
        except (ValueError, KeyError, TypeError):
            s = None
        if s is None or s > step or i == len(lines) - 1:  # unreadable, later, or not newline-terminated
            removed = sum(1 for x in lines[i:] if x.strip())
            with open(path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
            return removed
        keep += len(line) + 1
    return 0


def checkpoint_step(checkpoints: str | Path) -> int:
    """The step of the checkpoint ``checkpoints/latest`` names (``step_<N>``), 0 when there is none: where a trainer
    started on this run folder resumes from."""
    try:
        name = (Path(checkpoints) / "latest").read_text().strip()
    except OSError:
        return 0
    suffix = name[len("step_") :] if name.startswith("step_") else ""
    return int(suffix) if suffix.isdigit() else 0
