"""Weight sync's raw-TCP data plane (rlhf.transport.weights.dataplane) on loopback, through the rollout service's own
servicer (token check, error table, add_to_server) over a fake engine: round trips, the fallback to the gRPC stream,
and every way a transfer can go wrong leaving the old weights serving and the replica free for the next update."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from dataclasses import dataclass, field

import grpc
import pytest
import torch

import rlhf.transport.weights.send as send_mod
from rlhf.transport.weights import dataplane, manifest_of, pack_weights, push_weights
from rlhf.transport.weights.dataplane import MAX_PENDING_CONNECTIONS, send_buckets
from rlhf.transport.weights.errors import IncompleteUpdate
from rlhf.v1 import rollout_pb2_grpc, weights_pb2
from services.rollout.engine_types import SwapResult
from tests.support.replica import FakeEngine
from tests.support.replica import Replica as _Replica

TOKEN = "dataplane-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 64, generator=g),
        "layer.0.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "layer.0.bias": torch.randn(64, generator=g),
        "big": torch.randn(300, 300, generator=g),  # its own bucket with 64 KiB buckets
        "step": torch.tensor(3),
    }


class Replica(_Replica):
    """The support replica over a FakeEngine (``expected``: the manifest updates must match), its data plane's
    transfers expiring after ``ttl``, with a channel to it for raw Open / Commit calls."""

    def __init__(self, data_plane: bool = True, ttl: float = 10.0, expected=None):
        super().__init__(TOKEN, FakeEngine(manifest=expected), data_plane=data_plane)
        self.ttl = ttl

    async def __aenter__(self) -> Replica:
        await super().__aenter__()
        if self.data_plane:
            self.servicer.data.ttl = self.servicer.data.read_timeout = self.ttl
        self.channel = grpc.aio.insecure_channel(self.addr)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()
        await super().__aexit__(*exc)

    def calls(self, method: str) -> int:
        text = self.servicer.metrics.render()[0].decode()
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("rlhf_requests_total{") and f'method="{method}"' in line
        )

    async def open(self, packed, metadata=AUTH) -> weights_pb2.OpenWeightsTransferResponse:
        call = self.channel.unary_unary(
            "/rlhf.v1.RolloutService/OpenWeightsTransfer",
            request_serializer=weights_pb2.OpenWeightsTransferRequest.SerializeToString,
            response_deserializer=weights_pb2.OpenWeightsTransferResponse.FromString,
        )
        return await call(weights_pb2.OpenWeightsTransferRequest(header=packed.header), metadata=metadata, timeout=30)

    async def commit(self, ticket: bytes, metadata=AUTH) -> weights_pb2.UpdateWeightsResponse:
        call = self.channel.unary_unary(
            "/rlhf.v1.RolloutService/CommitWeights",
            request_serializer=weights_pb2.CommitWeightsRequest.SerializeToString,
            response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
        )
        return await call(weights_pb2.CommitWeightsRequest(ticket=ticket), metadata=metadata, timeout=30)


def pack(version: int, seed: int = 0):
    return pack_weights(state_dict(seed), version, bucket_bytes=64 << 10)


def payload(packed) -> bytes:
    return b"".join(packed.buckets)


async def send_raw(port: int, data: bytes, close: bool = True) -> socket.socket:
    """Connect and send ``data`` (ticket included); returns the socket (closed when ``close``)."""

    def go() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        with contextlib.suppress(OSError):  # the replica closed a refused connection while we were sending
            s.sendall(data)
        if close:
            s.close()
        return s

    return await asyncio.to_thread(go)


async def closed_by_peer(s: socket.socket) -> bool:
    def go() -> bool:
        s.settimeout(10)
        try:
            return s.recv(1) == b""
        except ConnectionResetError:
            return True

    return await asyncio.to_thread(go)


async def refused(coro) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value.code(), info.value.details()


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(
            got[k].view(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8)
        ), k


# ------------------------------------------------------------------------------------------------------ round trips


def test_push_uses_the_data_plane_and_is_bit_identical():
    async def main():
        async with Replica(expected=manifest_of(state_dict())) as r:
            for version in (1, 2, 3):  # the third reuses the first one's buffers (BufferPool)
                sd = state_dict(version)
                resp = await push_weights(r.addr, sd, version, token=TOKEN, bucket_bytes=64 << 10)
                assert resp.swapped and resp.version == version and resp.bytes_received > 0
                assert resp.checksum == r.engine.served.checksum and resp.stage_seconds > 0
                assert_bits(r.engine.tensors, sd)
            assert r.calls("CommitWeights") == 3 and r.calls("UpdateWeights") == 0
            assert not r.servicer.receiver.busy and r.servicer.receiver.current_version == 3
            resp = await push_weights(r.addr, state_dict(9), 4, token=TOKEN, transport="grpc")  # the stream still works
            assert resp.swapped and r.calls("UpdateWeights") == 1
            assert_bits(r.engine.tensors, state_dict(9))

    asyncio.run(main())


def test_buckets_of_many_slices_are_hashed_in_order(monkeypatch):
    """A bucket arrives and is hashed slice by slice (SLICE_BYTES, 16 MiB): with 4 KiB slices, a 64 KiB bucket is
    16 slices and its digest still checks (slices hashed in order on their lane), the weights equal the pushed ones
    bit for bit, whole or installed as they arrive, and a byte flipped in a middle slice is refused."""
    monkeypatch.setattr(dataplane, "SLICE_BYTES", 4 << 10)
    slices, recv_slices = [], dataplane._recv_slices

    def counted(conn, view, nbytes, on_slice, where, slice_bytes=0):
        def each(start, end):
            slices.append(end - start)
            on_slice(start, end)

        recv_slices(conn, view, nbytes, each, where, slice_bytes)

    monkeypatch.setattr(dataplane, "_recv_slices", counted)

    async def main():
        async with Replica() as r:
            for version in (1, 2):
                resp = await push_weights(r.addr, state_dict(version), version, token=TOKEN, bucket_bytes=64 << 10)
                assert resp.swapped and resp.version == version
                assert_bits(r.engine.tensors, state_dict(version))
            assert max(slices) == 4 << 10 and slices.count(4 << 10) >= 16, slices
            packed = pack(3, seed=3)
            big = max(range(len(packed.buckets)), key=lambda i: len(packed.buckets[i]))
            assert len(packed.buckets[big]) >= 16 * dataplane.SLICE_BYTES  # many slices in a bucket
            flipped = bytearray(payload(packed))
            flipped[sum(len(b) for b in packed.buckets[:big]) + 5 * dataplane.SLICE_BYTES + 7] ^= 0xFF  # its 6th slice
            opened = await r.open(packed)
            await send_raw(r.port, opened.ticket + bytes(flipped))
            code, details = await refused(r.commit(opened.ticket))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "sha256" in details and f"bucket {big}" in details
            assert r.engine.served.version == 2

            r.engine = StreamingEngine(served=r.engine.served, pool=r.servicer.data._stream_pool)
            r.servicer.engine = r.engine
            resp = await push_weights(r.addr, packed, token=TOKEN, transport="tcp")
            assert resp.swapped and r.engine.installed == list(range(len(packed.buckets)))
            assert_bits(r.engine.tensors, state_dict(3))

    asyncio.run(main())


def test_auto_falls_back_to_the_grpc_stream():
    async def main():
        async with Replica(data_plane=False) as r:  # RLHF_WEIGHTS_DATA_PORT unset: Open answers port 0
            resp = await push_weights(r.addr, state_dict(), 1, token=TOKEN)
            assert resp.swapped and r.calls("UpdateWeights") == 1 and r.calls("CommitWeights") == 0
            with pytest.raises(RuntimeError, match="no weights data port"):
                await push_weights(r.addr, state_dict(), 2, token=TOKEN, transport="tcp")
            assert not r.servicer.receiver.busy

        class Old(rollout_pb2_grpc.RolloutServiceServicer):  # a replica from before the data plane
            async def UpdateWeights(self, request_iterator, context):
                n = sum([len(m.chunk.data) async for m in request_iterator])
                return weights_pb2.UpdateWeightsResponse(version=1, swapped=True, bytes_received=n)

        server = grpc.aio.server()
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(Old(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            packed = pack(1)
            resp = await push_weights(f"127.0.0.1:{port}", packed)
            assert resp.swapped and resp.bytes_received == packed.total_bytes
            code, _ = await refused(push_weights(f"127.0.0.1:{port}", packed, transport="tcp"))
            assert code == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop(None)
        with pytest.raises(ValueError):
            await push_weights(f"127.0.0.1:{port}", packed, transport="udp")

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------------ refusals


def test_open_checks_the_header_like_the_stream_and_the_token():
    async def main():
        async with Replica(expected=manifest_of(state_dict())) as r:
            r.servicer.receiver.max_total_bytes = 10 << 20
            assert (await refused(r.open(pack(1), metadata=None)))[0] == grpc.StatusCode.UNAUTHENTICATED
            bad = (("authorization", "Bearer wrong"),)
            assert (await refused(r.open(pack(1), metadata=bad)))[0] == grpc.StatusCode.UNAUTHENTICATED
            assert (await refused(r.commit(b"x" * 32, metadata=None)))[0] == grpc.StatusCode.UNAUTHENTICATED
            assert (await refused(r.open(pack(0))))[0] == grpc.StatusCode.FAILED_PRECONDITION  # not newer
            other = pack_weights({**state_dict(), "extra": torch.zeros(2)}, 1)
            assert (await refused(r.open(other)))[0] == grpc.StatusCode.INVALID_ARGUMENT  # not the served model
            big = pack_weights({"embed.weight": torch.zeros(4 << 20)}, 1)
            r.servicer.receiver.expected = None
            assert (await refused(r.open(big)))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            corrupt = pack(1)
            corrupt.header.checksum = "0" * 64
            assert (await refused(r.open(corrupt)))[0] == grpc.StatusCode.INVALID_ARGUMENT
            assert not r.servicer.receiver.busy  # no refusal holds the slot
            opened = await r.open(pack(1))
            assert len(opened.ticket) == 32 and opened.data_port == r.port and opened.ticket_ttl_seconds > 0
            code, details = await refused(r.open(pack(2)))  # one update at a time, whatever the transport
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "another weight update" in details
            code, _ = await refused(push_weights(r.addr, pack(2), token=TOKEN, transport="grpc"))
            assert code == grpc.StatusCode.FAILED_PRECONDITION
            code, details = await refused(r.commit(secrets.token_bytes(32)))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "ticket" in details
            assert r.engine.swaps == 0

    asyncio.run(main())


def test_bad_short_extra_corrupt_and_reused_data_connections():
    async def main():
        async with Replica() as r:
            # a wrong ticket: the connection is closed unread, the transfer waits for the right one
            packed = pack(1)
            opened = await r.open(packed)
            s = await send_raw(r.port, secrets.token_bytes(32) + payload(packed), close=False)
            assert await closed_by_peer(s)
            s.close()
            await asyncio.to_thread(send_buckets, "127.0.0.1", r.port, opened.ticket, packed.buckets, 10)
            # the same ticket again (after its data): refused; the first connection's update commits
            s = await send_raw(r.port, opened.ticket + payload(packed), close=False)
            assert await closed_by_peer(s)
            s.close()
            resp = await r.commit(opened.ticket)
            assert resp.swapped and resp.version == 1 and r.engine.served.version == 1
            code, _ = await refused(r.commit(opened.ticket))  # single use: committed once
            assert code == grpc.StatusCode.INVALID_ARGUMENT

            def refusal_leaves_v1(code_details, pattern):
                code, details = code_details
                assert code == grpc.StatusCode.INVALID_ARGUMENT and pattern in details, details
                assert r.engine.served.version == 1 and r.engine.swaps == 1
                assert not r.servicer.receiver.busy

            packed = pack(2, seed=2)
            data = payload(packed)
            # short: the connection ends before the last byte
            opened = await r.open(packed)
            await send_raw(r.port, opened.ticket + data[:-100])
            refusal_leaves_v1(await refused(r.commit(opened.ticket)), "cut")
            # extra bytes after the last bucket
            opened = await r.open(packed)
            await send_raw(r.port, opened.ticket + data + b"\0")
            refusal_leaves_v1(await refused(r.commit(opened.ticket)), "after the last bucket")
            # a flipped byte: the bucket's sha256
            opened = await r.open(packed)
            flipped = bytearray(data)
            flipped[len(data) // 2] ^= 0xFF
            await send_raw(r.port, opened.ticket + bytes(flipped))
            refusal_leaves_v1(await refused(r.commit(opened.ticket)), "sha256")
            # the commit arriving first waits for the data
            opened = await r.open(packed)
            commit = asyncio.ensure_future(r.commit(opened.ticket))
            await asyncio.sleep(0.2)
            assert not commit.done()
            await send_raw(r.port, opened.ticket + data)
            assert (await commit).version == 2
            assert_bits(r.engine.tensors, state_dict(2))

    asyncio.run(main())


def test_expiry_frees_the_replica():
    async def main():
        async with Replica(ttl=0.5) as r:
            # a client that never connects
            opened = await r.open(pack(1))
            assert r.servicer.receiver.busy
            await asyncio.sleep(1.0)
            assert not r.servicer.receiver.busy and not r.servicer.data._transfers
            code, details = await refused(r.commit(opened.ticket))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "expired" in details
            s = await send_raw(r.port, opened.ticket + payload(pack(1)), close=False)  # too late
            assert await closed_by_peer(s)
            s.close()
            # a client that stalls mid-stream: cut after read_timeout without progress (the deadline is far)
            r.servicer.data.min_rate = 1
            opened = await r.open(pack(1))
            s = await send_raw(r.port, opened.ticket + payload(pack(1))[:1000], close=False)
            t0 = time.monotonic()
            code, details = await refused(r.commit(opened.ticket))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "progress" in details
            assert time.monotonic() - t0 < 5 and not r.servicer.receiver.busy
            s.close()
            r.servicer.data.min_rate = 8 << 20
            # data in, never committed: dropped after ttl
            packed = pack(1)
            opened = await r.open(packed)
            await asyncio.to_thread(send_buckets, "127.0.0.1", r.port, opened.ticket, packed.buckets, 10)
            await asyncio.sleep(1.5)
            assert not r.servicer.receiver.busy and not r.servicer.data._transfers
            assert (await refused(r.commit(opened.ticket)))[0] == grpc.StatusCode.INVALID_ARGUMENT
            assert r.engine.swaps == 0
            # and the next update goes through
            resp = await push_weights(r.addr, packed, token=TOKEN, transport="tcp")
            assert resp.swapped and resp.version == 1

    asyncio.run(main())


def test_a_cut_push_reports_the_replicas_refusal():
    """push_weights whose data connection breaks: the replica's IncompleteUpdate comes back, the old weights serve."""

    async def main():
        async with Replica() as r:
            packed = pack(1)
            cut = type(packed)(packed.header, [packed.buckets[0][:-10], *packed.buckets[1:]])  # fewer bytes sent
            code, details = await refused(push_weights(r.addr, cut, token=TOKEN, transport="tcp"))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert r.engine.swaps == 0 and not r.servicer.receiver.busy

    asyncio.run(main())


