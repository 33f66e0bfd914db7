"""Collective weight transfer (gloo on CPU): the trainer broadcasts the buckets to every replica at once, behind the
same token-protected Open / Commit / Abort calls as the data plane (rlhf.transport.weights.collective).

Replicas here are the real rollout servicer over a fake engine (the served version's owner and a swap that keeps the
tensors), in this process or, for kill -9, in a child process; tests/integration/test_rollout_service.py and
test_weights_collective_engines.py push to real engines.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from functools import partial

import grpc
import pytest
import torch

import rlhf.transport.weights.collective as collective
from rlhf.transport.weights import pack_weights, push_weights, push_weights_many
from rlhf.v1 import weights_pb2
from tests.support.replica import Replica as _Replica
from tests.support.replica import start_child

TOKEN = "collective-token"
Replica = partial(_Replica, TOKEN)  # Replica() or Replica(engine)
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 64, generator=g),
        "layer.0.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "big": torch.randn(300, 300, generator=g),
        "step": torch.tensor(seed),
        "special": torch.tensor([float("-0.0"), 1e-45, 3.4e38]),  # -0.0 and a denormal survive bit for bit
    }


def pack(version: int, seed: int | None = None):
    return pack_weights(state_dict(version if seed is None else seed), version, bucket_bytes=64 << 10)


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), k


def push(targets, packed, **kw):
    return push_weights_many(targets, packed, token=TOKEN, transport="collective", timeout=60, **kw)


# ------------------------------------------------------------------------------------------------- round trips


def test_broadcast_to_two_replicas_is_bit_exact_and_versioned():
    async def main():
        async with Replica() as a, Replica() as b:
            packed = pack(1)
            out = await push([a.addr, b.addr], packed)
            for r in (a, b):
                resp = out[r.addr]
                assert not isinstance(resp, BaseException), resp
                assert resp.swapped and resp.version == 1 and resp.checksum == packed.checksum
                assert resp.bytes_received == packed.total_bytes
                assert_bits(r.engine.tensors, state_dict(1))
                assert r.engine.served.version == 1 and not r.busy
            out = await push([a.addr, b.addr], pack(2))
            assert all(not isinstance(v, BaseException) for v in out.values())
            assert a.engine.history == b.engine.history == [1, 2]
            # a stale push is refused at Open, before any group forms: the replica keeps serving
            out = await push([a.addr], pack(2, seed=5))
            assert isinstance(out[a.addr], grpc.aio.AioRpcError)
            assert out[a.addr].code() == grpc.StatusCode.FAILED_PRECONDITION and a.engine.history == [1, 2]
            # one replica through push_weights(transport="collective")
            resp = await push_weights(a.addr, pack(3), token=TOKEN, transport="collective")
            assert resp.version == 3 and a.engine.history == [1, 2, 3]

    asyncio.run(main())


def test_open_with_a_group_needs_the_token_and_a_valid_group():
    async def main():
        async with Replica() as r:
            ch = grpc.aio.insecure_channel(r.addr)
            call = ch.unary_unary(
                "/rlhf.v1.RolloutService/OpenWeightsTransfer",
                request_serializer=weights_pb2.OpenWeightsTransferRequest.SerializeToString,
                response_deserializer=weights_pb2.OpenWeightsTransferResponse.FromString,
            )
            group = weights_pb2.CollectiveGroup(address="127.0.0.1", port=1, key="k")
            req = weights_pb2.OpenWeightsTransferRequest(header=pack(1).header, group=group)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(req, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            req.group.port = 0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(req, timeout=10, metadata=AUTH)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and not r.busy
            await ch.close()

    asyncio.run(main())


def test_concurrent_pushes_never_move_a_replica_backwards():
    """Two trainers' pushes (versions 2 and 1) race to the same replicas: each replica has one update slot, so one
    push may be refused as busy, and a version older than the one served is refused as stale; no replica ever
    installs an older version after a newer one."""

    async def main():
        async with Replica() as a, Replica() as b:
            targets = [a.addr, b.addr]
            for _ in range(3):
                first, second = await asyncio.gather(push(targets, pack(2)), push(targets, pack(1)))
                for r in (a, b):
                    assert r.engine.history == sorted(set(r.engine.history)), r.engine.history
                    assert not r.busy
            # whatever raced, the newer version goes through next time and the older one never does
            await push(targets, pack(2))
            out = await push(targets, pack(1))
            for r in (a, b):
                assert r.engine.served.version == 2
                assert isinstance(out[r.addr], grpc.aio.AioRpcError)
                assert out[r.addr].code() == grpc.StatusCode.FAILED_PRECONDITION

    asyncio.run(main())


# --------------------------------------------------------------------------------------- failures: join / leave


def start_child_replica() -> tuple[subprocess.Popen, str]:
    """A replica over a fake engine in a process of its own (tests.support.replica)."""
    return start_child("--token", TOKEN)


def test_kill_9_mid_broadcast_fails_the_push_in_time_and_the_next_push_reaches_the_survivors(monkeypatch):
    child, child_addr = start_child_replica()
    real_broadcast = collective._broadcast
    sent = {"n": 0}

    def broadcast_then_kill(pg, t):  # the trainer's side: after the first bucket, the child replica dies
        real_broadcast(pg, t)
        sent["n"] += 1
        if sent["n"] == 1 and child.poll() is None:
            child.send_signal(signal.SIGKILL)
            child.wait()

    async def main():
        async with Replica() as survivor:
            targets = [survivor.addr, child_addr]
            monkeypatch.setattr(collective, "_broadcast", broadcast_then_kill)
            t0 = time.monotonic()
            out = await push(targets, pack(1), group_timeout_s=20)
            took = time.monotonic() - t0
            print(f"push with a member killed mid-broadcast failed after {took:.2f} s")
            monkeypatch.undo()
            assert all(isinstance(v, BaseException) for v in out.values()), out
            # A dead member usually fails the broadcast at once (its sockets close); when gloo has nothing pending
            # towards it at that moment, the group timeout (20 s) ends the push: within a timeout, never a hang.
            assert took < 20 + 10, took
            assert survivor.engine.served.version == 0 and survivor.engine.history == []
            assert not survivor.busy  # the trainer's abort freed the slot at once
            # the next push: the dead replica's Open fails, the group is the survivor alone
            out = await push(targets, pack(1))
            assert isinstance(out[child_addr], grpc.aio.AioRpcError)
            assert out[survivor.addr].version == 1
            assert_bits(survivor.engine.tensors, state_dict(1))

    try:
        asyncio.run(main())
    finally:
        if child.poll() is None:
            child.kill()


def test_a_hung_member_fails_the_push_within_the_group_timeout():
    """SIGSTOP after Open: the member neither receives nor closes its sockets; the broadcast times out."""
    child, child_addr = start_child_replica()

    async def main():
        async with Replica() as survivor:
            targets = [survivor.addr, child_addr]
            real_admit = collective.TrainerGroup.admit

            def admit_then_stop(self, tickets, ranks=None):
                os.kill(child.pid, signal.SIGSTOP)  # it answered Open; now it hangs
                return real_admit(self, tickets, ranks)

            collective.TrainerGroup.admit = admit_then_stop
            try:
                t0 = time.monotonic()
                out = await push(targets, pack(1), group_timeout_s=3)
                took = time.monotonic() - t0
                print(f"push with a hung member failed after {took:.2f} s (group timeout 3 s)")
            finally:
                collective.TrainerGroup.admit = real_admit
            assert all(isinstance(v, BaseException) for v in out.values()), out
            assert took < 30, took
            assert survivor.engine.served.version == 0 and not survivor.busy
            child.kill()
            child.wait()
            out = await push(targets, pack(1))
            assert out[survivor.addr].version == 1

    try:
        asyncio.run(main())
    finally:
        if child.poll() is None:
            child.kill()


def test_a_replica_that_joins_later_is_in_the_next_group():
    async def main():
        async with Replica() as a:
            out = await push([a.addr], pack(1))
            assert out[a.addr].version == 1
            async with Replica() as b:  # scaled up: the next push forms a group of both
                out = await push([a.addr, b.addr], pack(2))
                assert out[a.addr].version == 2 and out[b.addr].version == 2
                assert_bits(b.engine.tensors, state_dict(2))

    asyncio.run(main())
