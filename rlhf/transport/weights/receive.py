"""A replica's side of weight sync: check a header, receive and verify the buckets, stage the tensors.

:func:`receive_update` (or :class:`WeightReceiver`, which holds the replica's one update slot and reuses bucket
buffers through a :class:`BufferPool`) returns :class:`StagedWeights` only when every check passed, else raises a
:class:`~rlhf.transport.weights.errors.WeightSyncError`; it asks the replica's ``ServedVersion`` before it allocates
a byte, and the engine advances it at the swap. Authentication is the servicer's job. :class:`BucketFeed` hands
verified buckets to an engine that installs them as they arrive. Design: docs/weight-sync.md#the-update.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf.transport.weights.delta import (
    DeltaBase,
    finish_delta_bucket,
    held_bytes,
    is_delta,
    rebuild_buffers,
    resolve_base,
)
from rlhf.transport.weights.errors import CorruptUpdate, DeltaBaseMissing, IncompleteUpdate, UpdateInProgress
from rlhf.transport.weights.format import Manifest, RawChunk
from rlhf.transport.weights.pack import BufferPool, release_freed_memory
from rlhf.transport.weights.verify import check_header, finish_bucket
from rlhf.transport.weights.version import ServedVersion
from rlhf.v1 import weights_pb2


class StagedInEngine(dict):
    """The tensors of an update that an engine received and staged itself (vLLM: inside its worker, through vLLM's
    weight-transfer API): names only, the values are None. The engine's swap installs them."""

    in_engine = True


@dataclass
class StagedWeights:
    """A verified update, not yet serving: swap ``tensors`` in, then :meth:`WeightReceiver.commit`."""

    version: int
    parent_version: int
    checksum: str
    tensors: dict[str, torch.Tensor]
    nbytes: int  # serialized bytes received
    seconds: float  # receiving and verifying
    manifest: Manifest = field(default_factory=dict)
    # The engine's swap result when it installed the update bucket by bucket as it arrived (an update the engine
    # streams in place, :class:`BucketFeed`): already serving, nothing left to swap.
    installed: Any = None
    # The update's buckets (full, rebuilt from a delta where one came) when its header asks the replica to keep them
    # as the base of the next delta push (``keep_base``); None otherwise
    buckets: list[Any] | None = None

    @property
    def bytes(self) -> int:
        return self.nbytes


@dataclass
class VerifiedBucket:
    """One bucket of an update an engine installs as it arrives: its digest and content checked (:func:`finish_bucket`),
    ``tensors`` are views into ``data`` (the bucket's safetensors bytes)."""

    index: int
    data: memoryview
    tensors: dict[str, torch.Tensor]


_END = object()
# Buckets on the replica at a time when the engine installs an update as it arrives: one being installed, the next
# being received and checked. One slot saves a little peak memory and costs time, since receive no longer overlaps
# install (measured by bench.weight_sync --large: docs/weight-sync.md#large-updates-installed-as-they-arrive-vllm).
STREAM_SLOTS = 2