# ------------------------------------------------------------------------------ who may hold the update slot (item 4)


async def abort(r: Replica, ticket: bytes, metadata=AUTH) -> bool:
    call = r.channel.unary_unary(
        "/rlhf.v1.RolloutService/AbortWeightsTransfer",
        request_serializer=weights_pb2.AbortWeightsTransferRequest.SerializeToString,
        response_deserializer=weights_pb2.AbortWeightsTransferResponse.FromString,
    )
    resp = await call(weights_pb2.AbortWeightsTransferRequest(ticket=ticket), metadata=metadata, timeout=30)
    return resp.aborted


def test_abort_frees_the_slot_at_once_and_cuts_the_data_connection():
    async def main():
        async with Replica(ttl=60.0) as r:  # without the abort, the slot would stay taken for a minute
            opened = await r.open(pack(1))
            assert (await refused(abort(r, opened.ticket, metadata=None)))[0] == grpc.StatusCode.UNAUTHENTICATED
            assert r.servicer.receiver.busy
            assert await abort(r, opened.ticket) is True
            assert not r.servicer.receiver.busy and r.servicer.data.open_transfers == 0
            code, details = await refused(r.commit(opened.ticket))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert await abort(r, opened.ticket) is False  # gone: not an error
            # mid-stream: the receiving thread is woken and the connection closed
            opened = await r.open(pack(1))
            s = await send_raw(r.port, opened.ticket + payload(pack(1))[:1000], close=False)
            commit = asyncio.ensure_future(r.commit(opened.ticket))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            assert await abort(r, opened.ticket) is True
            code, details = await refused(commit)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "aborted" in details
            assert time.monotonic() - t0 < 5 and not r.servicer.receiver.busy
            assert await closed_by_peer(s)
            s.close()
            resp = await push_weights(r.addr, pack(1), token=TOKEN, transport="tcp")
            assert resp.swapped and r.engine.served.version == 1

    asyncio.run(main())


