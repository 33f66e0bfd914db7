"""Adapter-only weight sync into vLLM (``actor_rollout.lora_sync: adapter``), on the real vLLM engine: a push is the
adapter's tensors, served as a LoRA adapter per policy version. What it must show: the served policy equals the
merged model (log-probs against a full forward of W + alpha/r B A), a request in flight finishes on the adapter it
started with while new ones get the new adapter, the old adapter is unloaded once its requests are done, and a push
that is not the adapter changes nothing."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from safetensors.torch import load_file

from rlhf.algo import logprobs_from_logits
from rlhf.lora import adapter_push_state_dict, merged_state_dict, wrap_lora
from rlhf.models import causal_lm_logits, load_causal_lm
from rlhf.serving.errors import InvalidArgument
from rlhf.transport.weights import pack_weights, push_weights, push_weights_many
from rlhf.transport.weights.errors import StaleVersion
from services.rollout.options import SamplingOptions
from services.rollout.vllm_engine import VllmEngine
from services.rollout.vllm_lora import LoraSpec
from tests.support.replica import Replica

pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[2, 5, 6, 7], [2, 40, 41, 42, 43]]


@pytest.fixture(scope="module")
def adapters(tiny_models):
    """Two trained-looking adapters (B drawn at random: PEFT starts it at 0) and their merged models' weights."""
    out = []
    for seed in (1, 2):
        model = wrap_lora(load_causal_lm(tiny_models.policy), 8, 16.0, TARGETS)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=g))
        out.append((adapter_push_state_dict(model), merged_state_dict(model)))
    return out


def _logprobs(tiny_models, weights, prompt, tokens):
    model = load_causal_lm(tiny_models.policy).eval()
    model.load_state_dict(weights)
    with torch.no_grad():
        logits = causal_lm_logits(model, torch.tensor([prompt + tokens]), pad_token_id=0)[0]
    return logprobs_from_logits(logits[len(prompt) - 1 : -1], torch.tensor(tokens)).tolist()


def test_vllm_serves_each_pushed_adapter_as_the_merged_model_and_unloads_the_old_one_after_its_requests(
    tiny_models, adapters, monkeypatch
):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCH_COMPILE_DISABLE", "1")):
        os.environ.setdefault(k, v)
    (a1, merged1), (a2, merged2) = adapters
    greedy = SamplingOptions(n=1, max_tokens=8, temperature=0.0)
    long = SamplingOptions(n=1, max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main():
        eng = VllmEngine(tiny_models.policy, "tiny:policy", mode="inproc", lora=LoraSpec(8, 16.0, tuple(TARGETS)))
        await eng.start()
        try:
            seen = {"v0": await eng.generate(PROMPTS, greedy)}
            with pytest.raises(InvalidArgument, match="does not have"):  # the whole model is not an adapter push
                await eng.swap_weights(load_file(str(tiny_models.policy / "model.safetensors")), 1, "full")
            assert eng.weights_version == 0
            r1 = await eng.swap_weights(dict(a1), 1, "c1")
            assert r1.swapped and eng.weights_version == 1 and eng.weights_checksum == "c1"
            seen["v1"] = await eng.generate(PROMPTS, greedy)
            in_flight = asyncio.ensure_future(eng.generate([PROMPTS[0]], long))  # admitted under version 1
            while not await eng._call(lambda llm: llm.get_num_unfinished_requests()):  # in the engine's batch
                await asyncio.sleep(0.01)
            await eng.swap_weights(dict(a2), 2, "c2")  # no pause: it does not wait for the request in flight
            assert not in_flight.done()
            assert eng.adapters.slots.loaded == [1, 2]  # version 1's adapter stays while its request runs
            seen["v2"] = await eng.generate(PROMPTS, greedy)
            seen["long"] = await in_flight
            loras = await eng._call(lambda llm: llm.list_loras())
            with pytest.raises(StaleVersion):
                await eng.swap_weights(dict(a1), 2, "again")
            return seen, eng.adapters.slots.loaded, loras, list(eng.adapters.slots.root.iterdir())
        finally:
            await eng.close()

    seen, loaded, loras, folders = asyncio.run(main())
    base = load_file(str(tiny_models.policy / "model.safetensors"))
    for key, weights in (("v0", base), ("v1", merged1), ("v2", merged2)):
        for prompt, result in zip(PROMPTS, seen[key], strict=True):
            s = result.samples[0]
            assert s.policy_version == int(key[1])
            want = _logprobs(tiny_models, weights, prompt, s.token_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(want), rtol=0, atol=2e-4)
    assert [s.token_ids for r in seen["v1"] for s in r.samples] != [s.token_ids for r in seen["v2"] for s in r.samples]
    # the request in flight across the swap finished on version 1's adapter, all 400 tokens of it
    s = seen["long"][0].samples[0]
    assert s.policy_version == 1 and len(s.token_ids) == 400
    want = _logprobs(tiny_models, merged1, PROMPTS[0], s.token_ids)
    torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(want), rtol=0, atol=2e-4)
    # ...and then its adapter went: from the engine and from disk
    assert loaded == [2] and loras == {2} and [f.name for f in folders] == ["v2"]


def test_an_adapter_push_reaches_vllm_over_the_data_plane_and_the_collective_path(tiny_models, adapters, monkeypatch):
    """Through the rollout servicer, as the trainer pushes: Open / data plane / Commit, then a gloo broadcast; each
    time the replica serves the pushed adapter under the pushed version and checksum."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCH_COMPILE_DISABLE", "1")):
        os.environ.setdefault(k, v)
    (a1, merged1), (a2, merged2) = adapters
    greedy = SamplingOptions(n=1, max_tokens=8, temperature=0.0)
    token = "lora-adapter-sync"

    async def main():
        eng = VllmEngine(tiny_models.policy, "tiny:policy", mode="inproc", lora=LoraSpec(8, 16.0, tuple(TARGETS)))
        await eng.start()
        assert eng.collective_ranks == 1
        async with Replica(token, eng, data_plane=True, close_engine=True) as replica:
            addr, seen = replica.addr, []
            for version, adapter, transport in ((1, a1, "tcp"), (2, a2, "collective")):
                packed = pack_weights(dict(adapter), version)
                if transport == "tcp":
                    resp = await push_weights(addr, packed, token=token, transport="tcp")
                else:
                    resp = (await push_weights_many([addr], packed, token=token, transport="collective"))[addr]
                assert (resp.version, resp.checksum) == (version, packed.checksum), resp
                assert eng.weights_checksum == packed.checksum
                seen.append(await eng.generate(PROMPTS, greedy))
        return seen

    seen = asyncio.run(main())
    for results, weights in zip(seen, (merged1, merged2), strict=True):
        for prompt, result in zip(PROMPTS, results, strict=True):
            s = result.samples[0]
            want = _logprobs(tiny_models, weights, prompt, s.token_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(want), rtol=0, atol=2e-4)
