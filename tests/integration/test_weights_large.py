"""Updates larger than a bucket into a real vLLM replica (in-process engine behind the rollout servicer and its TCP
data plane), with 64 KiB buckets so the tiny policy spans several: every load path hands the worker one bucket per
call (spied on at the worker's engine: vLLM's weight-transfer backend and the shadow model of staged swaps), and an
update installed as it arrives (``RLHF_WEIGHTS_INPLACE_LOAD_BYTES``) that is cut or corrupt half-way leaves a
replica that serves nothing until a complete update arrives, never a mix of two versions."""

from __future__ import annotations

import asyncio
import os
import socket
from functools import partial

import grpc
import pytest
import torch
from safetensors.torch import load_file

from rlhf.serving.errors import NotReady
from rlhf.serving.settings import KNOWN_ENV_VARS
from rlhf.transport.weights import pack_weights, push_weights
from rlhf.transport.weights.format import load_safetensors
from rlhf.v1 import rollout_pb2_grpc, weights_pb2
from services.rollout import vllm_shadow, vllm_transfer
from services.rollout.options import SamplingOptions
from services.rollout.vllm_engine import VllmEngine
from services.rollout.vllm_weights import INPLACE_ENV, inplace_load_bytes_from_env
from tests.support.replica import Replica as _Replica

TOKEN = "large-updates"
Replica = partial(_Replica, TOKEN, data_plane=True, close_engine=True)  # Replica(started engine)
AUTH = (("authorization", f"Bearer {TOKEN}"),)
BUCKET = 64 << 10
PROMPTS = [[2, 5, 6, 7], [2, 11, 12]]
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def state(tiny_models):
    return load_file(str(tiny_models.policy / "model.safetensors"))