def test_a_failed_send_aborts_its_transfer(monkeypatch):
    """push_weights whose data connection cannot be made frees the replica's slot through the abort call, not after
    the ticket's ttl: the next push goes through at once."""

    def unreachable(host, port, ticket, buckets, timeout):
        raise ConnectionRefusedError("data port unreachable (firewall)")

    async def main():
        async with Replica(ttl=60.0) as r:
            monkeypatch.setattr(send_mod, "send_buckets", unreachable)
            with pytest.raises((ConnectionRefusedError, grpc.aio.AioRpcError)):
                await push_weights(r.addr, pack(1), token=TOKEN, transport="tcp")
            assert not r.servicer.receiver.busy and r.engine.swaps == 0
            monkeypatch.undo()
            resp = await push_weights(r.addr, pack(1), token=TOKEN, transport="tcp")
            assert resp.swapped

    asyncio.run(main())


def test_connections_without_a_valid_ticket_never_hold_the_slot():
    async def main():
        async with Replica(ttl=30.0) as r:
            data = r.servicer.data
            data.ticket_wait = 2.0
            # a flood of connections that send nothing: at most MAX_PENDING_CONNECTIONS wait, none touches the slot

            idle = [await send_raw(r.port, b"", close=False) for _ in range(MAX_PENDING_CONNECTIONS + 4)]
            await asyncio.sleep(0.3)
            assert len(data._pending) <= MAX_PENDING_CONNECTIONS and not r.servicer.receiver.busy
            # wrong tickets while a transfer is open: closed, the transfer is untouched
            packed = pack(1)
            opened = await r.open(packed)
            for junk in (secrets.token_bytes(32), opened.ticket[:-1] + bytes([opened.ticket[-1] ^ 1])):
                s = await send_raw(r.port, junk + payload(packed), close=False)
                assert await closed_by_peer(s)
                s.close()
            # the ticket's owner still gets through, behind a full set of idle connections (it evicts the oldest)
            idle += [await send_raw(r.port, b"", close=False) for _ in range(MAX_PENDING_CONNECTIONS)]
            await asyncio.sleep(0.1)
            await asyncio.to_thread(send_buckets, "127.0.0.1", r.port, opened.ticket, packed.buckets, 10)
            resp = await r.commit(opened.ticket)
            assert resp.swapped and resp.version == 1
            for s in idle:  # each was closed by the replica after ticket_wait
                assert await closed_by_peer(s)
                s.close()
            assert not data._pending

    asyncio.run(main())


