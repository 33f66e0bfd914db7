"""The trainer's side of weight sync: push one update to one replica or to many.

Control always goes over authenticated gRPC; the bytes take the transport the caller picks (:data:`TRANSPORTS`):
the replica's TCP data plane, the ``UpdateWeights`` stream or a collective broadcast. The update is packed
(:class:`~rlhf.transport.weights.pack.PackedWeights`) or streamed (:func:`push_weights_streamed`, a sharded trainer's
push); the wire is the same. A refusal comes back as ``grpc.aio.AioRpcError`` with its error class's code.

Design: docs/weight-sync.md#transports-rlhf_weights_transport-on-the-trainer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from rlhf.transport.weights.collective import MAX_RANKS_PER_REPLICA, TrainerGroup, local_address_towards
from rlhf.transport.weights.dataplane import send_buckets
from rlhf.transport.weights.errors import refusal_type
from rlhf.transport.weights.format import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    MiB,
    encode_chunk,
)
from rlhf.transport.weights.pack import PackedWeights, StreamedWeights, pack_weights
from rlhf.v1 import weights_pb2

UPDATE_WEIGHTS_METHOD = "/rlhf.v1.RolloutService/UpdateWeights"
OPEN_TRANSFER_METHOD = "/rlhf.v1.RolloutService/OpenWeightsTransfer"
COMMIT_WEIGHTS_METHOD = "/rlhf.v1.RolloutService/CommitWeights"
ABORT_TRANSFER_METHOD = "/rlhf.v1.RolloutService/AbortWeightsTransfer"
TRANSPORTS = ("auto", "grpc", "tcp", "collective")  # collective: push_weights_many / push_collective only
log = logging.getLogger("rlhf.transport.weights.send")


def _credentials(tls: bool | str | Path | bytes | grpc.ChannelCredentials) -> grpc.ChannelCredentials | None:
    if tls is False or tls is None:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    roots = tls if isinstance(tls, bytes) else Path(tls).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=roots)


async def push_weights(
    target: str,
    weights: Mapping[str, torch.Tensor] | PackedWeights,
    version: int | None = None,
    parent_version: int | None = None,
    *,
    token: str | None = None,
    timeout: float | None = 600.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    tls: bool | str | Path | bytes | grpc.ChannelCredentials = False,
    channel: grpc.aio.Channel | None = None,
    options: Sequence[tuple[str, Any]] = (),
    transport: str = "auto",
    delta: PackedWeights | None = None,
) -> weights_pb2.UpdateWeightsResponse:
    """Send weights to one replica and return its ``UpdateWeightsResponse``.

    ``transport``: ``"tcp"``, the raw-TCP data plane (``OpenWeightsTransfer``, the buckets on the replica's data
    port at ``target``'s host, ``CommitWeights``; :mod:`rlhf.transport.weights.dataplane`); ``"grpc"``, the
    ``UpdateWeights`` stream; ``"auto"`` (default), the data plane when the replica offers one (Open answers a port),
    else the stream (a replica without the data plane, or UNIMPLEMENTED from an older one). ``"tcp"`` against a
    replica without it raises ``RuntimeError``. The data connection goes to ``target``'s host: name one replica
    (an address, or a name that resolves to one; the trainer expands service names to one address per replica).
    A data port the client cannot reach fails the push, and the replica frees the update after its ticket's ttl.

    ``weights``: a state dict (then ``version`` is required; it is packed in a worker thread) or a
    :class:`PackedWeights` (``version``/``parent_version`` must then be None or agree with it). ``token`` goes out
    as ``authorization: Bearer <token>``. ``tls``: False (plaintext), True (system roots), a CA bundle path or
    bytes, or ready ``grpc.ChannelCredentials``. ``channel``: reuse an open channel (``target``/``tls``/``options``
    are then ignored). A refusal comes back as ``grpc.aio.AioRpcError`` (see the module docstring for the codes);
    ``timeout`` bounds the whole update.

    ``delta``: the same update as a delta against the base the replica should hold
    (:func:`~rlhf.transport.weights.delta.make_delta`), tried first over ``transport`` (not collective); when the
    replica holds another base (``DeltaBaseMissing``, at Open: no byte sent) or the rebuilt update fails its digests
    (``CorruptUpdate``: nothing swapped), ``weights`` goes in full.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    if delta is not None and transport != "collective":
        again = functools.partial(
            push_weights,
            target,
            token=token,
            timeout=timeout,
            chunk_bytes=chunk_bytes,
            bucket_bytes=bucket_bytes,
            tls=tls,
            channel=channel,
            options=options,
            transport=transport,
        )
        return await _delta_then_full(again, target, delta, weights, version, parent_version)
    if transport == "collective":
        if not isinstance(weights, PackedWeights):
            weights = await asyncio.to_thread(pack_weights, weights, version, parent_version, bucket_bytes=bucket_bytes)
        result = (await push_collective([target], weights, token=token, timeout=timeout, tls=tls, options=options))[
            target
        ]
        if isinstance(result, BaseException):
            raise result
        return result
    packed = await _host_packed(weights, version, parent_version, bucket_bytes, transport)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    if channel is not None:
        return await _push_packed(channel, target, packed, timeout, chunk_bytes, metadata, transport)
    channel = _channel(target, tls, options, None, max_send=chunk_bytes + MiB)
    try:
        return await _push_packed(channel, target, packed, timeout, chunk_bytes, metadata, transport)
    finally:
        await channel.close()


async def _delta_then_full(
    again: Callable[..., Awaitable[weights_pb2.UpdateWeightsResponse]],
    target: str,
    delta: PackedWeights,
    weights: Mapping[str, torch.Tensor] | PackedWeights,
    version: int | None,
    parent_version: int | None,
) -> weights_pb2.UpdateWeightsResponse:
    """``again(delta)``; when the replica refuses it because it holds another base (DeltaBaseMissing) or the
    rebuilt update fails its digests (CorruptUpdate), ``again(weights, version, parent_version)``: the update in
    full. Any other refusal raises."""
    try:
        return await again(delta)
    except grpc.aio.AioRpcError as err:
        kind = refusal_type(err)
        if kind not in ("DeltaBaseMissing", "CorruptUpdate"):
            raise
        say = log.debug if kind == "DeltaBaseMissing" else log.warning
        say(
            "delta push of version %d to %s refused (%s: %s): pushing it in full",
            delta.version,
            target,
            kind,
            err.details(),
        )
    return await again(weights, version, parent_version)


async def _host_packed(
    weights: Mapping[str, torch.Tensor] | PackedWeights,
    version: int | None,
    parent_version: int | None,
    bucket_bytes: int,
    transport: str,
) -> PackedWeights:
    """``weights`` as host buckets for the data plane or the stream: a state dict packed in a worker thread, or
    packed weights checked against ``version`` / ``parent_version`` (and to be on the host)."""
    if not isinstance(weights, PackedWeights):
        if version is None:
            raise ValueError("version is required when pushing a state dict")
        return await asyncio.to_thread(pack_weights, weights, version, parent_version, bucket_bytes=bucket_bytes)
    if weights.on_device:
        raise ValueError(
            f"weights packed on a device go by collective broadcast only; transport {transport!r} sends host "
            "buckets (copy_weights without device=)"
        )
    if version is not None and version != weights.version:
        raise ValueError(f"version {version} disagrees with the packed weights' version {weights.version}")
    if parent_version is not None and parent_version != weights.header.parent_version:
        raise ValueError("parent_version disagrees with the packed weights")
    return weights


async def _push_packed(
    channel: grpc.aio.Channel,
    target: str,
    packed: PackedWeights,
    timeout: float | None,
    chunk_bytes: int,
    metadata: Any,
    transport: str,
) -> weights_pb2.UpdateWeightsResponse:
    """``packed`` to the replica behind ``channel``: over its data plane unless ``transport`` is ``"grpc"``, else
    (or when it has none and ``transport`` is ``"auto"``) as the ``UpdateWeights`` stream."""
    deadline = None if timeout is None else time.monotonic() + timeout
    if transport != "grpc":
        resp = await _push_over_data_plane(
            channel, target, packed.header, packed.buckets, deadline, metadata, required=transport == "tcp"
        )
        if resp is not None:
            return resp
    # Messages go out pre-serialised (PackedWeights.encoded_updates): the stub's serializer would build and
    # encode a protobuf message per chunk, the largest cost of the sender in Python.
    call = channel.stream_unary(
        UPDATE_WEIGHTS_METHOD,
        request_serializer=None,
        response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
    )
    return await call(packed.encoded_updates(chunk_bytes), timeout=_left(deadline), metadata=metadata)


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("push_weights: deadline exceeded")
    return left


def _host_of(target: str) -> str:
    """The host of a gRPC target (``host:port``, ``[v6]:port``, ``dns:///host:port``, ``ipv4:host:port``)."""
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target[len(prefix) :]
            break
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    return host.strip("[]")


async def _push_over_data_plane(
    channel: grpc.aio.Channel,
    target: str,
    header: weights_pb2.WeightHeader,
    buckets: Iterable[bytes | memoryview],
    deadline: float | None,
    metadata: Any,
    *,
    required: bool,
    executor: Executor | None = None,
) -> weights_pb2.UpdateWeightsResponse | None:
    """Open, send the buckets on the data port, commit. None: the replica has no data plane (and not ``required``).
    The send runs in a thread of ``executor`` (default: asyncio's)."""
    open_call = channel.unary_unary(
        OPEN_TRANSFER_METHOD,
        request_serializer=weights_pb2.OpenWeightsTransferRequest.SerializeToString,
        response_deserializer=weights_pb2.OpenWeightsTransferResponse.FromString,
    )
    try:
        opened = await open_call(
            weights_pb2.OpenWeightsTransferRequest(header=header), timeout=_left(deadline), metadata=metadata
        )
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED and not required:
            return None  # a replica from before the data plane
        raise
    if not opened.data_port:
        if required:
            raise RuntimeError(f"{target} offers no weights data port (RLHF_WEIGHTS_DATA_PORT unset, or TLS)")
        return None
    commit_call = channel.unary_unary(
        COMMIT_WEIGHTS_METHOD,
        request_serializer=weights_pb2.CommitWeightsRequest.SerializeToString,
        response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
    )
    host = _host_of(target)
    # The commit goes out with the data (it waits on the replica until every byte is verified): its answer comes
    # back as soon as the swap is done, without a round trip after the send.
    commit = asyncio.ensure_future(
        commit_call(weights_pb2.CommitWeightsRequest(ticket=opened.ticket), timeout=_left(deadline), metadata=metadata)
    )
    try:
        send = functools.partial(send_buckets, host, opened.data_port, opened.ticket, buckets, _left(deadline))
        await asyncio.get_running_loop().run_in_executor(executor, send)
    except Exception as err:  # noqa: BLE001 - any failure of the data plane frees the slot, then reports
        # Free the replica's update slot now rather than at its ticket's expiry, then report the replica's answer
        # (it says more: short data is IncompleteUpdate) when it comes quickly, else the connection error.
        await _abort(channel, opened.ticket, metadata)
        try:
            return await asyncio.wait_for(asyncio.shield(commit), timeout=5.0)
        except TimeoutError:
            commit.cancel()
            raise err from None
    except BaseException:  # cancelled (the caller's timeout, shutdown): the replica must not wait for the ttl
        commit.cancel()
        await asyncio.shield(_abort(channel, opened.ticket, metadata))
        raise
    return await commit


async def _abort(channel: grpc.aio.Channel, ticket: bytes, metadata: Any) -> bool:
    """``AbortWeightsTransfer``, best effort (a replica that cannot be reached expires the ticket itself)."""
    call = channel.unary_unary(
        ABORT_TRANSFER_METHOD,
        request_serializer=weights_pb2.AbortWeightsTransferRequest.SerializeToString,
        response_deserializer=weights_pb2.AbortWeightsTransferResponse.FromString,
    )
    try:
        return (
            await call(weights_pb2.AbortWeightsTransferRequest(ticket=ticket), timeout=5.0, metadata=metadata)
        ).aborted
    except (grpc.aio.AioRpcError, grpc.aio.UsageError):
        return False


async def push_weights_many(
    targets: Iterable[str],
    packed: PackedWeights,
    *,
    server_names: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> dict[str, weights_pb2.UpdateWeightsResponse | BaseException]:
    """:func:`push_weights` of one packed update to several replicas concurrently; per target the response or
    the exception (a failed replica does not stop the others). ``server_names``: per target, the name its TLS
    certificate is checked against when that is not the target's host (a service name the caller resolved to one
    address per replica: the certificate names the service, not the pod's address)."""
    targets = list(targets)

    def one(target: str):
        name = (server_names or {}).get(target)
        if name is None:
            return push_weights(target, packed, **kwargs)
        options = [*kwargs.get("options", ()), ("grpc.ssl_target_name_override", name)]
        return push_weights(target, packed, **{**kwargs, "options": options})

    if kwargs.get("transport") == "collective":
        return await push_collective(targets, packed, server_names=server_names, **kwargs)
    results = await asyncio.gather(*(one(t) for t in targets), return_exceptions=True)
    return dict(zip(targets, results, strict=True))


def _channel(
    target: str, tls: Any, options: Sequence[tuple[str, Any]], name: str | None, *, max_send: int = 64 * MiB
) -> grpc.aio.Channel:
    """A channel to ``target``: TLS as ``tls`` says (:func:`_credentials`), ``name`` the name its certificate is
    checked against when that is not the target's host."""
    opts = [("grpc.max_send_message_length", max_send), *options]
    if name is not None:
        opts.append(("grpc.ssl_target_name_override", name))
    creds = _credentials(tls)
    if creds is not None:
        return grpc.aio.secure_channel(target, creds, options=opts)
    return grpc.aio.insecure_channel(target, options=opts)


async def push_collective(
    targets: Iterable[str],
    packed: PackedWeights | StreamedWeights,
    *,
    token: str | None = None,
    timeout: float | None = 600.0,
    tls: bool | str | Path | bytes | grpc.ChannelCredentials = False,
    options: Sequence[tuple[str, Any]] = (),
    server_names: Mapping[str, str] | None = None,
    group_address: str | None = None,
    group_timeout_s: float = 60.0,
    backend: str = "gloo",
    device: Any = None,
    **_: Any,
) -> dict[str, weights_pb2.UpdateWeightsResponse | BaseException]:
    """One update to every replica at once by collective broadcast (:mod:`rlhf.transport.weights.collective`);
    per target its response or exception. Open goes to every target; those that answer a ticket form this push's
    group with the trainer as rank 0 (a replica that receives in several processes, vLLM's workers under tensor
    parallelism, says how many at Open and gets as many ranks); the buckets are broadcast; each is committed. When
    the broadcast fails (a member died or hung, or never joined: each step of the broadcast is bounded by
    ``group_timeout_s``, the group's formation included, whatever the backend), every ticket is aborted, so the
    survivors keep serving their version and free their slot at once, and every member's entry is the error; the
    next push forms a new group.
    ``group_address``: where replicas reach this process (default: the local address on the route to the first).
    ``backend``/``device``: the group's backend and where the buckets go before the broadcast
    (:func:`~rlhf.transport.weights.collective.trainer_backend`); a replica that cannot run it refuses Open.
    Streamed weights must be sealed; the broadcast makes each bucket as it goes (one consumer, the group)."""
    targets = list(targets)
    out: dict[str, weights_pb2.UpdateWeightsResponse | BaseException] = {}
    if not targets:
        return out
    deadline = None if timeout is None else time.monotonic() + timeout
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    address = group_address or local_address_towards(_host_of(targets[0]))
    group = await asyncio.to_thread(TrainerGroup, address, group_timeout_s, backend, device)
    channels = {t: _channel(t, tls, options, (server_names or {}).get(t)) for t in targets}
    calls = _GroupCalls(channels, deadline, metadata)
    try:
        members = await calls.open_members(targets, packed.header, group, out)
        if members:
            await _broadcast_and_commit(calls, members, group, packed, out)
        return out
    finally:
        group.close()
        await asyncio.gather(*(c.close() for c in channels.values()), return_exceptions=True)


@dataclass(frozen=True)
class _Member:
    """A replica in a collective push's group: its transfer ticket and how many ranks it receives with."""

    target: str
    ticket: bytes
    ranks: int


@dataclass(frozen=True)
class _GroupCalls:
    """The control calls of one collective push, each on its target's channel, under the push's deadline."""

    channels: Mapping[str, grpc.aio.Channel]
    deadline: float | None
    metadata: Any

    async def open(
        self, target: str, header: weights_pb2.WeightHeader, group: TrainerGroup
    ) -> weights_pb2.OpenWeightsTransferResponse:
        call = self.channels[target].unary_unary(
            OPEN_TRANSFER_METHOD,
            request_serializer=weights_pb2.OpenWeightsTransferRequest.SerializeToString,
            response_deserializer=weights_pb2.OpenWeightsTransferResponse.FromString,
        )
        req = weights_pb2.OpenWeightsTransferRequest(header=header, group=group.spec.to_proto())
        return await call(req, timeout=_left(self.deadline), metadata=self.metadata)

    async def open_members(
        self,
        targets: list[str],
        header: weights_pb2.WeightHeader,
        group: TrainerGroup,
        out: dict[str, weights_pb2.UpdateWeightsResponse | BaseException],
    ) -> list[_Member]:
        """Open every target with ``group``: those that answer a ticket are its members; the others get their error
        in ``out`` (refused: stale, busy, down; or asking for more ranks than a replica may have)."""
        opened = await asyncio.gather(*(self.open(t, header, group) for t in targets), return_exceptions=True)
        members = []
        for target, res in zip(targets, opened, strict=True):
            if isinstance(res, BaseException):
                out[target] = res  # refused (stale, busy, down): not in this push's group
            elif res.ranks > MAX_RANKS_PER_REPLICA:
                out[target] = RuntimeError(
                    f"{target} would join the weight group with {res.ranks} ranks (at most "
                    f"{MAX_RANKS_PER_REPLICA}); left out of this push"
                )
                await self.abort(target, res.ticket)
            else:  # ranks 0: a replica from before the field, one rank
                members.append(_Member(target, res.ticket, max(1, res.ranks)))
        return members

    async def commit(self, target: str, ticket: bytes) -> weights_pb2.UpdateWeightsResponse:
        call = self.channels[target].unary_unary(
            COMMIT_WEIGHTS_METHOD,
            request_serializer=weights_pb2.CommitWeightsRequest.SerializeToString,
            response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
        )
        req = weights_pb2.CommitWeightsRequest(ticket=ticket)
        return await call(req, timeout=_left(self.deadline), metadata=self.metadata)

    async def abort(self, target: str, ticket: bytes) -> bool:
        return await _abort(self.channels[target], ticket, self.metadata)


async def _broadcast_and_commit(
    calls: _GroupCalls,
    members: list[_Member],
    group: TrainerGroup,
    packed: PackedWeights | StreamedWeights,
    out: dict[str, weights_pb2.UpdateWeightsResponse | BaseException],
) -> None:
    """Admit ``members`` to ``group``, broadcast the buckets and commit each member; its answer goes to ``out``.
    When the broadcast fails, every ticket is aborted and every member's entry is the error (cancelled: raises)."""
    world = group.admit([m.ticket for m in members], [m.ranks for m in members])
    # the commits wait on the replicas until their data is verified and swapped: sent with the data
    commits = [asyncio.ensure_future(calls.commit(m.target, m.ticket)) for m in members]
    try:
        # in a thread of the group's own, under its watchdog: the future fails when a step overruns the group
        # timeout even if the blocked call never returns (NCCL's lazy communicator init, pytorch#88103)
        await asyncio.wrap_future(group.run(functools.partial(_broadcast, group, world, packed)))
    except BaseException as err:
        await asyncio.shield(asyncio.gather(*(calls.abort(m.target, m.ticket) for m in members)))
        for c in commits:
            c.cancel()
        failure = err if isinstance(err, Exception) else RuntimeError("collective push cancelled")
        for m in members:
            out[m.target] = RuntimeError(f"collective broadcast of version {packed.version} failed: {failure}")
        if not isinstance(err, Exception):
            raise
        return
    results = await asyncio.gather(*commits, return_exceptions=True)
    for m, res in zip(members, results, strict=True):
        out[m.target] = res


def _broadcast(group: Any, world: int, weights: PackedWeights | StreamedWeights) -> None:
    if isinstance(weights, PackedWeights):
        group.broadcast(world, weights.buckets)
        return
    buckets = weights.buckets()
    try:
        group.broadcast(world, buckets)
    finally:
        buckets.close()  # cut short: the source drains itself (a trainer group's followers gather every parameter)


# ------------------------------------------------------------------------------------------------------ streamed


class _Fanout:
    """One producer, several consumers of the same buckets: bucket i is made once and handed to every consumer;
    bucket i + 1 is made only when every live consumer has finished bucket i (the buckets share one buffer). A
    consumer that leaves (its replica failed) holds no one back. Thread-safe; consumers and producer block."""

    def __init__(self, n: int):
        self._cv = threading.Condition()
        self._live = set(range(n))
        self._taken = [-1] * n  # the last bucket each consumer took
        self._busy = [False] * n  # still sending it (until it asks for the next)
        self._index = -1
        self._data: memoryview | None = None
        self._end = False
        self._error: BaseException | None = None

    def _idle(self) -> bool:
        return all(self._taken[k] == self._index and not self._busy[k] for k in self._live)

    def wait_idle(self) -> bool:
        """Producer: wait until every live consumer has finished the last bucket; False when none is left."""
        with self._cv:
            self._cv.wait_for(self._idle)
            return bool(self._live)

    def publish(self, data: memoryview) -> None:
        with self._cv:
            self._index += 1
            self._data = data
            self._cv.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cv:
            self._end, self._error, self._data = True, error, None
            self._cv.notify_all()

    def take(self, k: int) -> tuple[int, memoryview] | None:
        """Consumer ``k``, done with its last bucket: the next one (index, bytes), or None after the last. Raises
        when the producer failed or ``k`` has left."""
        with self._cv:
            self._busy[k] = False
            self._cv.notify_all()
            self._cv.wait_for(lambda: k not in self._live or self._taken[k] < self._index or self._end)
            if k not in self._live:
                raise RuntimeError("this replica's send was stopped")
            if self._error is not None:
                raise RuntimeError(f"making the weights failed ({type(self._error).__name__}: {self._error})")
            if self._taken[k] < self._index:
                self._taken[k], self._busy[k] = self._index, True
                return self._index, self._data  # type: ignore[return-value]
            return None

    def leave(self, k: int) -> None:
        with self._cv:
            self._live.discard(k)
            self._cv.notify_all()

    def consume(self, k: int) -> Iterator[memoryview]:
        """Consumer ``k``'s buckets as an iterator (for :func:`~rlhf.transport.weights.dataplane.send_buckets`)."""
        while (item := self.take(k)) is not None:
            yield item[1]


def _produce(stream: StreamedWeights, fanout: _Fanout) -> None:
    """The producer thread: pass 2 of ``stream``, one bucket at a time, while any consumer is left."""
    buckets = stream.buckets()
    error: BaseException | None = None
    try:
        while fanout.wait_idle():
            data = next(buckets, None)
            if data is None:
                break
            fanout.publish(data)
    except BaseException as err:
        error = err
        raise
    finally:
        fanout.finish(error)
        buckets.close()  # stopped early (no replica left): the source drains itself


async def _encoded_stream(
    header: weights_pb2.WeightHeader, fanout: _Fanout, k: int, chunk_bytes: int, executor: Executor
) -> AsyncIterator[bytes]:
    """Consumer ``k``'s ``UpdateWeights`` messages, pre-serialised (as :meth:`PackedWeights.encoded_updates`); each
    chunk is a copy, so the bucket is free for the next as soon as its last chunk is out."""
    loop = asyncio.get_running_loop()
    yield weights_pb2.WeightUpdate(header=header).SerializeToString()
    while (item := await loop.run_in_executor(executor, fanout.take, k)) is not None:
        index, data = item
        for off in range(0, len(data), chunk_bytes):
            yield encode_chunk(index, off, data[off : off + chunk_bytes])


async def push_weights_streamed(
    targets: Iterable[str],
    stream: StreamedWeights,
    *,
    token: str | None = None,
    timeout: float | None = 600.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    tls: bool | str | Path | bytes | grpc.ChannelCredentials = False,
    options: Sequence[tuple[str, Any]] = (),
    server_names: Mapping[str, str] | None = None,
    transport: str = "auto",
    **collective: Any,
) -> dict[str, weights_pb2.UpdateWeightsResponse | BaseException]:
    """:func:`push_weights_many` of streamed weights: a sharded trainer's push, which never holds the whole model.

    Seals ``stream`` (pass 1: every bucket made and hashed, for the header; its errors, such as non-finite
    weights, raise here before any replica is contacted), opens every target, then makes each bucket once more
    and hands it to every target's sender (pass 2): bucket i + 1 is made when every live sender has sent bucket i,
    so the push holds one bucket at a time (plus one tensor). Per target the response or the exception; a failed
    target drops out without stopping the others. ``transport`` and the other arguments are
    :func:`push_weights`'s (``collective``: one broadcast to every target, :func:`push_collective`, whose keyword
    arguments ``collective`` passes on). An error of pass 2's source (the trainer's gather) raises after every
    target has stopped. ``timeout`` bounds the push after pass 1."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    targets = list(targets)
    if not targets:
        return {}
    if not stream.sealed:
        await asyncio.to_thread(stream.seal)
    if transport == "collective":
        return await push_collective(
            targets,
            stream,
            token=token,
            timeout=timeout,
            tls=tls,
            options=options,
            server_names=server_names,
            **collective,
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    fanout = _Fanout(len(targets))
    # Own threads, not asyncio's shared pool: every sender waits on the producer, so a pool smaller than the
    # targets + 1 could run the senders and starve the producer they wait for.
    pool = ThreadPoolExecutor(len(targets) + 1, thread_name_prefix="weights-push")
    channels = [_channel(t, tls, options, (server_names or {}).get(t)) for t in targets]

    async def one(k: int, target: str) -> weights_pb2.UpdateWeightsResponse:
        try:
            if transport != "grpc":
                resp = await _push_over_data_plane(
                    channels[k],
                    target,
                    stream.header,
                    fanout.consume(k),
                    deadline,
                    metadata,
                    required=transport == "tcp",
                    executor=pool,
                )
                if resp is not None:
                    return resp
            call = channels[k].stream_unary(
                UPDATE_WEIGHTS_METHOD,
                request_serializer=None,
                response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
            )
            messages = _encoded_stream(stream.header, fanout, k, chunk_bytes, pool)
            return await call(messages, timeout=_left(deadline), metadata=metadata)
        finally:
            fanout.leave(k)

    producer = asyncio.get_running_loop().run_in_executor(pool, _produce, stream, fanout)
    try:
        results = await asyncio.gather(*(one(k, t) for k, t in enumerate(targets)), return_exceptions=True)
        await producer  # its error (the source failed mid-pass) is the push's
        return dict(zip(targets, results, strict=True))
    finally:
        for k in range(len(targets)):
            fanout.leave(k)  # cancelled: the producer stops making buckets and drains its source
        pool.shutdown(wait=False)
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