class BucketFeed:
    """Verified buckets handed from the receiving thread to the engine that installs each one as it arrives (an
    async iterator on the event loop), with at most ``slots`` buckets on the replica at a time: the receiver takes a
    slot (:meth:`take_slot`) before it receives a bucket, the engine gives it back (:meth:`done`) once the bucket is
    installed. So an update of any size costs the replica ``slots`` buckets of memory, not a copy of the update.

    The receiver ends the feed with :meth:`end` (an error: the transfer failed; the engine's iteration raises it);
    an engine that stops early calls :meth:`close`, and the receiver's next :meth:`take_slot` raises."""

    def __init__(self, loop: asyncio.AbstractEventLoop, slots: int = 2):
        if slots < 1:
            raise ValueError("a feed needs at least one slot")
        self.slots = slots
        self._loop = loop
        self._free = threading.Semaphore(slots)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = threading.Event()

    # ---- the receiver (a thread)

    def take_slot(self, timeout: float | None = None) -> bool:
        """Wait (up to ``timeout`` seconds) until a bucket may be received (the engine installed an earlier one):
        True when a slot was taken. IncompleteUpdate once the engine has stopped taking the update."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._closed.is_set():
            wait = 0.05 if end is None else max(0.0, min(0.05, end - time.monotonic()))
            if self._free.acquire(timeout=wait):
                if not self._closed.is_set():
                    return True
                self._free.release()
                break
            if end is not None and time.monotonic() >= end:
                return False
        raise IncompleteUpdate("the engine stopped installing the update")

    def put(self, bucket: VerifiedBucket) -> None:
        self._post(bucket)

    def end(self, error: BaseException | None = None) -> None:
        """No more buckets: the update is complete, or (``error``) the transfer failed."""
        self._post(_END if error is None else error)

    def _post(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    # ---- the engine (the event loop)

    def __aiter__(self) -> BucketFeed:
        return self

    async def __anext__(self) -> VerifiedBucket:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # asked again: still the end
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._queue.put_nowait(item)
            raise item
        return item

    def done(self) -> None:
        """The bucket taken last is installed: its slot is free. Drop every reference to it first: its buffer is
        reused only once nothing refers to it (else the receiver takes a new one)."""
        self._free.release()

    def close(self) -> None:
        """The engine takes no more buckets: the receiver stops at its next slot."""
        self._closed.set()


async def _aiter(requests: AsyncIterable | Iterable):
    if hasattr(requests, "__aiter__"):
        async for m in requests:
            yield m
    else:
        for m in requests:
            yield m


async def receive_update(
    request_iterator: AsyncIterable[weights_pb2.WeightUpdate | RawChunk]
    | Iterable[weights_pb2.WeightUpdate | RawChunk],
    current_version: int,
    *,
    max_total_bytes: int | None = None,
    max_bucket_bytes: int | None = None,
    expected: Mapping[str, tuple[str, Sequence[int]]] | None = None,
    pool: BufferPool | None = None,
    install: Callable[[weights_pb2.WeightHeader], Any] | None = None,
    base: DeltaBase | None = None,
) -> StagedWeights:
    """Receive and verify one update stream (the servicer's ``request_iterator``) against the served
    ``current_version``; return the staged tensors (host memory) or raise a :class:`WeightSyncError`.
    ``install(header)``: the engine's installer for an update it takes as it arrives (``EngineBase.install_streamed``)
    or None; with one, each verified bucket goes to it (:func:`_receive_into_engine`) and the result carries its swap.

    Memory: the staged tensors (views into the received buckets: each bucket is one buffer allocated from the header's
    size and filled chunk by chunk, no join, no parse copy) plus the chunk being hashed. The sha256 of each bucket is
    computed chunk by chunk in a worker thread (hashlib releases the GIL) while the next chunks arrive. Nothing is
    staged unless every bucket and the manifest check out.
    ``expected`` (see :func:`manifest_of`): refuse updates whose names/dtypes/shapes differ from the served model
    (a dtype of None accepts any dtype for that tensor: the engine converts it). Bucket sizes are checked against the
    listed tensors before anything is allocated.
    ``pool``: take the bucket buffers from it (see :class:`BufferPool`), else allocate them.
    ``base``: the update this replica keeps for delta pushes (:mod:`~rlhf.transport.weights.delta`); a delta header
    that names another base is refused (DeltaBaseMissing) before a byte of data is read.
    """
    t0 = time.perf_counter()
    stream = _aiter(request_iterator)
    h = await _first_header(stream)
    per_bucket = check_header(h, current_version, max_total_bytes, max_bucket_bytes, expected)
    base = resolve_base(h, base)
    installer = install(h) if install is not None else None
    if installer is not None:
        if base is not None:  # installed bucket by bucket as it arrives: no base buckets to rebuild on
            raise DeltaBaseMissing("this replica installs an update of this size as it arrives: send it in full")
        pool = pool if pool is not None else BufferPool()
        return await _receive_into_engine(stream, h, per_bucket, installer, pool, t0)
    return await _receive_staged(stream, h, per_bucket, pool, base, t0)


async def _first_header(stream: AsyncIterator) -> weights_pb2.WeightHeader:
    """The header the first message of an update stream must carry."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        raise IncompleteUpdate("empty stream: send a WeightUpdate with the header first") from None
    if isinstance(first, RawChunk) or first.WhichOneof("part") != "header":
        raise CorruptUpdate("the first WeightUpdate must carry the header", field="header")
    return first.header


@dataclass
class _BucketFinisher:
    """Checks and parses each complete bucket of a staged update (called in the verify worker): a full bucket against
    its digest, a delta bucket rebuilt on ``base``. Keeps each bucket as served in ``fulls`` (for ``keep_base``)."""

    per_bucket: list[Manifest]
    base: DeltaBase | None
    rebuilt: list[Any]  # per bucket, the buffer a delta bucket is rebuilt into (None for a full update)
    fulls: list[Any]

    def __call__(self, i: int, data: bytearray, hasher: Any, spec: weights_pb2.BucketEntry) -> dict[str, torch.Tensor]:
        if spec.encoding:
            out, self.rebuilt[i] = self.rebuilt[i], None  # from here only the staged tensors (and fulls) refer to it
            digest = hasher.hexdigest()
            tensors, self.fulls[i] = finish_delta_bucket(i, data, digest, spec, self.per_bucket[i], self.base, out)
            return tensors
        self.fulls[i] = data
        return finish_bucket(i, data, hasher.hexdigest(), spec.sha256, self.per_bucket[i])


async def _receive_staged(
    stream: AsyncIterator,
    h: weights_pb2.WeightHeader,
    per_bucket: list[Manifest],
    pool: BufferPool | None,
    base: DeltaBase | None,
    t0: float,
) -> StagedWeights:
    """The rest of an update stream into bucket buffers (from ``pool``, else allocated), each verified and parsed
    into tensors as it completes (a delta's rebuilt on ``base``): the update staged, once every bucket checks out."""
    nb = len(h.buckets)
    if pool is not None:  # keep about two updates' buffers: the one serving (double buffering) and the next
        pool.trim(2 * held_bytes(h))
    staged: dict[str, torch.Tensor] = {}
    loop = asyncio.get_running_loop()
    # One worker thread, FIFO: it hashes each chunk from the bucket buffer (hashlib releases the GIL) and then checks
    # and parses the finished bucket, while the event loop goes on receiving; the loop never waits for it mid-stream
    # (queued work refers to the bucket buffers, which exist anyway, so the queue costs no memory).
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-verify")
    finishing: list[asyncio.Future] = []  # per bucket: its digest checked and its tensors made
    index, filled, received = 0, 0, 0
    buf: bytearray | None = None
    view: memoryview | None = None
    hasher = hashlib.sha256()
    finish = _BucketFinisher(
        per_bucket,
        base,
        rebuilt=rebuild_buffers(h, pool.take if pool is not None else bytearray) if base is not None else [None] * nb,
        fulls=[None] * nb,  # each bucket as served (a delta's rebuilt on the base): kept with keep_base
    )
    try:
        async for msg in stream:
            c = _chunk_of(msg, index, filled, nb)
            data = c.data
            size = len(data)
            bucket = h.buckets[index]
            _check_chunk(index, filled, size, bucket.nbytes)
            if buf is None:  # sized by the header (already checked against the limits), so never regrown
                buf = pool.take(bucket.nbytes) if pool is not None else bytearray(bucket.nbytes)
                view = memoryview(buf)
            assert view is not None
            view[filled : filled + size] = data
            del data, msg, c
            worker.submit(hasher.update, view[filled : filled + size])
            filled += size
            received += size
            if filled == bucket.nbytes:
                finishing.append(loop.run_in_executor(worker, finish, index, buf, hasher, bucket))
                index, filled, buf, view, hasher = index + 1, 0, None, None, hashlib.sha256()
            if finishing and finishing[0].done():  # refuse a corrupt bucket as soon as it is known
                staged.update(finishing.pop(0).result())
        for f in finishing:
            staged.update(await f)
        finishing.clear()
    finally:
        if finishing:  # failed or cancelled: let the worker finish its queue, drop the results
            await asyncio.gather(*finishing, return_exceptions=True)
        worker.shutdown(wait=False)
    if index < nb:
        raise IncompleteUpdate(
            f"stream ended after {received} of {h.total_bytes} bytes (bucket {index} of {nb} at byte {filled}): "
            "the update was cut; nothing was staged"
        )
    return StagedWeights(
        version=h.version,
        parent_version=h.parent_version,
        checksum=h.checksum,
        tensors={t.name: staged[t.name] for t in h.tensors},
        nbytes=received,
        seconds=time.perf_counter() - t0,
        manifest={name: spec for m in per_bucket for name, spec in m.items()},
        buckets=finish.fulls if h.keep_base else None,
    )


def _chunk_of(msg: Any, index: int, filled: int, nb: int) -> Any:
    """The chunk a stream message carries, checked to be the next one (buckets in index order, contiguous)."""
    if isinstance(msg, RawChunk):
        c = msg
    elif msg.WhichOneof("part") != "chunk":
        raise CorruptUpdate("a second header in the stream; send one header, then chunks")
    else:
        c = msg.chunk
    if index >= nb:
        raise CorruptUpdate(f"chunk for bucket {c.bucket} after the last bucket ({nb - 1}) was complete")
    if c.bucket != index or c.offset != filled:
        raise CorruptUpdate(
            f"chunk for bucket {c.bucket} at offset {c.offset}: expected bucket {index} at offset {filled} "
            "(buckets in index order, chunks contiguous)"
        )
    return c


def _check_chunk(index: int, filled: int, size: int, nbytes: int) -> None:
    if size == 0:
        raise CorruptUpdate(f"empty chunk in bucket {index} at offset {filled}")
    if filled + size > nbytes:
        raise CorruptUpdate(f"bucket {index} overruns its {nbytes} bytes (chunk at {filled}+{size})")


async def _receive_into_engine(
    stream: AsyncIterator,
    h: weights_pb2.WeightHeader,
    per_bucket: list[Manifest],
    installer: Any,
    pool: BufferPool,
    t0: float,
) -> StagedWeights:
    """The rest of an ``UpdateWeights`` stream handed to the engine bucket by bucket (``installer(header, feed)``)
    as each is verified, holding at most ``STREAM_SLOTS`` buckets (buffers of the largest bucket's size from
    ``pool``); the last bucket goes over once the stream has ended (a chunk after it refuses the update). A failure
    ends the feed with it, so the engine stops; the engine's own failure stops the stream."""
    loop = asyncio.get_running_loop()
    feed = BucketFeed(loop, STREAM_SLOTS)
    install = asyncio.ensure_future(installer(h, feed))
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-verify")
    size, nb = max(b.nbytes for b in h.buckets), len(h.buckets)
    finishing: list[tuple[int, memoryview, asyncio.Future]] = []
    index = filled = received = 0
    view: memoryview | None = None
    hasher = hashlib.sha256()

    def finish(i: int, data: memoryview, hasher: Any, spec: Any) -> dict[str, torch.Tensor]:
        return finish_bucket(i, data, hasher.hexdigest(), spec.sha256, per_bucket[i])

    async def hand_over(wait: bool, keep_last: bool) -> None:
        while finishing and (wait or finishing[0][2].done()) and not (keep_last and finishing[0][0] == nb - 1):
            i, data, fut = finishing.pop(0)
            feed.put(VerifiedBucket(i, data, await fut))

    try:
        async for msg in stream:
            c = _chunk_of(msg, index, filled, nb)
            chunk, bucket = c.data, h.buckets[index]
            _check_chunk(index, filled, len(chunk), bucket.nbytes)
            if view is None:
                if len(finishing) >= feed.slots:  # every slot is held by a bucket the engine has not got yet
                    await hand_over(wait=True, keep_last=False)
                while not feed.take_slot(timeout=0):  # wait for the engine without blocking the event loop
                    if install.done():
                        break  # it stopped: its error is raised below
                    await hand_over(wait=False, keep_last=True)
                    await asyncio.sleep(0.002)
                if install.done():
                    break
                for _ in range(50):  # the engine drops its last references to an installed bucket just after its slot
                    if pool.count < feed.slots or pool.free(size):
                        break
                    await asyncio.sleep(0.001)
                view = memoryview(pool.take(size))[: bucket.nbytes]
            view[filled : filled + len(chunk)] = chunk
            worker.submit(hasher.update, view[filled : filled + len(chunk)])
            filled += len(chunk)
            received += len(chunk)
            del chunk, c, msg
            if filled == bucket.nbytes:
                finishing.append((index, view, loop.run_in_executor(worker, finish, index, view, hasher, bucket)))
                index, filled, view, hasher = index + 1, 0, None, hashlib.sha256()
            await hand_over(wait=False, keep_last=True)
        if not install.done():
            if index < nb:
                raise IncompleteUpdate(
                    f"stream ended after {received} of {h.total_bytes} bytes (bucket {index} of {nb} at byte "
                    f"{filled}): the update was cut"
                )
            await hand_over(wait=True, keep_last=False)
            feed.end()
    except BaseException as err:
        feed.end(err)
        await asyncio.gather(install, return_exceptions=True)
        raise
    finally:
        finishing.clear()
        view = None
        worker.shutdown(wait=False)
    try:
        result = await install  # the engine's own failure, if it stopped
    finally:
        feed.close()
        pool.trim(0)  # no bucket kept between updates (buffers of the largest bucket's size serve no other use)
        release_freed_memory()
    return StagedWeights(
        version=h.version,
        parent_version=h.parent_version,
        checksum=h.checksum,
        tensors=StagedInEngine(),
        nbytes=received,
        seconds=time.perf_counter() - t0,
        manifest={name: spec for m in per_bucket for name, spec in m.items()},
        installed=result,
    )


class WeightReceiver:
    """A replica's receiving side: one update at a time (the update slot), checked against the served version.

    ::

        receiver = WeightReceiver(engine.served, expected=manifest_of(model.state_dict()))

        async def UpdateWeights(self, request_iterator, context):   # inside rlhf.serving.grpc_errors
            require_grpc_token(context, settings)
            staged = await receiver.receive(request_iterator)      # raises WeightSyncError: old weights keep serving
            await engine.swap_weights(staged.tensors, staged.version, staged.checksum, staged.parent_version)

    ``served``: the replica's :class:`ServedVersion` (the engine's; the engine advances it at the swap). An int
    makes a private one at that version (tests and tools without an engine: :meth:`commit` then advances it).
    """

    def __init__(
        self,
        served: ServedVersion | int = 0,
        *,
        checksum: str = "",
        max_total_bytes: int | None = None,
        max_bucket_bytes: int | None = None,
        expected: Mapping[str, tuple[str, Sequence[int]]] | None = None,
    ):
        if not isinstance(served, ServedVersion):
            served = ServedVersion(version=served, checksum=checksum)
        self.served = served
        self.max_total_bytes = max_total_bytes
        self.max_bucket_bytes = max_bucket_bytes
        self.expected = expected
        self.pool = BufferPool()
        self._busy = False
        # The last update kept for delta pushes (its header's keep_base), once the engine serves it: see keep_base
        self.base: DeltaBase | None = None

    @property
    def current_version(self) -> int:
        return self.served.version

    @property
    def checksum(self) -> str:
        return self.served.checksum

    @property
    def busy(self) -> bool:
        return self._busy

    def reserve(self) -> None:
        """Take the one-update slot (raises UpdateInProgress); :meth:`receive` and the data plane's Open do."""
        if self._busy:
            raise UpdateInProgress("another weight update is being received; retry when it has finished")
        self._busy = True

    def release(self) -> None:
        self._busy = False

    def check(self, header: weights_pb2.WeightHeader, collective: bool = False) -> list[Manifest]:
        """:func:`check_header` against the served version and this receiver's limits and manifest (``collective``:
        the buckets come by broadcast, and may carry device digests)."""
        return check_header(
            header, self.served.version, self.max_total_bytes, self.max_bucket_bytes, self.expected, collective
        )

    def delta_base(self, header: weights_pb2.WeightHeader, whole: bool = True) -> DeltaBase | None:
        """The base a delta header applies to, None for a full update; DeltaBaseMissing when this replica does not
        hold it, or (``whole`` False: the update is installed as it arrives, or comes by collective) cannot rebuild
        buckets on it."""
        if not whole and is_delta(header):
            raise DeltaBaseMissing("this replica takes this update as it arrives or by broadcast: send it in full")
        return resolve_base(header, self.base)

    def keep_base(self, staged: StagedWeights | None) -> None:
        """After a swap: keep ``staged``'s buckets as the next delta's base when its header asked (``keep_base``),
        else hold none (an update installed another way, or deltas off: no memory kept for them)."""
        buckets = staged.buckets if staged is not None else None
        self.base = None if buckets is None else DeltaBase(staged.version, staged.checksum, buckets)

    async def receive(self, request_iterator: AsyncIterable | Iterable, install: Any = None) -> StagedWeights:
        """:func:`receive_update` in the update slot (``install``: see there)."""
        self.reserve()
        try:
            return await receive_update(
                request_iterator,
                self.served.version,
                max_total_bytes=self.max_total_bytes,
                max_bucket_bytes=self.max_bucket_bytes,
                expected=self.expected,
                pool=self.pool,
                install=install,
                base=self.base,
            )
        finally:
            self.release()

    def commit(self, staged: StagedWeights) -> None:
        """Advance the served version to ``staged`` (for a receiver without an engine; an engine's swap does it).
        Refuses to go backwards (StaleVersion)."""
        self.served.advance(staged.version, staged.parent_version, staged.checksum)