@pytest.fixture
def vllm_env(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCH_COMPILE_DISABLE", "1")):
        monkeypatch.setenv(k, os.environ.get(k, v))


def test_the_inplace_threshold_setting():
    """RLHF_WEIGHTS_INPLACE_LOAD_BYTES: 2 GiB by default, 0 for every update, off for none; anything else refuses
    the start naming the variable. It is a known RLHF_* variable (start-up does not warn about it)."""
    assert inplace_load_bytes_from_env({}) == 2 << 30
    assert inplace_load_bytes_from_env({INPLACE_ENV: "0"}) == 0
    assert inplace_load_bytes_from_env({INPLACE_ENV: " 1073741824 "}) == 1 << 30
    assert inplace_load_bytes_from_env({INPLACE_ENV: "off"}) is None
    for bad in ("-1", "2GB", "yes"):
        with pytest.raises(ValueError, match=INPLACE_ENV):
            inplace_load_bytes_from_env({INPLACE_ENV: bad})
    assert INPLACE_ENV in KNOWN_ENV_VARS


def perturbed(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def outputs(results) -> list[tuple[list[int], list[float]]]:
    return [(s.token_ids, s.logprobs) for r in results for s in r.samples]


def nbytes(items) -> int:
    return sum(t.numel() * t.element_size() for _, t in items)


class Spy:
    """What each worker call carries: the rlhf_collective backend's update_weights (inline buckets) and the
    shadow model's parts, as (names, tensor bytes, safetensors bytes or 0)."""

    def __init__(self, monkeypatch):
        self.transfer: list[tuple[list[str], int, int]] = []
        self.shadow: list[tuple[list[str], int, int]] = []
        receive = vllm_transfer.RlhfCollectiveWeightTransferEngine.receive_weights
        load_part = vllm_shadow.ShadowSwap._load_part

        def spy_receive(engine, info, *args, **kwargs):
            if info.items or info.data:
                items = list(info.items) or list(load_safetensors(info.data).items())
                self.transfer.append(([n for n, _ in items], nbytes(items), len(info.data)))
            return receive(engine, info, *args, **kwargs)

        def spy_part(swap, items, keep):
            self.shadow.append(([n for n, _ in items], nbytes(items), 0))
            return load_part(swap, items, keep)

        monkeypatch.setattr(vllm_transfer.RlhfCollectiveWeightTransferEngine, "receive_weights", spy_receive)
        monkeypatch.setattr(vllm_shadow.ShadowSwap, "_load_part", spy_part)

    def take(self) -> tuple[list, list]:
        out = (self.transfer, self.shadow)
        self.transfer, self.shadow = [], []
        return out


def assert_one_bucket_per_call(calls, names: set[str], sizes: dict[str, int]) -> None:
    """Several calls, each at most one bucket (or one tensor larger than a bucket, alone), covering every tensor
    once."""
    assert len(calls) > 1, calls
    seen = [n for call, _, _ in calls for n in call]
    assert sorted(seen) == sorted(names)
    for call, tensor_bytes, blob in calls:
        assert tensor_bytes <= BUCKET or (len(call) == 1 and tensor_bytes == sizes[call[0]]), (call, tensor_bytes)
        assert blob <= BUCKET + 4096 or len(call) == 1  # a safetensors part: the tensors plus its JSON header


_ASYNC_OPT_IN = pytest.mark.skipif(
    os.environ.get("RLHF_TEST_VLLM_ASYNC") != "1", reason="set RLHF_TEST_VLLM_ASYNC=1 (~40 s)"
)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["inproc", pytest.param("async", marks=_ASYNC_OPT_IN)])
def test_an_update_larger_than_a_bucket_reaches_vllm_one_bucket_per_call(
    tiny_models, state, vllm_env, monkeypatch, mode
):
    """The same replica takes 64 KiB-bucket pushes over the data plane down every load path: installed as it
    arrives (in place, one update_weights per received bucket: exactly the push's buckets), received whole and
    staged in a shadow model (the CPU default) copied from the model just loaded in place, received whole and loaded
    inside the gate through vLLM's weight-transfer API, in place again with a shadow to give back, and staged in a
    fresh shadow. Every call carries at most one bucket (spied on in-process; the engine-core subprocess of the
    ``async`` driver gets safetensors parts over vLLM's RPC), and every path serves the same tokens and log-probs for
    the same weights."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if mode == "inproc" else "1")
    spy = Spy(monkeypatch) if mode == "inproc" else None
    moved = perturbed(state, 5)
    names, sizes = set(state), {k: v.numel() * v.element_size() for k, v in state.items()}

    async def main():
        eng = VllmEngine(tiny_models.policy, "tiny:policy", mode=mode, max_model_len=256, load_bucket_bytes=BUCKET)
        await eng.start()
        async with Replica(eng) as replica:
            addr = replica.addr
            assert eng.staged_swap and not eng.streams_update(1 << 40)  # CPU default; no in-place threshold set
            before = outputs(await eng.generate(PROMPTS, GREEDY))
            served = {}

            async def push(weights, version, path):
                packed = pack_weights(weights, version, bucket_bytes=BUCKET)
                resp = await push_weights(addr, packed, token=TOKEN, transport="tcp")
                assert resp.swapped and resp.version == version and eng.load_path == path
                assert eng.ready and eng.served.version == version
                served[version] = outputs(await eng.generate(PROMPTS, GREEDY))
                return packed

            eng.inplace_load_bytes = 0  # every update installed as it arrives (no shadow made yet)
            packed = await push(moved, 1, "inplace_streamed")
            if spy is not None:
                transfer, shadow = spy.take()
                assert not shadow
                assert_one_bucket_per_call(transfer, names, sizes)
                buckets = [[t.name for t in packed.header.tensors if t.bucket == i] for i in range(len(packed.buckets))]
                assert [sorted(call) for call, _, _ in transfer] == [sorted(b) for b in buckets]  # the push's buckets

            eng.inplace_load_bytes = None  # received whole, staged in a shadow copied from the model loaded in place
            await push(state, 2, "staged_swap")
            if spy is not None:
                transfer, shadow = spy.take()
                assert not transfer
                assert_one_bucket_per_call(shadow, names, sizes)

            eng.staged_swap = False  # received whole, loaded inside the gate through the weight-transfer API
            await push(moved, 3, "weight_transfer")
            if spy is not None:
                transfer, shadow = spy.take()
                assert not shadow
                assert_one_bucket_per_call(transfer, names, sizes)

            eng.staged_swap, eng.inplace_load_bytes = True, 0  # in place again: the shadow is given back
            await push(state, 4, "inplace_streamed")
            eng.inplace_load_bytes = None  # and a fresh one is made for the next staged swap
            await push(moved, 5, "staged_swap")

            assert served[2] == served[4] == before
            assert served[1] == served[3] == served[5] != before

    asyncio.run(main())


async def open_transfer(channel, packed) -> weights_pb2.OpenWeightsTransferResponse:
    call = channel.unary_unary(
        "/rlhf.v1.RolloutService/OpenWeightsTransfer",
        request_serializer=weights_pb2.OpenWeightsTransferRequest.SerializeToString,
        response_deserializer=weights_pb2.OpenWeightsTransferResponse.FromString,
    )
    return await call(weights_pb2.OpenWeightsTransferRequest(header=packed.header), metadata=AUTH, timeout=30)


async def commit(channel, ticket: bytes) -> weights_pb2.UpdateWeightsResponse:
    call = channel.unary_unary(
        "/rlhf.v1.RolloutService/CommitWeights",
        request_serializer=weights_pb2.CommitWeightsRequest.SerializeToString,
        response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
    )
    return await call(weights_pb2.CommitWeightsRequest(ticket=ticket), metadata=AUTH, timeout=60)


async def send_raw(port: int, data: bytes) -> None:
    def go() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(data)

    await asyncio.to_thread(go)


@pytest.mark.slow
def test_a_cut_update_installed_as_it_arrives_never_serves_a_mix(tiny_models, state, vllm_env):
    """Installed as it arrives (threshold 0, 64 KiB buckets): a transfer cut before its first bucket is complete
    changes nothing (the old weights go on serving); one cut or corrupt after some buckets went into the model
    leaves the replica not ready, refusing generation and reporting its old version (so the trainer's catch-up
    pushes again), while it still takes updates; the next complete one makes it serve, bit for bit what a replica
    that never saw the failures serves."""
    moved = perturbed(state, 9)

    async def main():
        eng = VllmEngine(
            tiny_models.policy,
            "tiny:policy",
            mode="inproc",
            max_model_len=256,
            inplace_load_bytes=0,
            load_bucket_bytes=BUCKET,
        )
        await eng.start()
        async with Replica(eng) as replica, grpc.aio.insecure_channel(replica.addr) as channel:
            addr, servicer = replica.addr, replica.servicer
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            before = outputs(await eng.generate(PROMPTS, GREEDY))
            packed = pack_weights(moved, 1, bucket_bytes=BUCKET)
            data = b"".join(packed.buckets)
            assert len(packed.buckets) > 4 and eng.streams_update(packed.total_bytes)

            async def refused(sent: bytes, pattern: str) -> None:
                opened = await open_transfer(channel, packed)
                await send_raw(servicer.data.port, opened.ticket + sent)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await commit(channel, opened.ticket)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and pattern in info.value.details()
                assert not servicer.receiver.busy

            # cut inside the first bucket: nothing reached the model
            await refused(data[: len(packed.buckets[0]) // 2], "cut")
            assert eng.ready and eng.served.version == 0
            assert outputs(await eng.generate(PROMPTS, GREEDY)) == before

            # cut after three buckets: part of version 1 is in the model
            await refused(data[: sum(len(b) for b in packed.buckets[:3]) + 10], "cut")
            assert not eng.ready
            with pytest.raises(NotReady, match="complete update"):
                await eng.generate(PROMPTS, GREEDY)
            version = await stub.GetWeightsVersion(weights_pb2.GetWeightsVersionRequest(), timeout=5)
            assert version.version == 0  # what the trainer's catch-up loop compares with the published version

            # a corrupt bucket half-way: refused, still not serving
            flipped = bytearray(data)
            flipped[sum(len(b) for b in packed.buckets[:2]) + 100] ^= 0xFF
            await refused(bytes(flipped), "sha256")
            assert not eng.ready and eng.served.version == 0

            # the catch-up push: complete, serving again
            resp = await push_weights(addr, packed, token=TOKEN, transport="tcp")
            assert resp.swapped and resp.version == 1 and eng.ready and eng.load_path == "inplace_streamed"
            after = outputs(await eng.generate(PROMPTS, GREEDY))
            assert after != before
            resp = await push_weights(addr, pack_weights(state, 2, bucket_bytes=BUCKET), token=TOKEN, transport="tcp")
            assert resp.version == 2 and outputs(await eng.generate(PROMPTS, GREEDY)) == before
            # the UpdateWeights stream (a TLS ring's transport) installs as it arrives too
            resp = await push_weights(addr, pack_weights(moved, 3, bucket_bytes=BUCKET), token=TOKEN, transport="grpc")
            assert resp.version == 3 and eng.load_path == "inplace_streamed" and not servicer.receiver.busy
            assert outputs(await eng.generate(PROMPTS, GREEDY)) == after
            return after

    after = asyncio.run(main())

    async def reference():  # a replica that only ever saw the complete update, loaded the default way
        eng = VllmEngine(tiny_models.policy, "tiny:policy", mode="inproc", max_model_len=256)
        await eng.start()
        try:
            await eng.swap_weights(dict(moved), 1, "c1")
            return outputs(await eng.generate(PROMPTS, GREEDY))
        finally:
            await eng.close()

    assert asyncio.run(reference()) == after
