"""The trainer's side of weight sync: push one packed update to one replica or to many.

Control always goes over authenticated gRPC (``authorization: Bearer <token>``); the bytes take the transport the
caller picks (:data:`TRANSPORTS`): the replica's TCP data plane (``OpenWeightsTransfer``, the buckets on one plain
TCP connection, ``CommitWeights``), or the ``UpdateWeights`` stream of pre-serialised messages. A refusal comes back
as ``grpc.aio.AioRpcError`` with the code of its error class (``rlhf.serving.errors``' table).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import torch

from rlhf.transport.weights.dataplane import send_buckets
from rlhf.transport.weights.format import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    MiB,
    PackedWeights,
    pack_weights,
)
from rlhf.v1 import weights_pb2

UPDATE_WEIGHTS_METHOD = "/rlhf.v1.RolloutService/UpdateWeights"
OPEN_TRANSFER_METHOD = "/rlhf.v1.RolloutService/OpenWeightsTransfer"
COMMIT_WEIGHTS_METHOD = "/rlhf.v1.RolloutService/CommitWeights"
ABORT_TRANSFER_METHOD = "/rlhf.v1.RolloutService/AbortWeightsTransfer"
TRANSPORTS = ("auto", "grpc", "tcp", "collective")  # collective: push_weights_many / push_collective only


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
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    if transport == "collective":
        if not isinstance(weights, PackedWeights):
            weights = await asyncio.to_thread(pack_weights, weights, version, parent_version, bucket_bytes=bucket_bytes)
        result = (await push_collective([target], weights, token=token, timeout=timeout, tls=tls, options=options))[
            target
        ]
        if isinstance(result, BaseException):
            raise result
        return result
    if isinstance(weights, PackedWeights):
        if version is not None and version != weights.version:
            raise ValueError(f"version {version} disagrees with the packed weights' version {weights.version}")
        if parent_version is not None and parent_version != weights.header.parent_version:
            raise ValueError("parent_version disagrees with the packed weights")
        packed = weights
    else:
        if version is None:
            raise ValueError("version is required when pushing a state dict")
        packed = await asyncio.to_thread(pack_weights, weights, version, parent_version, bucket_bytes=bucket_bytes)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    own = channel is None
    if own:
        opts = [("grpc.max_send_message_length", chunk_bytes + MiB), *options]
        creds = _credentials(tls)
        channel = (
            grpc.aio.secure_channel(target, creds, options=opts)
            if creds is not None
            else grpc.aio.insecure_channel(target, options=opts)
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        if transport != "grpc":
            resp = await _push_over_data_plane(channel, target, packed, deadline, metadata, required=transport == "tcp")
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
    finally:
        if own:
            await channel.close()


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
    packed: PackedWeights,
    deadline: float | None,
    metadata: Any,
    *,
    required: bool,
) -> weights_pb2.UpdateWeightsResponse | None:
    """Open, send the buckets on the data port, commit. None: the replica has no data plane (and not ``required``)."""
    open_call = channel.unary_unary(
        OPEN_TRANSFER_METHOD,
        request_serializer=weights_pb2.OpenWeightsTransferRequest.SerializeToString,
        response_deserializer=weights_pb2.OpenWeightsTransferResponse.FromString,
    )
    try:
        opened = await open_call(
            weights_pb2.OpenWeightsTransferRequest(header=packed.header), timeout=_left(deadline), metadata=metadata
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
        await asyncio.to_thread(send_buckets, host, opened.data_port, opened.ticket, packed.buckets, _left(deadline))
    except Exception as err:
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


def _channel(target: str, tls: Any, options: Sequence[tuple[str, Any]], name: str | None) -> grpc.aio.Channel:
    opts = [("grpc.max_send_message_length", 64 * MiB), *options]
    if name is not None:
        opts.append(("grpc.ssl_target_name_override", name))
    creds = _credentials(tls)
    if creds is not None:
        return grpc.aio.secure_channel(target, creds, options=opts)
    return grpc.aio.insecure_channel(target, options=opts)


async def push_collective(
    targets: Iterable[str],
    packed: PackedWeights,
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
    group with the trainer as rank 0; the buckets are broadcast; each is committed. When the broadcast fails (a
    member died or hung: within ``group_timeout_s``), every ticket is aborted, so the survivors keep serving their
    version and free their slot at once, and every member's entry is the error; the next push forms a new group.
    ``group_address``: where replicas reach this process (default: the local address on the route to the first).
    ``backend``/``device``: the group's backend and where the buckets go before the broadcast
    (:func:`~rlhf.transport.weights.collective.trainer_backend`); a replica that cannot run it refuses Open."""
    from rlhf.transport.weights.collective import TrainerGroup, local_address_towards

    targets = list(targets)
    out: dict[str, weights_pb2.UpdateWeightsResponse | BaseException] = {}
    if not targets:
        return out
    deadline = None if timeout is None else time.monotonic() + timeout
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    address = group_address or local_address_towards(_host_of(targets[0]))
    group = await asyncio.to_thread(TrainerGroup, address, group_timeout_s, backend, device)
    channels = {t: _channel(t, tls, options, (server_names or {}).get(t)) for t in targets}
    try:

        async def open_one(target: str) -> weights_pb2.OpenWeightsTransferResponse:
            call = channels[target].unary_unary(
                OPEN_TRANSFER_METHOD,
                request_serializer=weights_pb2.OpenWeightsTransferRequest.SerializeToString,
                response_deserializer=weights_pb2.OpenWeightsTransferResponse.FromString,
            )
            req = weights_pb2.OpenWeightsTransferRequest(header=packed.header, group=group.spec.to_proto())
            return await call(req, timeout=_left(deadline), metadata=metadata)

        opened = await asyncio.gather(*(open_one(t) for t in targets), return_exceptions=True)
        members = []
        for target, res in zip(targets, opened, strict=True):
            if isinstance(res, BaseException):
                out[target] = res  # refused (stale, busy, down): not in this push's group
            else:
                members.append((target, res.ticket))
        if not members:
            return out
        world = group.admit([ticket for _, ticket in members])

        async def commit_one(target: str, ticket: bytes) -> weights_pb2.UpdateWeightsResponse:
            call = channels[target].unary_unary(
                COMMIT_WEIGHTS_METHOD,
                request_serializer=weights_pb2.CommitWeightsRequest.SerializeToString,
                response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
            )
            return await call(weights_pb2.CommitWeightsRequest(ticket=ticket), timeout=_left(deadline),
                              metadata=metadata)  # fmt: skip

        # the commits wait on the replicas until their data is verified and swapped: sent with the data
        commits = [asyncio.ensure_future(commit_one(t, k)) for t, k in members]
        try:
            await asyncio.to_thread(group.broadcast, world, packed.buckets)
        except BaseException as err:
            await asyncio.shield(asyncio.gather(*(_abort(channels[t], k, metadata) for t, k in members)))
            for c in commits:
                c.cancel()
            failure = err if isinstance(err, Exception) else RuntimeError("collective push cancelled")
            for t, _ in members:
                out[t] = RuntimeError(f"collective broadcast of version {packed.version} failed: {failure}")
            if not isinstance(err, Exception):
                raise
            return out
        results = await asyncio.gather(*commits, return_exceptions=True)
        for (t, _), res in zip(members, results, strict=True):
            out[t] = res
        return out
    finally:
        group.close()
        await asyncio.gather(*(c.close() for c in channels.values()), return_exceptions=True)
