"""Weight sync's raw-TCP data plane: the update's bytes on one plain TCP connection, the control on gRPC.

Python gRPC streaming tops out well below a loopback socket copy (bench.weight_sync, docs/benchmarks.md), so the
buckets travel outside it: :meth:`WeightDataServer.open` (``OpenWeightsTransfer``) checks the header and answers a
single-use ticket and the data port, :func:`send_buckets` sends the ticket and the buckets on one connection, and
:meth:`WeightDataServer.take` (``CommitWeights``) returns the verified staged weights. Plaintext: off under TLS.

Design (the protocol, who can hold the update slot and for how long):
docs/weight-sync.md#tcp-data-plane-rlhf_weights_data_port-on-the-replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rlhf.serving.errors import RLHFError
from rlhf.transport.weights.collective import GroupSpec, receive_buckets
from rlhf.transport.weights.delta import finish_delta_bucket, held_bytes, rebuild_buffers
from rlhf.transport.weights.errors import CorruptUpdate, IncompleteUpdate
from rlhf.transport.weights.pack import BufferPool, release_freed_memory
from rlhf.transport.weights.receive import (
    STREAM_SLOTS,
    BucketFeed,
    StagedInEngine,
    StagedWeights,
    VerifiedBucket,
    WeightReceiver,
)
from rlhf.transport.weights.verify import finish_bucket
from rlhf.v1 import weights_pb2

log = logging.getLogger("rlhf.transport.weights.dataplane")

TICKET_BYTES = 32
DEFAULT_TTL_S = 60.0
TICKET_WAIT_S = 10.0  # a client sends its ticket as soon as it connects
DEFAULT_READ_TIMEOUT_S = 30.0  # no byte for this long on a data connection: the transfer is dropped
DEFAULT_MIN_RATE = 8 << 20  # bytes/s: a transfer's deadline is ttl + total_bytes / min_rate
MAX_PENDING_CONNECTIONS = 16  # connections that have not presented a ticket yet
# recv_into / sha256 granularity. Each slice costs the receiving thread (and its hash lane) a GIL handover, and
# beside a thread that holds the GIL (the replica's generation, vLLM's engine thread above all) each waits up to the
# switch interval (5 ms), so beside such a thread larger slices arrive and hash faster, and alone the size changes
# nothing (measured by bench.recv_slices, docs/benchmarks.md). Small enough that hashing follows the data closely
# (only the last slice of the last bucket is hashed after the transfer).
SLICE_BYTES = 16 << 20
SEND_CHUNK_BYTES = 256 << 20  # the sender checks its deadline between sendall calls of this size
_RECV_FLAGS = socket.MSG_WAITALL
HASH_LANES = 4  # hash lanes per transfer: 1, 2 and 4 compared in docs/benchmarks.md (weight sync, data plane profile)
_SOCKET_BUFFER = 4 << 20  # loopback/LAN: larger kernel buffers mean fewer wake-ups per byte


class _Transfer:
    """One update from Open until it is taken (CommitWeights), fails or expires. Lives on the event loop."""

    def __init__(self, header: weights_pb2.WeightHeader, per_bucket: list, buffers: list[bytearray], ttl: float):
        # deadline of the data once its connection arrives: set by the server (ttl + total_bytes / min_rate)
        self.ticket = secrets.token_bytes(TICKET_BYTES)
        self.header = header
        self.per_bucket = per_bucket
        self.buffers: list[bytearray] | None = buffers
        self.claimed = False  # a connection presented the ticket: single use
        self.sock: socket.socket | None = None
        self.result: asyncio.Future[StagedWeights] = asyncio.get_running_loop().create_future()
        self.t0 = time.perf_counter()
        self.timer: asyncio.TimerHandle | None = None
        self.ttl = ttl
        self.deadline_s = ttl
        # The engine's installer when it takes this update bucket by bucket as it arrives (no buffers reserved: the
        # data connection hands each verified bucket over, see _serve_streamed); None: received whole, then swapped
        self.stream: Any = None
        self.base: Any = None  # the DeltaBase a delta update is rebuilt on (rlhf.transport.weights.delta)
        self.fulls: list[Any] | None = None  # the buckets as served, when the header asks to keep them
        self.rebuilt: list[Any] | None = None  # per delta bucket, the buffer it is rebuilt in (from the pool)


class WeightDataServer:
    """The replica's data-plane listener and tickets, for one :class:`WeightReceiver` (which keeps serialising
    updates: while a transfer is open, ``UpdateWeights`` and another Open get UpdateInProgress).

    ::

        data = WeightDataServer(receiver, host="0.0.0.0", port=0)
        await data.start()                                    # data.port
        ticket, ttl = await data.open(header)                 # OpenWeightsTransfer
        staged = await data.take(ticket)                      # CommitWeights; then swap and receiver.commit(staged)
        await data.close()
    """

    def __init__(
        self,
        receiver: WeightReceiver,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        ttl: float = DEFAULT_TTL_S,
        read_timeout: float = DEFAULT_READ_TIMEOUT_S,
        min_rate: float = DEFAULT_MIN_RATE,
        ticket_wait: float = TICKET_WAIT_S,
    ):
        if min(ttl, read_timeout, min_rate, ticket_wait) <= 0:
            raise ValueError("ttl, read_timeout, min_rate and ticket_wait must be positive")
        self.receiver = receiver
        self.host, self.port, self.ttl = host, port, ttl
        self.read_timeout, self.min_rate, self.ticket_wait = read_timeout, min_rate, ticket_wait
        self._pending: dict[socket.socket, None] = {}  # connections that have not presented a ticket, oldest first
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._transfers: list[_Transfer] = []  # at most one open at a time (the receiver's slot), plus settled ones
        # Bucket buffers of streamed transfers (taken in their receiving thread, kept for the next update); the lock:
        # a dropped transfer's thread may still be winding down when the next one starts
        self._stream_pool = BufferPool()
        self._stream_lock = threading.Lock()
        self._conns: set[asyncio.Task] = set()

    # ------------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(8)
        sock.setblocking(False)
        self._sock, self.port = sock, sock.getsockname()[1]
        self._accepting = asyncio.create_task(self._accept_loop(), name="weights-data-accept")
        return self.port

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
        for t in list(self._transfers):
            self._drop(t, IncompleteUpdate("the replica is shutting down"))
        for task in list(self._conns):
            task.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # ------------------------------------------------------------------------------------------------ control

    @property
    def listening(self) -> bool:
        """The data port is open (:meth:`start` ran): Open without a group answers it."""
        return self._sock is not None

    async def open(
        self,
        header: weights_pb2.WeightHeader,
        group: GroupSpec | None = None,
        receive: Any = None,
        stream: Any = None,
    ) -> tuple[bytes, float]:
        """Check ``header`` as the stream path does, reserve the receiver and the bucket buffers; (ticket, ttl).
        With ``group`` the buckets come by collective broadcast (:mod:`rlhf.transport.weights.collective`): the
        replica joins the push's group at once, under the same deadline, abort and commit. ``receive``: the engine's
        own receiver, ``await receive(group, ticket, header, per_bucket) -> (tensors, nbytes)`` (default: this
        process, :func:`~rlhf.transport.weights.collective.receive_buckets` in a thread).

        ``stream`` (no ``group``): the engine installs this update bucket by bucket as it arrives,
        ``await stream(header, feed) -> swap result`` over a :class:`~rlhf.transport.weights.receive.BucketFeed`;
        no buffer is reserved for the whole update, the data connection holds at most ``STREAM_SLOTS`` buckets, and
        the transfer's result carries the swap result (``StagedWeights.installed``)."""
        r = self.receiver
        r.reserve()  # UpdateInProgress
        try:
            per_bucket = r.check(header, collective=group is not None)
            base = r.delta_base(header, whole=group is None and stream is None)  # DeltaBaseMissing
            if group is None and stream is None:
                r.pool.trim(2 * held_bytes(header))  # as receive_update: the update serving and this one
                buffers = [r.pool.take(b.nbytes) for b in header.buckets]
                rebuilt = rebuild_buffers(header, r.pool.take) if base is not None else None
            elif group is None:  # streamed: the data connection takes its buffers from _stream_pool
                buffers, rebuilt = [], None
            else:
                buffers, rebuilt = [], None  # the collective receiver allocates its own (a cut thread never reuses)
        except BaseException:
            r.release()
            raise
        t = _Transfer(header, per_bucket, buffers, self.ttl)
        t.stream = stream if group is None else None
        t.base, t.rebuilt = base, rebuilt
        t.deadline_s = self.ttl + header.total_bytes / self.min_rate
        self._transfers.append(t)
        loop = asyncio.get_running_loop()
        if group is None:
            t.timer = loop.call_later(self.ttl, self._expire, t, "no data connection")
        else:
            t.claimed = True  # no data connection will present the ticket
            t.timer = loop.call_later(t.deadline_s, self._expire, t, f"not complete within {t.deadline_s:.0f} s")
            task = asyncio.create_task(self._serve_collective(t, group, receive))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)
        return t.ticket, self.ttl

    async def _serve_collective(self, t: _Transfer, group: GroupSpec, receive: Any) -> None:
        try:
            if receive is None:
                tensors, nbytes = await asyncio.to_thread(receive_buckets, group, t.ticket, t.header, t.per_bucket)
            else:
                tensors, nbytes = await receive(group, t.ticket, t.header, t.per_bucket)
        except Exception as err:  # noqa: BLE001 - settled into the transfer; CommitWeights reports it
            self._refuse(t, err, "the collective transfer failed", "collective weight transfer")
            return
        self._settle(t, self._staged(t, tensors, nbytes))

    def _refuse(self, t: _Transfer, err: Exception, failed: str, what: str) -> None:
        """Settle ``t`` with the error a receive raised: a corrupt or incomplete update as it is, anything else (a
        broken connection or group) as an incomplete one."""
        if not isinstance(err, (CorruptUpdate, IncompleteUpdate)):
            err = IncompleteUpdate(f"{failed}: {err}")
        log.warning("%s for version %d refused: %s", what, t.header.version, err)
        self._settle(t, err)

    @staticmethod
    def _staged(t: _Transfer, tensors: dict[str, Any], nbytes: int, installed: Any = None) -> StagedWeights:
        h = t.header
        manifest = {name: spec for m in t.per_bucket for name, spec in m.items()}
        if installed is None and not isinstance(tensors, StagedInEngine):
            tensors = {x.name: tensors[x.name] for x in h.tensors}
        return StagedWeights(
            version=h.version,
            parent_version=h.parent_version,
            checksum=h.checksum,
            tensors=tensors,
            nbytes=nbytes,
            seconds=time.perf_counter() - t.t0,
            manifest=manifest,
            installed=installed,
            buckets=t.fulls if h.keep_base and installed is None else None,
        )

    def abort(self, ticket: bytes) -> bool:
        """The sender gives up (``AbortWeightsTransfer``): drop the transfer of ``ticket`` now, freeing the slot and
        cutting its data connection. False when no transfer in progress has that ticket (a finished one is left to
        its commit or expiry)."""
        t = self._find(ticket)
        if t is None or t.result.done():
            return False
        log.warning("weight transfer for version %d aborted by the sender", t.header.version)
        self._drop(t, IncompleteUpdate("the sender aborted the transfer; nothing was staged"))
        return True

    @property
    def open_transfers(self) -> int:
        """Transfers holding the update slot (opened, data not yet in)."""
        return sum(1 for t in self._transfers if not t.result.done())

    async def take(self, ticket: bytes) -> StagedWeights:
        """Wait for the transfer of ``ticket`` and return its staged weights (or raise its error); it is then done:
        the receiver's slot is free and the caller swaps. Raises IncompleteUpdate for an unknown/expired ticket."""
        t = self._find(ticket)
        if t is None:
            raise IncompleteUpdate("unknown or expired transfer ticket: nothing was staged; open a new transfer")
        try:
            staged = await asyncio.shield(t.result)  # a cancelled commit leaves the transfer to its expiry
        finally:
            if t.result.done():
                self._forget(t)
        return staged

    # ------------------------------------------------------------------------------------------------ internals

    def _find(self, ticket: bytes) -> _Transfer | None:
        found = None
        for t in self._transfers:  # constant time per comparison; no early exit either
            if hmac.compare_digest(t.ticket, ticket) and found is None:
                found = t
        return found

    def _settle(self, t: _Transfer, outcome: StagedWeights | BaseException) -> None:
        """The data is in (or failed): free the slot on failure, keep the staged weights ``ttl`` for the commit."""
        if t.result.done():
            return
        if isinstance(outcome, BaseException):
            t.result.set_exception(outcome)
            t.result.exception()  # retrieved: no "never retrieved" warning when nobody commits
            self._release(t)
        else:
            t.result.set_result(outcome)
        if t.timer is not None:
            t.timer.cancel()
        t.timer = asyncio.get_running_loop().call_later(t.ttl, self._forget, t)

    def _release(self, t: _Transfer) -> None:
        if t.buffers is not None:  # the buffers go back to the pool (nothing else refers to them now)
            t.buffers = None
            self.receiver.release()

    def _forget(self, t: _Transfer) -> None:
        if t.timer is not None:
            t.timer.cancel()
            t.timer = None
        if t in self._transfers:
            self._transfers.remove(t)
        if not t.result.done():
            t.result.set_exception(IncompleteUpdate("transfer dropped"))
            t.result.exception()
        self._release(t)

    def _drop(self, t: _Transfer, err: BaseException) -> None:
        if t.sock is not None:  # wakes the receiving thread up (recv_into returns 0 or raises)
            with contextlib.suppress(OSError):
                t.sock.shutdown(socket.SHUT_RDWR)
        self._settle(t, err)
        self._forget(t)

    def _expire(self, t: _Transfer, why: str) -> None:
        if t.result.done():
            return
        if not t.claimed:
            log.warning("weight transfer for version %d expired: %s within %.0f s", t.header.version, why, t.ttl)
            self._drop(t, IncompleteUpdate(f"the transfer ticket expired: {why} within {t.ttl:.0f} s"))
            return
        log.warning("weight transfer for version %d cut: %s", t.header.version, why)
        self._drop(t, IncompleteUpdate(f"the transfer was cut: {why}; nothing was staged"))

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as err:  # e.g. EMFILE: keep serving
                log.warning("weights data port: accept failed: %s", err)
                await asyncio.sleep(0.1)
                continue
            if len(self._pending) >= MAX_PENDING_CONNECTIONS:
                # A flood of connections that send no ticket: drop the oldest waiting one, not the newcomer (a real
                # sender sends its ticket at once, so it never waits long enough to be the oldest).
                oldest = next(iter(self._pending))
                self._pending.pop(oldest)
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)
            self._pending[conn] = None
            task = asyncio.create_task(self._serve(conn))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            ticket = bytearray()
            try:
                async with asyncio.timeout(min(self.ttl, self.ticket_wait)):  # a connection without a ticket
                    while len(ticket) < TICKET_BYTES:
                        part = await loop.sock_recv(conn, TICKET_BYTES - len(ticket))
                        if not part:
                            return
                        ticket += part
            except (TimeoutError, OSError):
                return
            finally:
                self._pending.pop(conn, None)
            t = self._find(bytes(ticket))
            if t is None or t.claimed or t.result.done():
                log.warning("weights data port: connection with an unknown, used or expired ticket refused")
                return
            t.claimed, t.sock = True, conn
            if t.timer is not None:  # from now on the transfer's deadline bounds it, not the ticket's expiry
                t.timer.cancel()
            why = f"not complete within {t.deadline_s:.0f} s"
            t.timer = loop.call_later(t.deadline_s, self._expire, t, why)
            # Blocking, with the kernel's receive timeout rather than Python's (which polls a non-blocking socket):
            # MSG_WAITALL then returns once per slice, so the thread takes the GIL once per slice, not once per
            # loopback segment, each time queueing behind the event loop and generation (up to 5 ms per switch).
            # No progress for read_timeout: recv fails and the transfer is dropped.
            conn.setblocking(True)
            sec = int(self.read_timeout)
            usec = int((self.read_timeout - sec) * 1e6)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", sec, usec))
            if t.stream is not None:
                await self._serve_streamed(t, conn)
                return
            assert t.buffers is not None
            try:
                fulls: list[Any] = [None] * len(t.buffers)
                rebuilt, t.rebuilt = t.rebuilt, None
                tensors, nbytes = await asyncio.to_thread(
                    _receive_buckets, conn, t.header, t.per_bucket, t.buffers, t.base, fulls, rebuilt
                )
                t.fulls = fulls
            except Exception as err:  # noqa: BLE001 - settled into the transfer; CommitWeights reports it
                self._refuse(t, err, "the data connection failed", "weight transfer")
                return
            finally:
                t.sock = None
            self._settle(t, self._staged(t, tensors, nbytes))

    async def _serve_streamed(self, t: _Transfer, conn: socket.socket) -> None:
        """A transfer the engine installs as it arrives: this thread receives and verifies bucket after bucket into
        at most STREAM_SLOTS buffers and hands each to the engine's installer (which pauses generation for the whole
        load). Any failure cuts the connection and stops the other side; the installer decides what the model then
        serves (``EngineBase.install_streamed``: nothing, until a complete update arrives)."""
        loop = asyncio.get_running_loop()
        feed = BucketFeed(loop, STREAM_SLOTS)
        receiving = asyncio.ensure_future(
            asyncio.to_thread(
                _receive_streamed, conn, t.header, t.per_bucket, feed, self._stream_pool, self._stream_lock
            )
        )
        try:
            installed = await t.stream(t.header, feed)
        except BaseException as err:
            feed.close()  # the receiving thread stops at its next bucket, or now: the connection is cut
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            await asyncio.gather(receiving, return_exceptions=True)
            t.sock = None
            self._free_stream_buffers()
            if not isinstance(err, Exception):
                self._settle(t, IncompleteUpdate("the transfer was cancelled"))
                raise
            if isinstance(err, RLHFError):  # the receive's refusal as the engine re-raised it, or the engine's own
                log.warning(
                    "weight transfer for version %d (installed as it arrived) failed: %s", t.header.version, err
                )
                self._settle(t, err)
            else:
                self._refuse(t, err, "installing the update as it arrived failed", "weight transfer")
            return
        t.sock = None
        nbytes = await receiving  # the feed ended: the thread has returned
        self._free_stream_buffers()
        self._settle(t, self._staged(t, StagedInEngine(), nbytes, installed))

    def _free_stream_buffers(self) -> None:
        """Once the engine has installed (or dropped) the last bucket: no bucket buffer is kept between updates (an
        update every few minutes need not hold them meanwhile; the receiving thread cannot free the last two, the
        engine holds them when it returns)."""
        with self._stream_lock:
            self._stream_pool.trim(0)
        release_freed_memory()


