"""Weight-sync wire format: safetensors buckets behind a header, and the protobuf messages that carry them.

A ``WeightHeader`` (version, parent version, manifest, buckets with their digests, checksum) and then the buckets,
as ``WeightChunk``s on ``RolloutService.UpdateWeights`` (proto/rlhf/v1/weights.proto) or raw over the data plane.
A bucket's layout is computed from its tensors' dtypes and shapes (:func:`bucket_layout`), so a packed and a
streamed push of the same weights are the same bytes. Nothing is pickled: a received bucket's JSON header is
checked and its tensors are ``torch.frombuffer`` views (:func:`load_safetensors`).

Design (every field and rule): docs/weight-sync.md#the-update.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.transport.weights.errors import CorruptUpdate
from rlhf.v1 import weights_pb2

FORMAT = "safetensors"
MiB = 1 << 20
# The chunk size that streams best on loopback (bench.weight_sync: docs/weight-sync.md, the transports table); 2 MiB
# plus the ~20-byte message prefix also fits gRPC's default 4 MiB receive limit.
DEFAULT_CHUNK_BYTES = 2 * MiB
DEFAULT_BUCKET_BYTES = 128 * MiB


_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}

Manifest = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors name known to rlhf.transport") from None


def manifest_of(state_dict: Mapping[str, torch.Tensor]) -> Manifest:
    """name -> (dtype, shape) of a state dict: what a replica passes as ``expected`` to refuse foreign updates."""
    return {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in state_dict.items()}


def manifest_checksum(bucket_digests: Sequence[str]) -> str:
    """The header checksum: sha256 hex over the bucket digests (ASCII), concatenated in index order."""
    return hashlib.sha256("".join(bucket_digests).encode("ascii")).hexdigest()


def bucket_digest(b: weights_pb2.BucketEntry) -> str:
    """A bucket's digest as the header checksum covers it: its sha256, or its device digest where it has one; a
    delta bucket's resulting bucket's sha256 (so a delta push has the checksum of the same full push)."""
    return b.full_sha256 or b.sha256 or b.device_digest


def safetensors_header(data: bytes | memoryview) -> dict[str, Any]:
    """The JSON header of a serialized safetensors buffer (8-byte little-endian length, then JSON)."""
    if len(data) < 8:
        raise CorruptUpdate(f"bucket of {len(data)} bytes is too short to be safetensors")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise CorruptUpdate(f"safetensors header length {n} exceeds the bucket size {len(data)}")
    try:
        meta = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as err:
        raise CorruptUpdate(f"safetensors header is not JSON: {err}") from None
    if not isinstance(meta, dict):
        raise CorruptUpdate("safetensors header is not a JSON object")
    meta.pop("__metadata__", None)
    return meta


TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_NAMES.items()}


def load_safetensors(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a serialized safetensors buffer, as views into it (``torch.frombuffer``: no copy; a tensor
    keeps the buffer alive). Validates what ``safetensors.torch.load`` validates: known dtypes, sizes that match
    the shapes, offsets that tile the data area exactly (in bounds, no overlap, no gap). Raises CorruptUpdate.
    The tensors share the buffer's memory: writable when it is (bytearray), read-only bytes otherwise."""
    meta = safetensors_header(data)
    view = memoryview(data).cast("B")
    hlen = int.from_bytes(view[:8], "little")
    start = 8 + hlen
    readonly = view.readonly
    out: dict[str, torch.Tensor] = {}
    for name, begin, dtype, shape, numel in _tensor_spans(meta, len(view) - start):
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # read-only bytes: torch warns that writes would be undefined; we never write
            if readonly:
                warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(view, dtype=dtype, count=numel, offset=start + begin)
        if t.data_ptr() % t.element_size():  # misaligned (a sender's odd header): kernels expect aligned data
            t = t.clone()
        out[name] = t.view(shape)
    return out


def load_safetensors_tensor(buf: torch.Tensor) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """:func:`load_safetensors` of a bucket held in a uint8 tensor (a collective push's bucket, on the device it
    arrived on): (the JSON header, the tensors as views of ``buf``, on its device). Only the 8-byte length and the
    JSON header are copied to the host; the same checks; raises CorruptUpdate."""
    size = buf.numel()
    if size < 8:
        raise CorruptUpdate(f"bucket of {size} bytes is too short to be safetensors")
    hlen = int.from_bytes(bytes(buf[:8].cpu().tolist()), "little")
    if hlen > size - 8:
        raise CorruptUpdate(f"safetensors header length {hlen} exceeds the bucket size {size}")
    meta = safetensors_header(bytes(buf[: 8 + hlen].cpu().numpy()))
    start = 8 + hlen
    out: dict[str, torch.Tensor] = {}
    for name, begin, dtype, shape, numel in _tensor_spans(meta, size - start):
        raw = buf[start + begin : start + begin + numel * dtype.itemsize]
        if (start + begin) % dtype.itemsize:  # misaligned (a sender's odd header): a device copy, not a view
            raw = raw.clone()
        out[name] = raw.view(dtype).view(shape)
    return meta, out


