"""Collective weight push (gloo on CPU): replicas that join with several ranks, and a group that never forms.

- Several ranks (issue 27 item 3): a vLLM replica with tensor parallelism receives in every worker, each of which
  joins the push's group. The replica reports its world size at Open, the trainer admits that many ranks for its
  ticket, and each worker joins with the ticket's first rank plus its ``parallel_config.rank`` (before: every worker
  took the same rank in a world one rank per replica, and the group never formed).
- A group that never forms (item 4): NCCL builds its communicator at the first broadcast and no timeout covers that
  (pytorch/pytorch#88103), so a replica that takes a ticket and never joins blocked the trainer's push for ever.
  gloo times out by itself, so the trainer's rank here is a stand-in with NCCL's behaviour (:class:`LazyInitGroup`):
  built at once, its first broadcast waits for every rank without a timeout. The push must fail within the group
  timeout, name why, and the next push must go through.
"""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial
from types import SimpleNamespace

import grpc
import pytest
import torch

import rlhf.transport.weights.collective as collective
from rlhf.transport.weights import pack_weights, push_weights_many
from rlhf.v1 import weights_pb2
from services.rollout.vllm_transfer import (
    CollectiveBucketInfo,
    CollectiveInitInfo,
    RlhfCollectiveWeightTransferEngine,
)
from tests.support.replica import FakeEngine
from tests.support.replica import Replica as _Replica

TOKEN = "ranks-token"
Replica = partial(_Replica, TOKEN)  # Replica() or Replica(engine)


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(128, 64, generator=g),
        "layer.0.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "big": torch.randn(200, 200, generator=g),
    }


def pack(version: int):
    return pack_weights(state_dict(version), version, bucket_bytes=48 << 10)  # several buckets


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), k


class TensorParallelEngine(FakeEngine):
    """A vLLM replica with ``tp`` workers, each receiving through the real worker-side transfer engine
    (``RlhfCollectiveWeightTransferEngine``, vLLM's weight-transfer API) with its own ``parallel_config.rank``."""

    def __init__(self, tp: int):
        super().__init__()
        self.collective_ranks = tp  # what VllmEngine reports from its workers' parallel config
        self.worker_staged: list[dict] = []

    async def receive_collective(self, group, ticket, header, per_bucket):
        def worker(rank: int) -> dict:
            parallel = SimpleNamespace(rank=rank, world_size=self.collective_ranks, data_parallel_index=0)
            vllm_config = SimpleNamespace(parallel_config=parallel, model_config=None)
            engine = RlhfCollectiveWeightTransferEngine(None, vllm_config, torch.device("cpu"), None)
            engine.init_transfer_engine(
                CollectiveInitInfo(group.address, group.port, group.key, ticket.hex(), group.timeout_s, group.backend)
            )
            try:
                engine.start_weight_update()
                for i, b in enumerate(header.buckets):
                    tensors = [[name, dt, list(shape)] for name, (dt, shape) in per_bucket[i].items()]
                    engine.receive_weights(CollectiveBucketInfo(i, b.nbytes, b.sha256, tensors))
                return dict(engine.staged)
            finally:
                engine.shutdown()

        # every worker at once, as vLLM's collective_rpc runs them
        staged = await asyncio.gather(*(asyncio.to_thread(worker, r) for r in range(self.collective_ranks)))
        self.worker_staged = list(staged)
        return staged[0], header.total_bytes


class NeverJoinsEngine(FakeEngine):
    """Takes a ticket at Open and never joins the group (a worker stuck before its join, a crash after Open)."""

    async def receive_collective(self, group, ticket, header, per_bucket):
        await asyncio.Event().wait()


def push(targets, packed, **kw):
    return push_weights_many(targets, packed, token=TOKEN, transport="collective", timeout=60, **kw)


# ------------------------------------------------------------------------------------ several ranks per replica