def _take_buffer(pool: BufferPool, lock: threading.Lock, size: int, slots: int) -> bytearray:
    """A bucket buffer for a streamed transfer: once ``slots`` exist, wait briefly for one the engine gives back
    (it drops its last references to an installed bucket just after freeing the slot) before making another."""
    deadline = time.monotonic() + 0.05
    while True:
        with lock:
            if pool.count < slots or pool.free(size) or time.monotonic() >= deadline:
                return pool.take(size)
        time.sleep(0.001)


def _recv_slices(
    conn: socket.socket, view: memoryview, nbytes: int, on_slice: Any, where: str, slice_bytes: int = 0
) -> None:
    """``nbytes`` bytes into ``view``, ``slice_bytes`` (default SLICE_BYTES) at a time (``on_slice(start, end)``
    after each). Raises IncompleteUpdate on a short read, a timeout or a reset (``where`` says how far the update
    got)."""
    step = slice_bytes or SLICE_BYTES
    filled = 0
    while filled < nbytes:
        start, end = filled, min(filled + step, nbytes)
        while filled < end:
            try:
                n = conn.recv_into(view[filled:end], end - filled, _RECV_FLAGS)
            except (TimeoutError, BlockingIOError):  # SO_RCVTIMEO passed without a byte
                raise IncompleteUpdate("the data connection made no progress in time") from None
            except OSError as err:
                raise IncompleteUpdate(f"the data connection failed: {err}") from None
            if n == 0:
                raise IncompleteUpdate(f"data ended {where} at byte {filled}: the update was cut")
            filled += n
        on_slice(start, end)


