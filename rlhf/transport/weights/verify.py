"""The checks every weight path runs on a replica, whatever carried the bytes: a header against the served version,
the served model's tensors and the replica's limits (before a byte of data is read or a buffer allocated), and a
received bucket against its digest (sha256, or a collective nccl/hccl push's device digest), its manifest and
finite values. Each failure is a :class:`~rlhf.transport.weights.errors.WeightSyncError` naming what is wrong."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlhf.transport.weights.checksum import PREFIX as DIGEST_NAME
from rlhf.transport.weights.checksum import device_digest, is_device_digest
from rlhf.transport.weights.errors import CorruptUpdate, IncompatibleUpdate, UpdateTooLarge
from rlhf.transport.weights.format import (
    FORMAT,
    TORCH_DTYPES,
    Manifest,
    all_finite,
    bucket_digest,
    load_safetensors,
    load_safetensors_tensor,
    manifest_checksum,
    safetensors_header,
)
from rlhf.transport.weights.version import check_newer
from rlhf.v1 import weights_pb2


def check_header(
    h: weights_pb2.WeightHeader,
    current_version: int,
    max_total_bytes: int | None,
    max_bucket_bytes: int | None,
    expected: Mapping[str, tuple[str, Sequence[int]]] | None,
    device_digests: bool = False,
) -> list[Manifest]:
    """Validate a header; returns per bucket the manifest of its tensors. ``device_digests``: buckets may carry a
    device digest instead of their sha256 (a collective push's, checked where they land)."""
    if h.format != FORMAT:
        raise CorruptUpdate(f"header.format is {h.format!r}; only {FORMAT!r} is supported")
    check_newer(h.version, h.parent_version, current_version)  # the one rule (StaleVersion, CorruptUpdate)
    if not h.buckets:
        raise CorruptUpdate("header lists no buckets")
    for i, b in enumerate(h.buckets):
        if b.index != i:
            raise CorruptUpdate(f"header.buckets[{i}].index is {b.index}: buckets must be listed in index order")
        if b.nbytes < 8:
            raise CorruptUpdate(f"header.buckets[{i}].nbytes is {b.nbytes}: too small for a safetensors buffer")
        if b.device_digest:
            if not device_digests or b.sha256:
                raise CorruptUpdate(
                    f"header.buckets[{i}] carries a device digest, which only a collective push's buckets may carry "
                    "instead of their sha256",
                    field=f"header.buckets[{i}].device_digest",
                )
            if not is_device_digest(b.device_digest):
                raise CorruptUpdate(f"header.buckets[{i}].device_digest is not a {DIGEST_NAME} digest")
        elif not _is_sha256(b.sha256):
            raise CorruptUpdate(f"header.buckets[{i}].sha256 is not a lowercase sha256 hex digest")
        _check_delta_entry(h, i, b, device_digests)
        if max_bucket_bytes is not None and _full_nbytes(b) > max_bucket_bytes:
            raise UpdateTooLarge(
                f"bucket {i} has {_full_nbytes(b)} bytes; this replica accepts at most {max_bucket_bytes}"
            )
    total = sum(b.nbytes for b in h.buckets)
    if h.total_bytes != total:
        raise CorruptUpdate(f"header.total_bytes is {h.total_bytes} but the buckets add up to {total}")
    full_total = sum(_full_nbytes(b) for b in h.buckets)  # what the replica holds once a delta is rebuilt
    if max_total_bytes is not None and full_total > max_total_bytes:
        raise UpdateTooLarge(f"update has {full_total} bytes; this replica accepts at most {max_total_bytes}")
    if h.checksum != manifest_checksum([bucket_digest(b) for b in h.buckets]):
        raise CorruptUpdate("header.checksum does not match the bucket digests")
    per_bucket: list[Manifest] = [{} for _ in h.buckets]
    for t in h.tensors:
        if not t.name:
            raise CorruptUpdate("header lists a tensor without a name")
        if not 0 <= t.bucket < len(h.buckets):
            raise CorruptUpdate(f"tensor {t.name!r} is in bucket {t.bucket}, but there are {len(h.buckets)} buckets")
        if any(t.name in m for m in per_bucket):
            raise CorruptUpdate(f"tensor {t.name!r} is listed twice")
        if any(d < 0 for d in t.shape):
            raise CorruptUpdate(f"tensor {t.name!r} has a negative dimension")
        if t.dtype not in TORCH_DTYPES:
            raise CorruptUpdate(f"tensor {t.name!r} has an unknown dtype {t.dtype!r}")
        per_bucket[t.bucket][t.name] = (t.dtype, tuple(t.shape))
    for i, m in enumerate(per_bucket):
        if not m:
            raise CorruptUpdate(f"bucket {i} holds no tensor")
    if expected is not None:
        got = {k: v for m in per_bucket for k, v in m.items()}
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        if missing or extra:
            raise IncompatibleUpdate(
                f"update does not fit the served model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unknown {extra[:5]}{'...' if len(extra) > 5 else ''}"
            )
        for name, (dt, shape) in got.items():
            edt, eshape = expected[name]
            if (edt is not None and dt != edt) or tuple(shape) != tuple(eshape):
                raise IncompatibleUpdate(
                    f"tensor {name!r} is {dt}{list(shape)} in the update but {edt or ''}{list(eshape)} in the "
                    "served model"
                )
    # Every bucket's size follows from its tensors' dtypes and shapes (plus its JSON header): an announced size
    # is checked before a buffer is allocated for it, so a header cannot make the replica allocate more than the
    # tensors it lists (and, with ``expected``, than the served model's tensors) need.
    for i, (b, m) in enumerate(zip(h.buckets, per_bucket, strict=True)):
        data = sum(TORCH_DTYPES[dt].itemsize * math.prod(shape) for dt, shape in m.values())
        slack = bucket_header_allowance(m)
        if not 8 + data <= _full_nbytes(b) <= 8 + data + slack:
            raise CorruptUpdate(
                f"header.buckets[{i}].nbytes is {_full_nbytes(b)}, but its tensors need {data} bytes of data plus a "
                f"safetensors header of at most {slack} bytes",
                field=f"header.buckets[{i}].nbytes",
            )
    return per_bucket


def _is_sha256(x: str) -> bool:
    return len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _full_nbytes(b: weights_pb2.BucketEntry) -> int:
    """The bucket's size once received: a delta bucket's rebuilt size, else the bytes on the wire."""
    return b.full_nbytes if b.encoding else b.nbytes


def _check_delta_entry(h: weights_pb2.WeightHeader, i: int, b: weights_pb2.BucketEntry, device_digests: bool) -> None:
    """A delta bucket's fields (rlhf.transport.weights.delta): on the wire at most the rebuilt bucket's size, and
    the rebuilt bucket's sha256, which the header checksum covers; a bucket sent whole carries none of them."""
    if not b.encoding:
        if b.full_sha256 or b.full_nbytes:
            raise CorruptUpdate(f"header.buckets[{i}] carries a full_sha256/full_nbytes but no delta encoding")
        return
    if device_digests or not h.delta_base_checksum:  # a collective push's buckets go whole
        raise CorruptUpdate(f"header.buckets[{i}] is a delta without a base, or on a collective push")
    if b.encoding not in ("sparse16", "runs16"):  # rlhf.transport.weights.delta.ENCODINGS (it imports this module)
        raise CorruptUpdate(f"header.buckets[{i}].encoding {b.encoding!r} is unknown")
    if not _is_sha256(b.full_sha256):
        raise CorruptUpdate(f"header.buckets[{i}].full_sha256 is not a lowercase sha256 hex digest")
    if not 8 <= b.nbytes <= b.full_nbytes:  # the sender sends a delta only when it is smaller than the bucket
        raise CorruptUpdate(f"header.buckets[{i}]: a delta of {b.nbytes} bytes for a bucket of {b.full_nbytes}")


def bucket_header_allowance(manifest: Manifest) -> int:
    """The largest safetensors JSON header a bucket of these tensors can have: per tensor its name (JSON-escaped,
    up to 6 characters per character), dtype, shape and offsets; plus room for ``__metadata__`` and padding."""
    per_tensor = sum(6 * len(name) + 80 + 21 * (len(shape) + 2) for name, (_, shape) in manifest.items())
    return 64 * 1024 + per_tensor


def finish_bucket(index: int, data: bytearray, digest: str, sha256: str, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Check a received bucket's digest and content against the manifest; its tensors are views into ``data``."""
    if digest != sha256:
        raise CorruptUpdate(f"bucket {index}: sha256 {digest} does not match the header's {sha256}")
    _check_content(index, safetensors_header(data), manifest)
    try:
        tensors = load_safetensors(data)
    except CorruptUpdate as err:  # passed the digest but does not parse: the sender's packing is broken
        raise CorruptUpdate(f"bucket {index} is not a valid safetensors buffer: {err}") from None
    return _finite(tensors)


def finish_device_bucket(index: int, buf: torch.Tensor, expected: str, manifest: Manifest) -> dict[str, torch.Tensor]:
    """:func:`finish_bucket` of a bucket held in a uint8 tensor on the device it arrived on, checked against its
    device digest there: the tensors are views of ``buf`` (nothing but the JSON header comes to the host)."""
    digest = device_digest(buf)
    if digest != expected:
        raise CorruptUpdate(f"bucket {index}: device digest {digest} does not match the header's {expected}")
    try:
        meta, tensors = load_safetensors_tensor(buf)
    except CorruptUpdate as err:
        raise CorruptUpdate(f"bucket {index} is not a valid safetensors buffer: {err}") from None
    meta.pop("__metadata__", None)
    _check_content(index, meta, manifest)
    return _finite(tensors)


def _check_content(index: int, meta: dict[str, Any], manifest: Manifest) -> None:
    for name, (dt, shape) in manifest.items():
        entry = meta.get(name)
        if entry is None:
            raise CorruptUpdate(f"bucket {index} does not contain tensor {name!r} listed in the manifest")
        if entry.get("dtype") != dt or tuple(entry.get("shape", ())) != shape:
            raise CorruptUpdate(
                f"tensor {name!r}: bucket {index} holds {entry.get('dtype')}{entry.get('shape')}, "
                f"the manifest says {dt}{list(shape)}"
            )
    if len(meta) != len(manifest):
        extra = sorted(set(meta) - set(manifest))
        raise CorruptUpdate(f"bucket {index} holds tensors not in the manifest: {extra[:5]}")


def _finite(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    bad = next((name for name, t in tensors.items() if not all_finite(t)), None)
    if bad is not None:  # the digest only proves the bytes are the sender's; NaN weights are refused, old ones kept
        raise CorruptUpdate(f"tensor {bad!r} has NaN or infinite values; the update is refused", field="tensors")
    return tensors
