"""Delta pushes: send only the 16-bit words of each bucket that changed since the update the replica holds.

:func:`make_delta` encodes each bucket as the smallest of ``sparse16``, ``runs16`` and the bucket in full; the
replica rebuilds each bucket from its :class:`DeltaBase` and checks the rebuilt bucket's sha256 exactly as a full
push's, so the result is verified bit for bit; a replica without that base refuses the header
(``DeltaBaseMissing``) and gets the full update.

Design (the encodings, when it pays, measurements): docs/weight-sync.md#delta-pushes-rlhf_weights_delta-on-the-trainer.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlhf.transport.weights.errors import CorruptUpdate, DeltaBaseMissing
from rlhf.transport.weights.format import Manifest
from rlhf.transport.weights.pack import PackedWeights
from rlhf.transport.weights.verify import finish_bucket
from rlhf.v1 import weights_pb2

SPARSE, RUNS = "sparse16", "runs16"
ENCODINGS = (SPARSE, RUNS)
_N = struct.Struct("<Q")
_MAX_WORDS = 1 << 32  # u32 indices


@dataclass(frozen=True)
class DeltaBase:
    """The update a replica keeps as the base of the next delta: its version, header checksum and the safetensors
    buckets in index order (for the hf engine these are the memory the served parameters already live in)."""

    version: int
    checksum: str
    buckets: list[Any]


@dataclass(frozen=True)
class DeltaStats:
    """What a delta push saves, per update: bytes on the wire against the full update, words changed."""

    wire_bytes: int
    full_bytes: int
    changed_words: int
    total_words: int
    delta_buckets: int
    buckets: int

    @property
    def changed_fraction(self) -> float:
        return self.changed_words / max(1, self.total_words)


# ------------------------------------------------------------------------------------------------ trainer side


def encode_bucket(old: Any, new: Any) -> tuple[str, bytes, int] | None:
    """The smaller delta of ``new`` against ``old`` (two safetensors buckets) as (encoding, payload, words changed),
    or None when the full bucket is no larger, or the buckets cannot be compared word for word."""
    n = len(new)
    if len(old) != n or n % 2 or n // 2 >= _MAX_WORDS:
        return None
    a = np.frombuffer(old, dtype="<u2")
    b = np.frombuffer(new, dtype="<u2")
    changed = a != b
    k = int(np.count_nonzero(changed))
    if k == 0:
        return SPARSE, _N.pack(0), 0
    if 8 + 2 * k >= n:  # not even one run of every change would be smaller: no index array built
        return None
    idx = np.flatnonzero(changed)
    del changed
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1  # where a new run starts, after the first
    runs = int(breaks.size) + 1
    sparse_size, runs_size = 8 + 6 * k, 8 + 8 * runs + 2 * k
    if min(sparse_size, runs_size) >= n:
        return None
    values = b[idx].tobytes()
    if sparse_size <= runs_size:
        return SPARSE, b"".join((_N.pack(k), idx.astype("<u4").tobytes(), values)), k
    first = np.concatenate(([0], breaks))
    starts = idx[first]
    lengths = np.diff(np.concatenate((first, [k])))
    return RUNS, b"".join((_N.pack(runs), starts.astype("<u4").tobytes(), lengths.astype("<u4").tobytes(), values)), k


def make_delta(base: PackedWeights, new: PackedWeights) -> tuple[PackedWeights | None, DeltaStats]:
    """``new`` (sealed, host buckets) as a delta against ``base`` (the update the replicas hold, sealed): the same
    header (manifest, version, checksum) with each bucket either in full or delta-encoded, or None when no bucket is
    smaller as a delta (then push ``new`` as it is). The delta's buckets are new bytes; ``new`` is unchanged."""
    if base.on_device or new.on_device:
        raise ValueError("delta pushes compare host buckets (a collective nccl/hccl push sends its buckets in full)")
    if not new.header.buckets or not base.header.buckets:
        raise ValueError("both updates must be sealed (PackedWeights.seal) before a delta is made")
    header = weights_pb2.WeightHeader()
    header.CopyFrom(new.header)
    header.delta_base_version = base.version
    header.delta_base_checksum = base.checksum
    header.keep_base = True

    def layout(p: PackedWeights) -> list[tuple[str, str, list[int], int]]:
        return [(t.name, t.dtype, list(t.shape), t.bucket) for t in p.header.tensors]

    same_layout = base.version < new.version and layout(base) == layout(new)
    buckets: list[Any] = []
    changed = words = delta_buckets = 0
    for i, data in enumerate(new.buckets):
        entry = header.buckets[i]
        words += len(data) // 2
        enc = encode_bucket(base.buckets[i], data) if same_layout and i < len(base.buckets) else None
        if enc is None:
            buckets.append(data)
            changed += len(data) // 2  # counted as all changed: sent whole
            continue
        encoding, payload, k = enc
        changed += k
        delta_buckets += 1
        entry.full_nbytes, entry.full_sha256 = entry.nbytes, entry.sha256
        entry.encoding, entry.nbytes, entry.sha256 = encoding, len(payload), hashlib.sha256(payload).hexdigest()
        buckets.append(payload)
    header.total_bytes = sum(b.nbytes for b in header.buckets)
    stats = DeltaStats(header.total_bytes, new.total_bytes, changed, words, delta_buckets, len(new.buckets))
    if not delta_buckets:
        return None, stats
    return PackedWeights(header, buckets), stats


# ------------------------------------------------------------------------------------------------ replica side


def is_delta(h: weights_pb2.WeightHeader) -> bool:
    return any(b.encoding for b in h.buckets)


