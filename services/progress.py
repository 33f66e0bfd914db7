"""What ``rlhf up`` prints while a run goes: one line per training step from the trainer's ``metrics.jsonl``
(reward, KL, throughput, staleness, mismatch, queue depths, time per step, elapsed and ETA), and the trainer's
events (waiting for a replica, resumed)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.report import parse_record


class MetricsTail:
    """Reads the complete lines appended to a JSONL file since the last call."""

    def __init__(self, path: Path, from_end: bool = False):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if from_end and self.path.exists() else 0
        self._partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:  # cut back by a trainer resuming from a checkpoint: follow from the cut
                    self.offset, self._partial = size, b""
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        return [rec for rec in map(parse_record, lines) if rec is not None]


def _pick(rec: Mapping[str, Any], *names: str, contains: str | None = None) -> tuple[str, float] | None:
    for n in names:
        v = _num_or_none(rec.get(n))
        if v is not None:
            return n, v
    if contains:  # a fraction of failures is not the quantity itself
        for k, v in rec.items():
            if contains in k.lower() and not k.endswith("failed_fraction") and _num_or_none(v) is not None:
                return k, float(v)
    return None


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Eta:
    """Time left from the pace of the steps seen in this session (a resumed run's earlier steps do not count)."""

    def __init__(self, total: int | None):
        self.total = total
        self.first: tuple[float, float] | None = None

    def __call__(self, rec: Mapping[str, Any], now: float) -> float | None:
        step = _num_or_none(rec.get("step"))
        if step is None or not self.total:
            return None
        if self.first is None:
            self.first = (now, step)
            return None
        t0, s0 = self.first
        if step <= s0 or now <= t0:
            return None
        return (self.total - step) * (now - t0) / (step - s0)


def _num_or_none(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def format_event(ev: Mapping[str, Any], total: int, names: Mapping[str, str]) -> str:
    """A trainer event as a progress line; replica addresses get their service names (rollout-0)."""
    step = f"step {int(ev.get('step', 0))}/{total}"
    if ev.get("event") == "resumed":
        return f"{step}  a replica serves the newest weights again; training goes on"
    message = str(ev.get("message", ""))
    for addr, name in names.items():
        message = message.replace(f"for {addr} ", f"for {name} ({addr}) ")
    return f"{step}  {message}"


def format_progress(
    rec: Mapping[str, Any], total: int | None = None, elapsed: float | None = None, eta_s: float | None = None
) -> str:
    """One progress line for a metrics record."""
    step = rec.get("step", "?")
    parts = [f"step {step}/{total}" if total else f"step {step}"]
    if any(k.startswith("eval/") for k in rec):
        return "  ".join([*parts, format_eval(rec)])
    fields = [
        ("reward", _pick(rec, "reward/mean", "reward", "score/mean", contains="reward"), "{:+.4f}"),
        ("kl", _pick(rec, "objective/kl", "kl/mean", "kl", contains="kl"), "{:.4f}"),
        ("samples/s", _pick(rec, "samples_per_s", "throughput/samples_per_s", contains="samples_per_s"), "{:.1f}"),
        ("staleness", _pick(rec, "staleness/mean", contains="staleness"), "{:.2f}"),
        ("mismatch", _pick(rec, "mismatch/kl"), "{:.1e}"),  # trainer vs rollout log-probs: ~1e-13 fp32, ~1e-3 bf16
    ]
    for label, kv, fmt in fields:
        if kv is not None:
            parts.append(f"{label} {fmt.format(kv[1])}")
    failed = _num_or_none(rec.get("reward/failed_fraction"))
    if failed:
        parts.append(f"score failed {100 * failed:.0f}%")
    queues = [(k.split("/", 1)[1], v) for k, v in rec.items() if k.startswith("queue/") and isinstance(v, int | float)]
    if queues:
        parts.append("queue " + " ".join(f"{k}={v:g}" for k, v in queues))
    per_step = _num_or_none(rec.get("time/iteration_s"))
    if per_step is not None:
        parts.append(f"{per_step:.2f} s/step")
    if elapsed is not None or eta_s is not None:
        clock = _duration(elapsed) if elapsed is not None else ""
        parts.append(f"[{clock}{', ETA ' + _duration(eta_s) if eta_s is not None else ''}]")
    return "  ".join(parts)


def format_eval(rec: Mapping[str, Any]) -> str:
    """An ``eval/*`` row of metrics.jsonl (the evaluation beside training, services/trainer/evaluate.py)."""
    parts = ["eval"]
    reward = _num_or_none(rec.get("eval/reward_mean"))
    if reward is not None:
        parts.append(f"reward {reward:+.4f}")
    for k in sorted(k for k in rec if k.startswith("eval/pass@")):
        v = _num_or_none(rec[k])
        if v is not None:
            parts.append(f"{k.removeprefix('eval/')} {v:.3f}")
    length = _num_or_none(rec.get("eval/response_length_mean"))
    if length is not None:
        parts.append(f"length {length:.1f}")
    failed = _num_or_none(rec.get("eval/failed_fraction"))
    if failed:
        parts.append(f"score failed {100 * failed:.0f}%")
    return "  ".join(parts)