def test_a_ticket_admitted_with_two_ranks_is_joined_by_two_processes_and_each_receives_every_bucket():
    """The collective layer alone: replica A joins with two ranks (one ticket, local ranks 0 and 1), replica B with
    one; the trainer broadcasts to the world of 4 and every receiver gets every bucket, bit for bit."""
    packed = pack(1)
    group = collective.TrainerGroup("127.0.0.1", 10.0)
    ticket_a, ticket_b = b"a" * 32, b"b" * 32
    world = group.admit([ticket_a, ticket_b], [2, 1])
    assert world == 4
    manifests = [
        {t.name: (t.dtype, tuple(t.shape)) for t in packed.header.tensors if t.bucket == i}
        for i in range(len(packed.header.buckets))
    ]
    got: dict[tuple[bytes, int], dict] = {}
    errors: list[BaseException] = []
    ranks: dict[tuple[bytes, int], int] = {}

    def receiver(ticket: bytes, local_rank: int) -> None:
        try:
            pg = collective.join_group(group.spec, ticket, local_rank)
            ranks[ticket, local_rank] = pg.rank()
            tensors = {}
            for i, b in enumerate(packed.header.buckets):
                tensors.update(collective.receive_bucket(pg, i, b.nbytes, b.sha256, manifests[i]))
            got[ticket, local_rank] = tensors
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [
        threading.Thread(target=receiver, args=a, daemon=True) for a in ((ticket_a, 0), (ticket_a, 1), (ticket_b, 0))
    ]
    for t in threads:
        t.start()
    try:
        group.run(lambda: group.broadcast(world, packed.buckets)).result(timeout=30)
    finally:
        for t in threads:
            t.join(30)
        group.close()
    assert not errors, errors
    assert ranks == {(ticket_a, 0): 1, (ticket_a, 1): 2, (ticket_b, 0): 3}
    for tensors in got.values():
        assert_bits(tensors, state_dict(1))
    assert len(got) == 3


def test_a_process_beyond_the_ranks_admitted_for_its_ticket_is_refused_with_the_reason():
    group = collective.TrainerGroup("127.0.0.1", 5.0)
    try:
        group.admit([b"c" * 32], [2])
        with pytest.raises(ValueError, match=r"rank 2 of its replica and the trainer admitted 2 rank"):
            collective.join_group(group.spec, b"c" * 32, 2)
        with pytest.raises(ValueError, match="one rank count"):
            group.admit([b"d" * 32], [0])
    finally:
        group.close()


