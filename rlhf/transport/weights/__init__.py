"""Weight sync, trainer -> rollout replica: versioned, integrity-checked, all-or-nothing.

The package, by role (arrows point down this list; nothing imports upwards):

- :mod:`~rlhf.transport.weights.send`: the trainer's push to one or many replicas (control over gRPC, bytes over
  the data plane, the ``UpdateWeights`` stream or a collective broadcast), of packed or streamed weights;
- :mod:`~rlhf.transport.weights.dataplane`: the replica's TCP data-plane listener and tickets, and the sender's
  socket (:func:`~rlhf.transport.weights.dataplane.send_buckets`);
- :mod:`~rlhf.transport.weights.collective`: the per-push broadcast group (gloo, nccl, hccl), both ends;
- :mod:`~rlhf.transport.weights.receive`: receiving an update: staging, the update slot, buckets fed to an engine;
- :mod:`~rlhf.transport.weights.delta`: delta pushes: only the words that changed since the replica's base update,
  rebuilt there and checked against the full update's digests;
- :mod:`~rlhf.transport.weights.verify`: the checks every path runs: a header, a received bucket;
- :mod:`~rlhf.transport.weights.pack`: packing an update into buckets (held, or streamed from a tensor source);
- :mod:`~rlhf.transport.weights.format`: the wire format: safetensors buckets and their layout, the header's
  digests, the protobuf chunk codec;
- :mod:`~rlhf.transport.weights.checksum`: the device digest of a collective nccl/hccl push;
- :mod:`~rlhf.transport.weights.version`: the served version's one owner and the one "newer" rule;
- :mod:`~rlhf.transport.weights.errors`: the refusals (mapped to gRPC/HTTP by ``rlhf.serving.errors``' table).

``import rlhf.transport.weights`` imports neither torch nor gRPC; a name is loaded from its module on first use
(the rollout service sets ``OMP_NUM_THREADS`` before torch loads). docs/weight-sync.md describes the protocol.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "errors": (
        "CorruptUpdate",
        "DeltaBaseMissing",
        "IncompatibleUpdate",
        "IncompleteUpdate",
        "StaleVersion",
        "UpdateInProgress",
        "UpdateTooLarge",
        "WeightSyncError",
    ),
    "version": ("ServedVersion", "check_newer"),
    "format": (
        "DEFAULT_BUCKET_BYTES",
        "DEFAULT_CHUNK_BYTES",
        "FORMAT",
        "RawChunk",
        "all_finite",
        "decode_update",
        "dtype_name",
        "encode_chunk",
        "load_safetensors",
        "manifest_checksum",
        "manifest_of",
    ),
    "pack": (
        "BufferPool",
        "PackedWeights",
        "StreamedWeights",
        "copy_weights",
        "pack_weights",
        "weight_updates",
    ),
    "verify": ("check_header",),
    "delta": ("DeltaBase", "make_delta"),
    "receive": ("StagedWeights", "WeightReceiver", "receive_update"),
    "dataplane": ("WeightDataServer", "send_buckets"),
    "send": ("TRANSPORTS", "push_weights", "push_weights_many", "push_weights_streamed"),
}
_WHERE = {name: module for module, names in _NAMES.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'rlhf.transport.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlhf.transport.weights.{module}"), name)


__all__ = sorted(_WHERE)