def test_a_trickling_connection_is_cut_at_the_transfer_deadline():
    """A sender with a valid ticket that sends a byte now and then (never idle for read_timeout) still cannot keep
    the slot: the transfer must finish within ttl + total_bytes / min_rate."""

    async def main():
        async with Replica(ttl=0.5) as r:
            r.servicer.data.read_timeout = 5.0
            r.servicer.data.min_rate = 1 << 30  # deadline ~0.5 s
            packed = pack(1)
            opened = await r.open(packed)
            s = await send_raw(r.port, opened.ticket + payload(packed)[:10], close=False)
            commit = asyncio.ensure_future(r.commit(opened.ticket))
            t0 = time.monotonic()
            with contextlib.suppress(OSError):
                for i in range(30):  # one byte every 0.1 s
                    if commit.done():
                        break
                    await asyncio.to_thread(s.sendall, payload(packed)[10 + i : 11 + i])
                    await asyncio.sleep(0.1)
            code, details = await refused(commit)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "not complete within" in details
            assert time.monotonic() - t0 < 3 and not r.servicer.receiver.busy
            s.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------ installed as it arrives


@dataclass
class StreamingEngine(FakeEngine):
    """An engine that installs every update bucket by bucket as it arrives (what vLLM does for large updates,
    ``EngineBase.install_streamed``): slowly, so the data connection waits for its slots; it records how many
    bucket buffers the data plane held at once and what it installed before a failure."""

    pool: object = None  # the data plane's buffer pool for streamed transfers
    buffers_max: int = 0
    installed: list = field(default_factory=list)  # bucket indices of the last update, in order
    failures: list = field(default_factory=list)

    def streams_update(self, total_bytes: int) -> bool:
        return True

    async def install_streamed(self, header, feed) -> SwapResult:
        self.served.check(header.version, header.parent_version)
        self.installed, got = [], {}
        try:
            async for bucket in feed:
                await asyncio.sleep(0.01)  # installing
                self.buffers_max = max(self.buffers_max, len(self.pool._bufs))
                got.update({k: v.clone() for k, v in bucket.tensors.items()})
                self.installed.append(bucket.index)
                del bucket  # before its slot is given back: its buffer is then free for the receiver
                feed.done()
        except Exception as err:
            self.failures.append(err)
            raise
        self.served.advance(header.version, header.parent_version, header.checksum)
        self.tensors = {t.name: got[t.name] for t in header.tensors}
        self.history.append(header.version)
        return SwapResult(header.version, header.checksum, True, wait_seconds=0.0, swap_seconds=0.5)