def test_open_reports_the_replica_ranks():
    async def main():
        async with Replica(TensorParallelEngine(2)) as tp, Replica() as plain:
            group = collective.TrainerGroup("127.0.0.1", 1.0)  # never admitted: the replicas' joins end at 1 s
            try:
                for replica, want in ((tp, 2), (plain, 1)):
                    ch = grpc.aio.insecure_channel(replica.addr)
                    call = ch.unary_unary(
                        "/rlhf.v1.RolloutService/OpenWeightsTransfer",
                        request_serializer=weights_pb2.OpenWeightsTransferRequest.SerializeToString,
                        response_deserializer=weights_pb2.OpenWeightsTransferResponse.FromString,
                    )
                    req = weights_pb2.OpenWeightsTransferRequest(header=pack(1).header, group=group.spec.to_proto())
                    resp = await call(req, timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
                    assert resp.ranks == want and resp.ticket
                    replica.servicer.data.abort(resp.ticket)
                    await ch.close()
            finally:
                group.close()

    asyncio.run(main())


def test_a_tensor_parallel_replica_and_a_plain_one_take_one_push_each_worker_bit_exact():
    """Through Open / Commit: the tp=2 replica reports 2 ranks, the trainer admits a world of 1 + 2 + 1, and both
    of its workers (vLLM's transfer engine, parallel_config.rank 0 and 1) receive every bucket."""

    async def main():
        async with Replica(TensorParallelEngine(2)) as tp, Replica() as plain:
            t0 = time.monotonic()
            out = await push([tp.addr, plain.addr], pack(1), group_timeout_s=5)
            print(f"push to a tp=2 replica and a plain one: {time.monotonic() - t0:.2f} s")
            for r in (tp, plain):
                assert not isinstance(out[r.addr], BaseException), out[r.addr]
                assert out[r.addr].version == 1 and r.engine.history == [1] and not r.busy
                assert_bits(r.engine.tensors, state_dict(1))
            assert len(tp.engine.worker_staged) == 2
            for staged in tp.engine.worker_staged:
                assert_bits(staged, state_dict(1))
            out = await push([tp.addr, plain.addr], pack(2), group_timeout_s=5)  # a new group each push
            assert tp.engine.history == plain.engine.history == [1, 2]

    asyncio.run(main())


# ------------------------------------------------------------------------- a group that never forms (NCCL-like)


FOREVER_S = 45.0  # "no timeout": long enough that a push without the watchdog fails this file's time bounds


class LazyInitGroup:
    """The trainer's rank with NCCL's behaviour: built at once; the first broadcast forms the communicator, which
    waits for every other rank to join with no timeout (here: until each has built its group, or :meth:`abort`,
    which ends a non-blocking init; ``abortable=False``: a blocking init, which abort does not end). Then the real
    gloo group carries the buckets."""

    instances: list[LazyInitGroup] = []

    def __init__(self, make, store, world: int, abortable: bool = True):
        self.make, self.store, self.world, self.abortable = make, store, world, abortable
        self.pg = None
        self.aborted = threading.Event()
        LazyInitGroup.instances.append(self)

    def broadcast(self, tensors, opts):
        if self.pg is None:
            keys = [f"joined/{r}" for r in range(1, self.world)]
            end = time.monotonic() + FOREVER_S
            while not self.store.check(keys):
                if self.abortable and self.aborted.is_set():
                    raise RuntimeError("NCCL communicator aborted during its initialization")
                if time.monotonic() > end:
                    raise RuntimeError("the stand-in's 'for ever' is over")
                time.sleep(0.02)
            self.pg = self.make()
        return self.pg.broadcast(tensors, opts)

    def abort(self) -> None:
        self.aborted.set()

    def shutdown(self) -> None:
        pass


def nccl_like(monkeypatch, abortable: bool = True) -> None:
    """Every group built in this process from now on: rank 0 lazily (:class:`LazyInitGroup`); the other ranks mark
    themselves joined on the push's store, then build their real gloo group."""
    real = collective._process_group

    def process_group(store, rank, world, spec, host):
        marks = torch.distributed.PrefixStore(spec.key + "/sim/", store)
        if rank == 0:
            return LazyInitGroup(lambda: real(store, rank, world, spec, host), marks, world, abortable)
        marks.set(f"joined/{rank}", "1")
        return real(store, rank, world, spec, host)

    LazyInitGroup.instances.clear()
    monkeypatch.setattr(collective, "_process_group", process_group)


@pytest.mark.parametrize("abortable", [True, False], ids=["nonblocking-init", "blocking-init"])
def test_the_watchdog_fails_a_group_that_never_forms_within_the_timeout(monkeypatch, abortable):
    """The collective layer: one admitted ticket whose holder never joins. The broadcast fails with GroupTimeout
    at timeout + grace, and the group is aborted; with a blocking init that ignores abort the future still fails
    on time (the thread is left to its backend)."""
    nccl_like(monkeypatch, abortable)
    group = collective.TrainerGroup("127.0.0.1", 1.0)
    world = group.admit([b"n" * 32])
    t0 = time.monotonic()
    fut = group.run(lambda: group.broadcast(world, [b"x" * 1024]))
    with pytest.raises(collective.GroupTimeout, match="did not finish forming the communicator") as info:
        fut.result(timeout=FOREVER_S + 10)
    took = time.monotonic() - t0
    print(f"a group that never forms failed after {took:.2f} s (timeout 1 s)")
    assert took < 6, took  # timeout 1 s + the watchdog's grace 2 s
    assert "never joined" in str(info.value) and "world 2" in str(info.value)
    assert LazyInitGroup.instances[0].aborted.is_set()
    group.close()


def test_a_replica_that_takes_a_ticket_and_never_joins_fails_the_push_in_time_and_the_next_push_goes_through(
    monkeypatch,
):
    async def main():
        async with Replica() as good, Replica(NeverJoinsEngine()) as stuck:
            nccl_like(monkeypatch)
            t0 = time.monotonic()
            out = await asyncio.wait_for(push([good.addr, stuck.addr], pack(1), group_timeout_s=2), FOREVER_S + 15)
            took = time.monotonic() - t0
            print(f"push with a replica that never joins failed after {took:.2f} s (group timeout 2 s)")
            assert took < 8, took  # group timeout 2 s + the watchdog's grace 2 s + the aborts
            for addr in (good.addr, stuck.addr):
                assert isinstance(out[addr], RuntimeError), out[addr]
                text = str(out[addr])
                assert "collective broadcast of version 1 failed" in text, text
                assert "did not finish forming the communicator" in text and "within 2 s" in text, text
            assert LazyInitGroup.instances[0].aborted.is_set()
            assert good.engine.history == [] and good.engine.served.version == 0
            for _ in range(100):  # the trainer aborted its ticket; its receive thread ends at gloo's timeout
                if not good.busy:
                    break
                await asyncio.sleep(0.05)
            assert not good.busy
            monkeypatch.undo()
            # the trainer pushes again: the good replica takes it (the stuck one still holds its slot: left out)
            out = await push([good.addr], pack(1), group_timeout_s=5)
            assert not isinstance(out[good.addr], BaseException), out[good.addr]
            assert out[good.addr].version == 1
            assert_bits(good.engine.tensors, state_dict(1))

    asyncio.run(main())