def _expect_eof(conn: socket.socket, total: int) -> None:
    try:
        extra = conn.recv(1)
    except OSError:  # timeout or reset after every byte arrived: the data is complete, judge it
        extra = b""
    if extra:
        raise CorruptUpdate(f"bytes after the last bucket ({total} bytes): the update is not the header's")


def _receive_streamed(
    conn: socket.socket,
    h: weights_pb2.WeightHeader,
    per_bucket: list,
    feed: BucketFeed,
    pool: BufferPool,
    lock: threading.Lock,
) -> int:
    """In a thread: each bucket into a buffer of the largest bucket's size (from ``pool``, reused once nothing
    refers to it), hashed as its slices arrive, checked (:func:`finish_bucket`) on a lane while the next bucket
    arrives, then handed to the engine; a slot of ``feed`` is taken before each bucket, so at most ``feed.slots``
    buckets are on the replica. The last bucket is handed over only after the sender's end of data (bytes after it
    refuse the update). Ends the feed (with the error on failure); returns the bytes received."""
    size = max(b.nbytes for b in h.buckets)
    lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-verify") for _ in range(2)]
    pending: list[tuple[int, memoryview, Future]] = []  # checked (or being checked), not handed over yet
    received = 0

    def hand_over(wait: bool) -> None:
        while pending and (wait or pending[0][2].done()):
            i, data, fut = pending.pop(0)
            feed.put(VerifiedBucket(i, data, fut.result()))  # a refused bucket raises here

    try:
        for i, spec in enumerate(h.buckets):
            if len(pending) >= feed.slots:  # every slot is held by a bucket the engine has not got yet
                hand_over(wait=True)
            while not feed.take_slot(timeout=0.02):  # the engine is installing: hand over what is checked meanwhile
                hand_over(wait=False)
            buf = _take_buffer(pool, lock, size, feed.slots)
            data = memoryview(buf)[: spec.nbytes]
            del buf  # only the views (and what the engine makes of them) keep it from being reused
            worker, hasher = lanes[i % len(lanes)], hashlib.sha256()

            def on_slice(start: int, end: int, data=data, hasher=hasher, worker=worker) -> None:
                worker.submit(hasher.update, data[start:end])
                hand_over(wait=False)  # the previous bucket, as soon as it is checked

            _recv_slices(conn, data, spec.nbytes, on_slice, f"after {received} of {h.total_bytes} bytes (bucket {i})")
            received += spec.nbytes
            pending.append((i, data, worker.submit(_finish, i, data, hasher, spec.sha256, per_bucket[i])))
            del data, on_slice
        last = pending.pop() if pending else None
        hand_over(wait=True)
        _expect_eof(conn, h.total_bytes)
        if last is not None:
            i, data, fut = last
            feed.put(VerifiedBucket(i, data, fut.result()))
        feed.end()
        return received
    except BaseException as err:
        feed.end(err)
        raise
    finally:
        pending.clear()
        for lane in lanes:
            lane.shutdown(wait=True, cancel_futures=True)
        with lock:  # what the engine has given back already (the rest: _free_stream_buffers)
            pool.trim(0)