def test_an_update_installed_as_it_arrives_holds_two_buckets_and_stops_on_any_failure():
    """With an engine that takes updates as they arrive, the data connection hands over each verified bucket and
    never holds more than two bucket buffers, whatever the update's size; Commit answers with the engine's swap.
    A cut, a corrupt bucket or bytes after the last bucket stop the engine's install at the failing bucket (the
    last bucket goes over only once the data's end is seen), and the replica is free for the next update. The
    UpdateWeights stream hands buckets over the same way."""

    async def main():
        async with Replica() as r:
            r.engine = StreamingEngine(served=r.engine.served, pool=r.servicer.data._stream_pool)
            r.servicer.engine = r.engine
            for version in (1, 2):
                packed = pack(version, seed=version)
                resp = await push_weights(r.addr, packed, token=TOKEN, transport="tcp")
                assert resp.swapped and resp.version == version and resp.swap_seconds == 0.5
                assert resp.bytes_received == packed.total_bytes
                assert r.engine.installed == list(range(len(packed.buckets))) and len(packed.buckets) > 2
                assert_bits(r.engine.tensors, state_dict(version))
            assert 1 <= r.engine.buffers_max <= 2, r.engine.buffers_max
            assert not r.servicer.receiver.busy and not r.engine.failures

            packed = pack(3, seed=3)
            data = payload(packed)
            cut = sum(len(b) for b in packed.buckets[:2]) + 100
            flipped = bytearray(data)
            flipped[cut] ^= 0xFF  # in bucket 2
            n = len(packed.buckets)
            for sent, error, pattern, most in (
                (data[:cut], "IncompleteUpdate", "cut", 2),  # buckets 0 and 1 complete (1 may not be handed over)
                (bytes(flipped), "CorruptUpdate", "sha256", 2),
                (data + b"\0", "CorruptUpdate", "after the last bucket", n - 1),
            ):
                opened = await r.open(packed)
                await send_raw(r.port, opened.ticket + sent)
                code, details = await refused(r.commit(opened.ticket))
                assert code == grpc.StatusCode.INVALID_ARGUMENT and pattern in details, details
                assert type(r.engine.failures[-1]).__name__ == error
                got = r.engine.installed  # verified buckets, in order, never the failing one nor any after it
                assert got == list(range(len(got))) and len(got) <= most and (most < n - 1 or len(got) == most)
                assert r.engine.served.version == 2 and not r.servicer.receiver.busy
            resp = await push_weights(r.addr, packed, token=TOKEN, transport="tcp")  # the next one goes through
            assert resp.version == 3
            assert_bits(r.engine.tensors, state_dict(3))

            # the UpdateWeights stream: the same, bucket by bucket from the stream, two buffers of the receiver's pool
            r.engine.pool, r.engine.buffers_max = r.servicer.receiver.pool, 0
            packed = pack(4, seed=4)
            resp = await push_weights(r.addr, packed, token=TOKEN, transport="grpc")
            assert resp.swapped and resp.version == 4 and resp.swap_seconds == 0.5
            assert r.engine.installed == list(range(len(packed.buckets)))
            assert_bits(r.engine.tensors, state_dict(4))
            assert 1 <= r.engine.buffers_max <= 2, r.engine.buffers_max
            call = r.channel.stream_unary(
                "/rlhf.v1.RolloutService/UpdateWeights",
                request_serializer=weights_pb2.WeightUpdate.SerializeToString,
                response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
            )
            packed = pack(5, seed=5)
            messages = list(packed.updates(chunk_bytes=16 << 10))
            code, details = await refused(call(iter(messages[: len(messages) // 2]), metadata=AUTH, timeout=30))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "cut" in details
            assert isinstance(r.engine.failures[-1], IncompleteUpdate) and r.engine.served.version == 4
            assert not r.servicer.receiver.busy

    asyncio.run(main())
