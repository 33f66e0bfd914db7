"""Weight-sync wire format: safetensors buckets behind a header, and the protobuf messages that carry them.

Wire format (``RolloutService.UpdateWeights``, a client stream of ``WeightUpdate``; proto/rlhf/v1/weights.proto):

1. one ``WeightHeader``: ``version`` (newer than the served one), ``parent_version`` (the version the trainer started
   this update from; smaller than ``version``), the manifest (per tensor: name, safetensors dtype, shape, bucket),
   the buckets (index 0..n-1, nbytes, sha256 hex), ``checksum`` = sha256 hex of the bucket digests (hex, ASCII)
   concatenated in index order, ``total_bytes`` = sum of nbytes, ``format = "safetensors"``;
2. then ``WeightChunk``s: bucket by bucket in index order, each bucket's bytes in order and without gaps
   (``offset`` = bytes of that bucket sent before), every chunk non-empty. A bucket is a safetensors file of a group
   of whole tensors (at most ``bucket_bytes``, or one tensor alone when it is larger), widest dtypes first so every
   tensor is aligned; its layout is computed from the tensors' dtypes and shapes (:func:`_layout`), so packing
   copies each tensor once and a packed and a streamed push of the same weights are the same bytes.

The same header and buckets travel over the TCP data plane (:mod:`rlhf.transport.weights.dataplane`) and are what a
collective transfer announces (:mod:`rlhf.transport.weights.collective`). Nothing is pickled: a received bucket's
JSON header is checked and its tensors are ``torch.frombuffer`` views into the received bytes
(:func:`load_safetensors`).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.transport.weights.errors import CorruptUpdate
from rlhf.v1 import weights_pb2

FORMAT = "safetensors"
MiB = 1 << 20
# Measured on loopback (bench.weight_sync, with pre-serialised messages): 0.5-4 MiB chunks stream alike, 16-32 MiB
# ones slower. 2 MiB plus the ~20-byte message prefix also fits gRPC's default 4 MiB receive limit.
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
    """A bucket's digest as the header checksum covers it: its sha256, or its device digest where it has one."""
    return b.sha256 or b.device_digest


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


# ------------------------------------------------------------------------------------------------------ packing


_LIBC: Any = None


def release_freed_memory() -> None:
    """Hand memory the process has freed back to the system (glibc's ``malloc_trim``; elsewhere nothing). glibc
    keeps freed blocks below its mmap threshold (which grows to 32 MiB once such a block is freed) in its arenas:
    loading a model layer by layer, as an update installed bucket by bucket does, otherwise leaves hundreds of MB
    freed but resident."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


class BufferPool:
    """Bucket buffers kept from one update to the next. Fresh memory costs a page fault per 4 KiB on first touch
    (about 1 GB/s here, as slow as the transfer itself); a replica that receives an update every training step
    reuses the buffers of an update whose tensors are gone (a double-buffering engine: the update before last).

    A buffer is free when nothing but the pool refers to it: the staged tensors hold it through the memoryview
    ``torch.frombuffer`` was given, so a buffer some served tensor still uses is never handed out."""

    def __init__(self) -> None:
        self._bufs: list[bytearray] = []

    def take(self, nbytes: int) -> bytearray:
        bufs = self._bufs
        for i in range(len(bufs)):
            # references: the list and getrefcount's argument; any tensor or memoryview adds one
            if len(bufs[i]) == nbytes and sys.getrefcount(bufs[i]) == 2:
                bufs.append(bufs.pop(i))  # most recently used last
                return bufs[-1]
        bufs.append(bytearray(nbytes))
        return bufs[-1]

    def free(self, nbytes: int) -> int:
        """How many buffers of ``nbytes`` nothing else refers to."""
        return sum(1 for b in self._bufs if len(b) == nbytes and sys.getrefcount(b) == 3)  # list, b, argument

    @property
    def count(self) -> int:
        """The buffers held (free or not)."""
        return len(self._bufs)

    def trim(self, keep_bytes: int) -> None:
        """Forget the least recently used free buffers beyond ``keep_bytes`` held in all."""
        bufs = self._bufs
        total = sum(len(b) for b in bufs)
        i = 0
        while total > keep_bytes and i < len(bufs):
            if sys.getrefcount(bufs[i]) == 2:  # the list and the argument
                total -= len(bufs.pop(i))
            else:
                i += 1

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self._bufs)


class _HeaderFields:
    """What a push reads off an update's header (``self.header``), packed or streamed alike."""

    header: weights_pb2.WeightHeader

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def checksum(self) -> str:
        return self.header.checksum

    @property
    def total_bytes(self) -> int:
        return self.header.total_bytes