def _receive_buckets(
    conn: socket.socket,
    h: weights_pb2.WeightHeader,
    per_bucket: list,
    buffers: list[bytearray],
    base: Any = None,
    fulls: list[Any] | None = None,
    rebuilt: list[Any] | None = None,
) -> tuple[dict[str, Any], int]:
    """In a thread: the buckets' bytes into ``buffers``, hashed and parsed in other threads as they arrive; then
    EOF. Raises IncompleteUpdate (short data, timeout, reset) or CorruptUpdate (extra bytes, digests, content).
    A delta bucket is rebuilt on ``base`` and checked as the full bucket (:func:`finish_delta_bucket`); ``fulls``
    gets each bucket as served."""
    fulls = fulls if fulls is not None else [None] * len(buffers)
    rebuilt = rebuilt if rebuilt is not None else [None] * len(buffers)
    # sha256 on one core is slower than the loopback copy (docs/benchmarks.md, weight sync): one thread falls behind
    # and finishes its backlog alone after the last byte. Buckets alternate between HASH_LANES single-thread lanes
    # (each bucket's slices stay in order on its lane), so the next bucket is hashed while the previous one's backlog
    # drains.
    lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-verify") for _ in range(HASH_LANES)]
    finishing: list[Future] = []
    received = 0
    try:
        for i, (spec, buf) in enumerate(zip(h.buckets, buffers, strict=True)):
            worker = lanes[i % len(lanes)]
            view = memoryview(buf)
            hasher = hashlib.sha256()

            def on_slice(start: int, end: int, view=view, worker=worker, hasher=hasher) -> None:
                worker.submit(hasher.update, view[start:end])
                for f in finishing:  # refuse a corrupt bucket as soon as it is known
                    if f.done():
                        f.result()

            where = f"after {received} of {h.total_bytes} bytes (bucket {i})"
            _recv_slices(conn, view, spec.nbytes, on_slice, where)
            received += spec.nbytes
            out, rebuilt[i] = rebuilt[i], None
            finishing.append(worker.submit(_finish_any, i, buf, hasher, spec, per_bucket[i], base, fulls, out))
            del out
        _expect_eof(conn, h.total_bytes)
        tensors: dict[str, Any] = {}
        for f in finishing:
            tensors.update(f.result())
        return tensors, received
    finally:
        for lane in lanes:  # nothing refers to the buffers once this returns
            lane.shutdown(wait=True, cancel_futures=True)


