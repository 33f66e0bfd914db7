"""The streamed weight push of a trainer group, for tests/trainer/test_stream_push.py.

``python tests/trainer/stream_worker.py OUT key=value ...`` with the torchrun environment (world size 2) or none
(world size 1: writes ``OUT/world1.safetensors``, the policy as ``policy_state_dict`` gives it, and stops). Keys:
``bucket`` (bytes), ``token``, ``replica`` (a live replica's address), ``victim`` and ``victim_pid`` (a replica this
worker kills -9 in the middle of a push to it and ``replica``), ``dead`` (an address where nothing listens).

Rank 0 of the group, as the trainer does:

1. streams the initial policy without sending it, counting what the streaming holds: the gathered tensors alive at
   once (``rlhf.distributed.full_value``'s results, by weakref) and the Python heap's peak (tracemalloc: the bucket
   buffer), then does the same for today's whole-state-dict ``pack_weights``; writes the streamed tensors;
2. trains one step, then pushes a new version each time: grpc to ``replica``; collective to ``replica``; tcp to
   ``replica`` and ``victim`` (killed half-way through the second pass); auto to ``replica`` and ``dead``;
3. writes ``OUT/pushed.safetensors`` (the policy gathered today's way, after the pushes) and ``OUT/report.json``.
The other rank follows; both must exit (no follower left waiting in a gather).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sys
import tracemalloc
import weakref
from pathlib import Path

import torch
from dist_worker import batch, config
from safetensors.torch import save_file

from rlhf import distributed
from rlhf.transport.weights import load_safetensors, pack_weights, push_weights_streamed
from services.trainer.engine import TrainerEngine

_full_value = distributed.full_value


class Gathers:
    """Wraps ``rlhf.distributed.full_value`` (the engine's gather): counts calls and the bytes of its results alive."""

    def __init__(self):
        self.calls = self.live = self.max_live = 0
        self.on_call = None

    def __call__(self, x):
        t = _full_value(x)
        self.calls += 1
        n = t.numel() * t.element_size()
        self.live += n
        self.max_live = max(self.max_live, self.live)
        weakref.finalize(t, self._freed, n)
        if self.on_call is not None:
            self.on_call(self.calls)
        return t

    def _freed(self, n: int) -> None:
        self.live -= n

    def reset(self) -> None:
        self.calls = self.max_live = 0


def measure(engine: TrainerEngine, bucket: int, out: Path) -> dict:
    gathers = Gathers()
    distributed.full_value = gathers
    try:
        stream = engine.policy_stream(1, bucket_bytes=bucket)
        tracemalloc.start()
        header = stream.seal()
        digests = [hashlib.sha256(b).hexdigest() for b in stream.buckets()]
        stream_heap = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        stream_live, gathers_per_pass = gathers.max_live, gathers.calls // 2
        got: dict[str, torch.Tensor] = {}
        for b in stream.buckets():
            got.update({k: v.clone() for k, v in load_safetensors(bytes(b)).items()})
        save_file(got, out / "streamed.safetensors")
        tracemalloc.start()
        packed = pack_weights(engine.policy_state_dict(), 1, bucket_bytes=bucket)
        pack_heap = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        sizes = {k: v.numel() * v.element_size() for k, v in engine.actor.state_dict().items()}
        return {
            "buckets": len(header.buckets),
            "total_bytes": header.total_bytes,
            "buffer_bytes": stream.buffer_bytes,
            "largest_bucket": max(b.nbytes for b in header.buckets),
            "largest_gathered": max(sizes.values()),
            "gathered_total": sum(sizes.values()),
            "stream_max_live_gathered": stream_live,
            "stream_heap_peak": stream_heap,
            "pack_heap_peak": pack_heap,
            "pack_total_bytes": packed.total_bytes,
            "gathers_per_pass": gathers_per_pass,
            "tensors": len(sizes),
            "digests_equal": digests == [b.sha256 for b in header.buckets],
        }
    finally:
        distributed.full_value = _full_value


def outcome(res) -> dict:
    if isinstance(res, BaseException):
        return {"error": f"{type(res).__name__}: {res}"}
    return {"version": res.version, "checksum": res.checksum, "swapped": res.swapped}


def push(engine: TrainerEngine, opts: dict, report: dict) -> None:
    bucket, token = int(opts["bucket"]), opts["token"]
    replica, victim, dead = opts["replica"], opts["victim"], opts["dead"]
    gathers = Gathers()
    distributed.full_value = gathers
    n = len(engine.actor.state_dict())
    runs = [("grpc", [replica]), ("collective", [replica]), ("tcp", [replica, victim]), ("auto", [replica, dead])]
    try:
        for i, (transport, targets) in enumerate(runs):
            version = engine.policy_version + 1 + i
            stream = engine.policy_stream(version, bucket_bytes=bucket)
            gathers.reset()
            if victim in targets:  # kill -9 half-way through the second pass (the first one only hashes)
                gathers.on_call = lambda c: c == n + n // 2 and os.kill(int(opts["victim_pid"]), signal.SIGKILL)
            results = asyncio.run(push_weights_streamed(targets, stream, token=token, timeout=60, transport=transport))
            gathers.on_call = None
            report[transport] = {
                "version": version,
                "checksum": stream.checksum,
                "gathers": gathers.calls,
                "results": {t: outcome(r) for t, r in results.items()},
            }
    finally:
        distributed.full_value = _full_value


def main() -> None:
    out = Path(sys.argv[1])
    opts = dict(a.split("=", 1) for a in sys.argv[2:])
    cfg = config("ray_grpo", {"bf16": opts.get("bf16") == "1"})
    engine = TrainerEngine(cfg)
    if engine.group is None:
        save_file(engine.policy_state_dict(), out / "world1.safetensors")
        return
    if not engine.group.is_driver:
        engine.follow()
        distributed.destroy()
        return
    report = {"measure": measure(engine, int(opts["bucket"]), out)}
    engine.step(batch(cfg.actor.n_samples_per_prompt))
    push(engine, opts, report)
    save_file(engine.policy_state_dict(), out / "pushed.safetensors")
    engine.stop_followers()
    distributed.destroy()
    (out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