def resolve_base(h: weights_pb2.WeightHeader, base: DeltaBase | None) -> DeltaBase | None:
    """The base a delta header applies to (None: the header has no delta bucket). Raises DeltaBaseMissing when this
    replica does not hold exactly that update, CorruptUpdate when the header's buckets do not fit it."""
    if not is_delta(h):
        return None
    if base is None or base.version != h.delta_base_version or base.checksum != h.delta_base_checksum:
        held = "no base" if base is None else f"version {base.version}"
        raise DeltaBaseMissing(
            f"the delta applies to version {h.delta_base_version} ({h.delta_base_checksum[:12]}), this replica holds "
            f"{held}: send the full update",
            field="header.delta_base_version",
        )
    for b in h.buckets:
        if b.encoding and (b.index >= len(base.buckets) or len(base.buckets[b.index]) != b.full_nbytes):
            raise CorruptUpdate(
                f"delta bucket {b.index} does not fit the base's bucket (the base has {len(base.buckets)} buckets)",
                field=f"header.buckets[{b.index}]",
            )
    return base


def held_bytes(h: weights_pb2.WeightHeader) -> int:
    """The bytes a replica holds for this update once received: the buckets' (a delta's rebuilt ones) and, for a
    delta, the wire buffers beside them (what a receiver's pool keeps for the next update)."""
    full = sum(b.full_nbytes if b.encoding else b.nbytes for b in h.buckets)
    return full + (h.total_bytes if is_delta(h) else 0)


def rebuild_buffers(h: weights_pb2.WeightHeader, take: Any) -> list[bytearray | None]:
    """Per bucket, the buffer a delta bucket is rebuilt in (``take(nbytes)``, a pool's: taken on the event loop at
    the header, as the receive buffers are), None for a bucket sent whole."""
    return [take(b.full_nbytes) if b.encoding else None for b in h.buckets]


def apply_bucket(old: Any, payload: Any, encoding: str, full_nbytes: int, out: bytearray | None = None) -> bytearray:
    """The bucket rebuilt from its base bytes ``old`` and a delta ``payload`` in ``out`` (a buffer of
    ``full_nbytes``, e.g. reused from the receiver's pool: fresh memory costs a page fault per 4 KiB), or a new one;
    ``old`` is unchanged (it may be serving). Raises CorruptUpdate for a payload that does not parse or points
    outside the bucket."""
    if len(old) != full_nbytes or full_nbytes % 2:
        raise CorruptUpdate(f"a delta applies to a bucket of {len(old)} bytes, not {full_nbytes}")
    p = memoryview(payload).cast("B")
    words = full_nbytes // 2
    if len(p) < 8:
        raise CorruptUpdate("delta payload shorter than its count")
    (n,) = _N.unpack_from(p)
    if n > words:
        raise CorruptUpdate(f"delta payload lists {n} changes in a bucket of {words} words")
    if encoding == SPARSE:
        if len(p) != 8 + 6 * n:
            raise CorruptUpdate(f"sparse delta of {n} changes has {len(p)} bytes, not {8 + 6 * n}")
        idx = np.frombuffer(p, dtype="<u4", count=n, offset=8)
        values = np.frombuffer(p, dtype="<u2", count=n, offset=8 + 4 * n)
    elif encoding == RUNS:
        if len(p) < 8 + 8 * n:
            raise CorruptUpdate(f"run-length delta of {n} runs has only {len(p)} bytes")
        starts = np.frombuffer(p, dtype="<u4", count=n, offset=8).astype(np.int64)
        lengths = np.frombuffer(p, dtype="<u4", count=n, offset=8 + 4 * n).astype(np.int64)
        k = int(lengths.sum())
        if len(p) != 8 + 8 * n + 2 * k or (n and int((starts + lengths).max()) > words):
            raise CorruptUpdate("run-length delta does not fit its runs or the bucket")
        # every changed word's index: each run's start repeated over its length, plus the position inside it
        offsets = np.cumsum(lengths) - lengths
        idx = np.repeat(starts - offsets, lengths) + np.arange(k, dtype=np.int64)
        values = np.frombuffer(p, dtype="<u2", count=k, offset=8 + 8 * n)
    else:
        raise CorruptUpdate(f"unknown delta encoding {encoding!r}")
    if idx.size and int(idx.max()) >= words:
        raise CorruptUpdate("delta index outside the bucket")
    if out is None:
        out = bytearray(old)
    else:
        if len(out) != full_nbytes:
            raise ValueError(f"the buffer for a rebuilt bucket has {len(out)} bytes, not {full_nbytes}")
        memoryview(out)[:] = memoryview(old).cast("B")
    np.frombuffer(out, dtype="<u2")[idx] = values
    return out


def finish_delta_bucket(
    index: int,
    payload: Any,
    digest: str,
    spec: weights_pb2.BucketEntry,
    manifest: Manifest,
    base: DeltaBase,
    out: bytearray | None = None,
) -> tuple[dict[str, torch.Tensor], bytearray]:
    """A received delta bucket: its wire digest checked, the bucket rebuilt on the base, then the same check as a
    full push's bucket (:func:`finish_bucket`: the full update's sha256, the manifest, finite values). Returns the
    tensors (views into the rebuilt bucket: ``out`` when given) and the rebuilt bucket."""
    if digest != spec.sha256:
        raise CorruptUpdate(f"delta bucket {index}: sha256 {digest} does not match the header's {spec.sha256}")
    full = apply_bucket(base.buckets[index], payload, spec.encoding, spec.full_nbytes, out)
    return finish_bucket(index, full, hashlib.sha256(full).hexdigest(), spec.full_sha256, manifest), full