def _finish(i: int, buf: bytearray, hasher: Any, sha256: str, manifest: Any) -> dict[str, Any]:
    return finish_bucket(i, buf, hasher.hexdigest(), sha256, manifest)


def _finish_any(
    i: int, buf: bytearray, hasher: Any, spec: Any, manifest: Any, base: Any, fulls: list, out: Any
) -> dict[str, Any]:
    if spec.encoding:
        tensors, fulls[i] = finish_delta_bucket(i, buf, hasher.hexdigest(), spec, manifest, base, out)
        return tensors
    fulls[i] = buf
    return finish_bucket(i, buf, hasher.hexdigest(), spec.sha256, manifest)


# ------------------------------------------------------------------------------------------------------ client


def send_buckets(
    host: str, port: int, ticket: bytes, buckets: Iterable[bytes | memoryview], timeout: float | None
) -> None:
    """Blocking (run it in a thread): connect, send the ticket and every bucket (memoryviews, no copy), close.
    ``buckets`` may be made as they are asked for (a streamed push). ``timeout``: the whole send, connection
    included."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if _SOCKET_BUFFER:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
        s.sendall(ticket)
        for b in buckets:
            view = memoryview(b)
            for off in range(0, len(view), SEND_CHUNK_BYTES):  # the deadline, checked between sendall calls
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError("weights data connection: deadline exceeded")
                    s.settimeout(left)
                s.sendall(view[off : off + SEND_CHUNK_BYTES])
        s.shutdown(socket.SHUT_WR)  # end of data: the replica checks that nothing follows