@dataclass
class PackedWeights(_HeaderFields):
    """A state dict serialised once: the header and the safetensors buckets, ready to stream to many replicas.

    Holds one serialised copy of the weights (about the state dict's size) in host memory, or, packed for a
    collective push over nccl/hccl (``copy_weights(device=...)``), in device memory as uint8 tensors: those go by
    broadcast only, carry device digests (:mod:`~rlhf.transport.weights.checksum`) instead of sha256 and never
    pass through the host."""

    header: weights_pb2.WeightHeader
    buckets: list[bytes] | list[bytearray] | list[torch.Tensor]

    @property
    def on_device(self) -> bool:
        return bool(self.buckets) and isinstance(self.buckets[0], torch.Tensor)

    def seal(self) -> PackedWeights:
        """Hash every bucket into the header (digests, checksum, total bytes): what :func:`copy_weights` leaves
        for later (a thread), so the copy alone stands between two training steps. Returns ``self``."""
        from rlhf.transport.weights.checksum import device_digest

        del self.header.buckets[:]
        for index, data in enumerate(self.buckets):
            if isinstance(data, torch.Tensor):
                self.header.buckets.add(index=index, nbytes=data.numel(), device_digest=device_digest(data))
            else:
                self.header.buckets.add(index=index, nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        self.header.checksum = manifest_checksum([bucket_digest(b) for b in self.header.buckets])
        self.header.total_bytes = sum(b.nbytes for b in self.header.buckets)
        return self

    def updates(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[weights_pb2.WeightUpdate]:
        """The ``UpdateWeights`` request stream: the header, then every bucket in chunks of ``chunk_bytes``."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        if self.on_device:
            raise ValueError("buckets packed on a device go by collective broadcast only (RLHF_WEIGHTS_TRANSPORT)")
        yield weights_pb2.WeightUpdate(header=self.header)
        for index, data in enumerate(self.buckets):
            view = memoryview(data)
            for off in range(0, len(data), chunk_bytes):
                chunk = weights_pb2.WeightChunk(bucket=index, offset=off, data=bytes(view[off : off + chunk_bytes]))
                yield weights_pb2.WeightUpdate(chunk=chunk)

    def encoded_updates(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        """:meth:`updates` already serialised (the same bytes ``SerializeToString`` gives): each chunk message is
        its ~30-byte prefix joined to a slice of the bucket, one copy, instead of a slice copy, a protobuf message
        and its serialisation (what :func:`push_weights` streams)."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        if self.on_device:
            raise ValueError("buckets packed on a device go by collective broadcast only (RLHF_WEIGHTS_TRANSPORT)")
        yield weights_pb2.WeightUpdate(header=self.header).SerializeToString()
        for index, data in enumerate(self.buckets):
            view = memoryview(data)
            for off in range(0, len(data), chunk_bytes):
                yield encode_chunk(index, off, view[off : off + chunk_bytes])


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


def _plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise ValueError(f"state_dict[{name!r}] is not a dense tensor ({t.layout}); call .to_dense() first")
    return plan_sizes(((name, t.numel() * t.element_size()) for name, t in state_dict.items()), bucket_bytes)


def plan_sizes(sizes: Iterable[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Whole tensors in order into buckets of at most ``bucket_bytes`` (a larger tensor alone in its own)."""
    plan: list[list[str]] = []
    size = 0
    for name, n in sizes:
        if plan and plan[-1] and size + n <= bucket_bytes:
            plan[-1].append(name)
            size += n
        else:
            plan.append([name])
            size = n
    return plan


def _parent_of(version: int, parent_version: int | None, bucket_bytes: int) -> int:
    """An update's parent version (default ``version - 1``), after checking it and the bucket size."""
    if parent_version is None:
        parent_version = version - 1
    if parent_version >= version:
        raise ValueError(f"parent_version ({parent_version}) must be smaller than version ({version})")
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    return parent_version


def pack_weights(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    parent_version: int | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> PackedWeights:
    """Serialise ``state_dict`` (any device; copied to host bucket by bucket) into safetensors buckets and the
    header. ``parent_version`` defaults to ``version - 1``. Tensors sharing memory (tied weights) are each sent
    in full. Do not modify the tensors while this runs (take it between optimizer steps)."""
    return copy_weights(state_dict, version, parent_version, bucket_bytes=bucket_bytes).seal()


def copy_weights(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    parent_version: int | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    pool: BufferPool | None = None,
    device: torch.device | None = None,
) -> PackedWeights:
    """:func:`pack_weights` less the hashing: refuses non-finite values, then copies each tensor once into its
    bucket (buffers from ``pool`` when given, reused from an earlier update nothing refers to any more). The
    header has the manifest but no digests until :meth:`PackedWeights.seal`. A trainer takes this as its snapshot
    of the weights between two steps (one copy, no allocation once the pool holds buffers) and seals it while
    the next step trains.

    ``device``: the buckets are uint8 tensors there (a collective push over nccl/hccl broadcasts them as they are:
    the weights never pass through host memory); the snapshot then costs the policy's size in device memory
    instead of host memory, until the push is done."""
    parent_version = _parent_of(version, parent_version, bucket_bytes)
    if not state_dict:
        raise ValueError("state_dict is empty")
    bad = next((name for name, t in state_dict.items() if not all_finite(t)), None)
    if bad is not None:  # a diverged update must never reach a replica (it would serve garbage, and stay ready)
        raise ValueError(f"refusing to pack weights: tensor {bad!r} has NaN or infinite values")
    header = weights_pb2.WeightHeader(version=version, parent_version=parent_version, format=FORMAT)
    buckets: list[bytearray] = []
    for index, names in enumerate(_plan_buckets(state_dict, bucket_bytes)):
        # the layout computed from dtypes and shapes, each tensor copied once to its offset (no intermediate file
        # image as safetensors.torch.save makes; tied tensors are each written in full)
        lay = _layout([(name, state_dict[name].dtype, tuple(state_dict[name].shape)) for name in names])
        for name in names:
            t = state_dict[name]
            header.tensors.add(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape), bucket=index)
        if device is not None:
            dev = torch.empty(lay.nbytes, dtype=torch.uint8, device=device)
            dev[: len(lay.prefix)].copy_(torch.frombuffer(bytearray(lay.prefix), dtype=torch.uint8))
            for name in names:
                begin, end = lay.spans[name]
                _copy_bytes(dev[begin:end], state_dict[name])
            buckets.append(dev)
            continue
        data = pool.take(lay.nbytes) if pool is not None else bytearray(lay.nbytes)
        view = memoryview(data)
        view[: len(lay.prefix)] = lay.prefix
        for name in names:
            _copy_into(view, state_dict[name], *lay.spans[name])
        del view  # a view held here would keep a pooled buffer from ever looking free again
        buckets.append(data)
    return PackedWeights(header, buckets)


def weight_updates(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    parent_version: int | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[weights_pb2.WeightUpdate]:
    """The ``WeightUpdate`` stream of a state dict (header, then chunks)."""
    return pack_weights(state_dict, version, parent_version, bucket_bytes=bucket_bytes).updates(chunk_bytes)


# ------------------------------------------------------------------------------------------------------ streaming

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape: what a tensor will be, before it exists


@dataclass(frozen=True)
class _BucketLayout:
    """One bucket's safetensors layout, computed from the specs alone: the serialised header and where each tensor's
    bytes go (offsets into the whole bucket, header included)."""

    prefix: bytes  # the 8-byte length and the JSON header, padded with spaces to a multiple of 8 (as safetensors)
    spans: dict[str, tuple[int, int]]
    nbytes: int


def _layout(specs: Sequence[TensorSpec]) -> _BucketLayout:
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
    return _BucketLayout(len(text).to_bytes(8, "little") + text, spans, base + at)


class StreamedWeights(_HeaderFields):
    """Weights serialised bucket by bucket from a source that yields them one tensor at a time (a sharded trainer
    gathering each parameter), never the whole state dict at once: what a trainer group pushes.

    The bucket plan and the manifest come from ``specs`` (name, dtype, shape) alone. The header needs every bucket's
    sha256 before the first byte is sent, so the source is read twice, and must yield the same tensors both times
    (the caller keeps the weights unchanged in between): :meth:`seal` serialises and hashes each bucket and drops
    it, filling the header; :meth:`buckets` serialises them again for sending. Each tensor is copied straight to its
    offset in one preallocated buffer of the largest bucket's size and dropped, so a pass holds one bucket and one
    tensor. The layout is computed, not taken from ``safetensors.torch.save``, so both passes give the same bytes.

    ``source()`` starts one pass: an iterator of ``(name, tensor)`` in ``specs`` order, each tensor of its spec's
    dtype and shape (any device). It is closed when a pass stops early: a source that must run to the end (a
    collective gather) drains itself then."""

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        source: Callable[[], Iterator[tuple[str, torch.Tensor]]],
        version: int,
        parent_version: int | None = None,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        parent_version = _parent_of(version, parent_version, bucket_bytes)
        if not specs:
            raise ValueError("no tensors to stream")
        by_name = {name: (dtype, tuple(shape)) for name, dtype, shape in specs}
        if len(by_name) != len(specs):
            raise ValueError("a tensor name is listed twice")
        self._by_name = by_name
        self._source = source
        plan = plan_sizes(((n, math.prod(sh) * dt.itemsize) for n, (dt, sh) in by_name.items()), bucket_bytes)
        self._plan = plan
        self._layouts = [_layout([(n, *by_name[n]) for n in names]) for names in plan]
        self.header = weights_pb2.WeightHeader(version=version, parent_version=parent_version, format=FORMAT)
        for index, names in enumerate(plan):
            for n in names:
                dtype, shape = by_name[n]
                self.header.tensors.add(name=n, dtype=dtype_name(dtype), shape=shape, bucket=index)
        self.header.total_bytes = sum(lay.nbytes for lay in self._layouts)
        self.buffer_bytes = max(lay.nbytes for lay in self._layouts)  # what a pass holds besides one tensor
        self.sealed = False

    def seal(self) -> weights_pb2.WeightHeader:
        """Pass 1 (blocking): serialise and hash every bucket, refusing non-finite values, and complete the header
        (bucket sizes and digests, checksum). Returns the header."""
        del self.header.buckets[:]
        for index, data in enumerate(self._pass(check_finite=True)):
            self.header.buckets.add(index=index, nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        self.header.checksum = manifest_checksum([b.sha256 for b in self.header.buckets])
        self.sealed = True
        return self.header

    def buckets(self) -> Iterator[memoryview]:
        """Pass 2 (blocking, after :meth:`seal`): each bucket's bytes in index order. Every bucket is a view of the
        same buffer, valid until the next one is asked for: send it (or copy it) before that."""
        if not self.sealed:
            raise RuntimeError("seal() the stream first: the header must carry every bucket's digest")
        return self._pass(check_finite=False)

    def _pass(self, check_finite: bool) -> Iterator[memoryview]:
        buf = bytearray(self.buffer_bytes)
        view = memoryview(buf)
        src = self._source()
        try:
            it = iter(src)
            for index, lay in enumerate(self._layouts):
                view[: len(lay.prefix)] = lay.prefix
                for name in self._plan[index]:  # the source's order
                    got = next(it, None)
                    if got is None:
                        raise ValueError(f"the weight source ended before tensor {name!r}")
                    self._write(view, got, name, *lay.spans[name], check_finite)
                    del got  # the gathered tensor goes now, not when the next one arrives
                yield view[: lay.nbytes]
            if next(it, None) is not None:
                raise ValueError("the weight source yields more tensors than its specs list")
        finally:
            close = getattr(src, "close", None)
            if close is not None:
                close()

    def _write(self, view: memoryview, got, name: str, begin: int, end: int, check_finite: bool) -> None:
        got_name, t = got
        dtype, shape = self._by_name[name]
        if got_name != name:
            raise ValueError(f"the weight source yielded {got_name!r} where its specs list {name!r}")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"tensor {name!r}: the source yielded {t.dtype}{list(t.shape)}, its specs say {dtype}{list(shape)}"
            )
        if check_finite and not all_finite(t):  # a diverged update must never reach a replica
            raise ValueError(f"refusing to send weights: tensor {name!r} has NaN or infinite values")
        _copy_into(view, t, begin, end)


def _copy_into(view: memoryview, t: torch.Tensor, begin: int, end: int) -> None:
    """``t``'s bytes (any device, any strides) copied to ``view[begin:end]``: from an accelerator, one
    device-to-host copy straight into the bucket (not to a temporary host tensor first)."""
    if end > begin:
        _copy_bytes(torch.frombuffer(view, dtype=torch.uint8, count=end - begin, offset=begin), t)


def _copy_bytes(dst: torch.Tensor, t: torch.Tensor) -> None:
    """``t``'s bytes into the uint8 tensor ``dst`` (host or device, one copy)."""
    if dst.numel():
        dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))


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
