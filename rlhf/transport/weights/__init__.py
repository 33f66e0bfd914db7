"""Weight sync, trainer -> rollout replica: versioned, integrity-checked, all-or-nothing.

The package, by role (imports only point down): ``send``, ``dataplane``, ``collective``, ``receive``, ``delta``,
``verify``, ``pack``, ``format``, ``checksum``, ``version``, ``errors``. ``import rlhf.transport.weights`` imports
neither torch nor gRPC; a name is loaded from its module on first use (the rollout service sets
``OMP_NUM_THREADS`` before torch loads).

Design (each module's role, the protocol): docs/weight-sync.md#the-package.
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
