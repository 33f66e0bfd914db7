"""Packing an update: a state dict (or a tensor source) copied into the safetensors buckets of
:mod:`rlhf.transport.weights.format`, and the header sealed with their digests.

- :func:`copy_weights` / :func:`pack_weights`: :class:`PackedWeights`, every bucket in memory (host, or the trainer's
  device for a collective nccl/hccl push), which many replicas read at their own pace;
- :class:`StreamedWeights`: made bucket by bucket from a source that yields one tensor at a time (a sharded trainer's
  gather), so a pass holds one bucket and one tensor;
- :class:`BufferPool` and :func:`release_freed_memory`: the bucket memory a sender or a replica reuses or returns.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlhf.transport.weights.checksum import device_digest
from rlhf.transport.weights.format import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    FORMAT,
    TensorSpec,
    all_finite,
    bucket_digest,
    bucket_layout,
    dtype_name,
    encode_chunk,
    manifest_checksum,
)
from rlhf.v1 import weights_pb2

_LIBC: Any = None


def release_freed_memory() -> None:
    """Hand memory the process has freed back to the system (glibc's ``malloc_trim``; elsewhere nothing). glibc
    keeps freed blocks below its mmap threshold (which grows to 32 MiB once such a block is freed) in its arenas:
    loading a model layer by layer, as an update installed bucket by bucket does, otherwise leaves hundreds of MB
    freed but resident."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018 - glibc only
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


class BufferPool:
    """Bucket buffers kept from one update to the next. Fresh memory costs a page fault per 4 KiB on first touch
    (as slow as the transfer itself: docs/weight-sync.md#the-update); a replica that receives an update every step
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
        lay = bucket_layout([(name, state_dict[name].dtype, tuple(state_dict[name].shape)) for name in names])
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
        self._layouts = [bucket_layout([(n, *by_name[n]) for n in names]) for names in plan]
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