def _tensor_spans(meta: dict[str, Any], size: int) -> list[tuple[str, int, torch.dtype, tuple[int, ...], int]]:
    """(name, offset in the data area, dtype, shape, numel) per tensor of a safetensors header, in header order,
    after checking what ``safetensors.torch.load`` checks against a data area of ``size`` bytes."""
    spans: list[tuple[int, int, str]] = []
    specs: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
    for name, entry in meta.items():
        if not isinstance(entry, dict):
            raise CorruptUpdate(f"safetensors entry {name!r} is not an object")
        dtype = TORCH_DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
        shape, offs = entry.get("shape"), entry.get("data_offsets")
        if dtype is None:
            raise CorruptUpdate(f"tensor {name!r} has an unknown dtype {entry.get('dtype')!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptUpdate(f"tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            raise CorruptUpdate(f"tensor {name!r} has invalid data_offsets {offs!r}")
        begin, end = offs
        numel = math.prod(shape)
        if not 0 <= begin <= end <= size or end - begin != numel * dtype.itemsize:
            raise CorruptUpdate(f"tensor {name!r}: data_offsets {offs} do not fit {entry['dtype']}{shape} in the data")
        spans.append((begin, end, name))
        specs[name] = (dtype, tuple(shape), numel)
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise CorruptUpdate(f"tensor {name!r} starts at {begin}, expected {at}: tensor data overlap or leave a gap")
        at = end
    if at != size:
        raise CorruptUpdate(f"the tensors cover {at} of the {size} data bytes")
    return [(name, begin, *specs[name]) for begin, _end, name in spans]  # header order, like safetensors


_FINITE_CHUNK = 1 << 20  # elements: torch's sum(dtype=float32) of a bf16/fp16 tensor makes a float32 copy of it first


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``. A float32 sum is finite exactly when every term is, unless finite terms overflow it
    (only then is the exact, slower per-element check needed); one pass, no tensor-sized mask. A large tensor of
    another dtype is summed in chunks: its float32 copy would cost a replica installing an update as it arrives
    (and a sender) the size of the largest tensor twice over."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    if t.dtype == torch.float32 or t.numel() <= _FINITE_CHUNK or not t.is_contiguous():
        parts = [t]
    else:
        flat = t.view(-1)
        parts = [flat[i : i + _FINITE_CHUNK] for i in range(0, flat.numel(), _FINITE_CHUNK)]
    if math.isfinite(sum(float(p.sum(dtype=torch.float32)) for p in parts)):
        return True
    return all(bool(torch.isfinite(p).all()) for p in parts)


# ------------------------------------------------------------------------------------------------------ layout

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape: what a tensor will be, before it exists


@dataclass(frozen=True)
class BucketLayout:
    """One bucket's safetensors layout, computed from the specs alone: the serialised header and where each tensor's
    bytes go (offsets into the whole bucket, header included)."""

    prefix: bytes  # the 8-byte length and the JSON header, padded with spaces to a multiple of 8 (as safetensors)
    spans: dict[str, tuple[int, int]]
    nbytes: int


def bucket_layout(specs: Sequence[TensorSpec]) -> BucketLayout:
    # Widest dtypes first (stable): with the header padded to 8 bytes, every tensor starts aligned to its itemsize,
    # so load_safetensors' frombuffer views need no copy.
    order = sorted(specs, key=lambda s: -s[1].itemsize)
    meta: dict[str, Any] = {}
    at = 0
    for name, dtype, shape in order:
        n = math.prod(shape) * dtype.itemsize
        meta[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    base = 8 + len(text)
    spans = {name: (base + e["data_offsets"][0], base + e["data_offsets"][1]) for name, e in meta.items()}
    return BucketLayout(len(text).to_bytes(8, "little") + text, spans, base + at)


# ------------------------------------------------------------------------------------------------------ chunks


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_chunk(bucket: int, offset: int, data: bytes | memoryview) -> bytes:
    """``WeightUpdate(chunk=WeightChunk(bucket, offset, data)).SerializeToString()`` with one copy of ``data``
    (protobuf wire format: WeightUpdate.chunk = field 2; WeightChunk bucket = 1, offset = 2, data = 3)."""
    if bucket < 0 or offset < 0:
        raise ValueError("bucket and offset must be >= 0")
    n = len(data)
    inner = b"".join(
        (
            b"\x08" + _varint(bucket) if bucket else b"",  # proto3 leaves zero scalars out
            b"\x10" + _varint(offset) if offset else b"",
            b"\x1a" + _varint(n) if n else b"",
        )
    )
    return b"".join((b"\x12", _varint(len(inner) + n), inner, data))


# ------------------------------------------------------------------------------------------------------ decoding


@dataclass(slots=True)
class RawChunk:
    """A ``WeightChunk`` decoded by :func:`decode_update` without protobuf: ``data`` is a view into the message."""

    bucket: int
    offset: int
    data: memoryview


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    raise ValueError("bad varint")


def decode_update(raw: bytes) -> weights_pb2.WeightUpdate | RawChunk:
    """The server's request deserializer for ``UpdateWeights``: a chunk in the layout :func:`encode_chunk` writes
    becomes a :class:`RawChunk` whose data is a view into ``raw`` (protobuf would copy it twice: into its message,
    then into a new bytes object on ``.data``); anything else (the header, other valid encodings) goes through
    ``WeightUpdate.FromString``. :func:`receive_update` takes both."""
    view = memoryview(raw)
    end = len(view)
    try:
        if end and view[0] == 0x12:
            n, pos = _read_varint(view, 1, end)
            if pos + n == end:
                bucket = offset = size = 0
                if pos < end and view[pos] == 0x08:
                    bucket, pos = _read_varint(view, pos + 1, end)
                if pos < end and view[pos] == 0x10:
                    offset, pos = _read_varint(view, pos + 1, end)
                if pos < end and view[pos] == 0x1A:
                    size, pos = _read_varint(view, pos + 1, end)
                if pos + size == end and bucket < 2**31:
                    return RawChunk(bucket, offset, view[pos:end])
    except (ValueError, IndexError):
        pass
    return weights_pb2.WeightUpdate.FromString(raw)
