"""Named adapters on the hf engine (``LoadAdapter``; ``GenerateRequest.adapter``): a request naming an adapter is
sampled from the policy with that LoRA adapter applied (lm_head included), to 1e-4 of PEFT's own forward; the
policy's requests are untouched; an unknown name is NOT_FOUND naming it; the store evicts the least recently used
adapter that no request pins; and the gRPC call takes the adapter's safetensors bytes and its config."""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import replace

import grpc
import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import save

from rlhf.lora import wrap_lora
from rlhf.models import load_causal_lm, resolve_model_path
from rlhf.serving import ServiceSettings
from rlhf.serving.errors import NotFound, ResourceExhausted
from rlhf.transport.weights import push_weights
from rlhf.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from rlhf.v1 import tinker_pb2 as pb
from services.rollout.hf_adapters import AdapterStore, parse_adapter
from services.rollout.hf_engine import HFEngine
from services.rollout.options import SamplingOptions
from services.training.fleet import FleetSampler
from services.training.sampling import SampleSpec
from tests.support.engines import run_hf
from tests.support.replica import Replica

TARGETS = ["q_proj", "v_proj", "down_proj", "lm_head"]
PROMPT = [2, 5, 6, 7, 8]
TOKEN = "named-adapter-token"


@pytest.fixture(scope="module")
def adapter(tiny_models):
    """A trained-looking adapter (B at random; PEFT starts it at 0), its config and the PEFT model itself."""
    model = wrap_lora(load_causal_lm(tiny_models.policy), 4, 8.0, TARGETS).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": TARGETS}
    # the adapter only: PEFT would add the head's own weight (save_embedding_layers), the training service does not
    tensors = {k: v.detach() for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}
    return tensors, config, model


def _forward_logprobs(model, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    """(prompt log-probs from token 1, the tokens' log-probs) under ``model``'s own distribution."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    lp = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:] + tokens)[:, None]).squeeze(1).tolist()
    return lp[: len(prompt) - 1], lp[len(prompt) - 1 :]


def test_a_named_adapter_samples_as_peft_and_leaves_the_policy_alone(tiny_models, adapter):
    tensors, config, peft_model = adapter

    async def body(eng):
        plain = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)
        before = (await eng.generate([PROMPT], plain))[0].samples[0]
        assert await eng.load_adapter("s1", tensors, config) == ["s1"]
        opts = SamplingOptions(
            n=2, max_tokens=8, temperature=0.7, top_k=20, seed=11, ignore_eos=True, adapter="s1", raw_logprobs=True,
            prompt_logprobs=0,
        )  # fmt: skip
        # the adapter's and the policy's requests at once: decoded in separate batches, each under its own weights
        named, again = await asyncio.gather(eng.generate([PROMPT], opts), eng.generate([PROMPT], plain))
        with pytest.raises(NotFound, match="'nope'"):
            await eng.generate([PROMPT], SamplingOptions(max_tokens=2, adapter="nope"))
        return before, named[0], again[0].samples[0]

    before, named, again = run_hf(tiny_models, body)
    assert again.token_ids == before.token_ids and again.logprobs == pytest.approx(before.logprobs, abs=1e-6)
    for sample in named.samples:
        want_prompt, want = _forward_logprobs(peft_model, PROMPT, sample.token_ids)
        # raw_logprobs: the model's own distribution (temperature 1, no top-k), what a training forward gives
        assert sample.logprobs == pytest.approx(want, abs=1e-4)
        assert named.prompt_logprobs[1:] == pytest.approx(want_prompt, abs=1e-4)
    with peft_model.disable_adapter():
        base_lp = _forward_logprobs(peft_model, PROMPT, named.samples[0].token_ids)[1]
    assert max(abs(a - b) for a, b in zip(base_lp, named.samples[0].logprobs, strict=True)) > 1e-2


def test_the_store_evicts_the_least_recently_used_unpinned_adapter(tiny_models, adapter):
    tensors, config, _ = adapter
    model = load_causal_lm(tiny_models.policy)
    store = AdapterStore(max_adapters=2)
    a, b, c = (parse_adapter(n, tensors, config, model) for n in "abc")
    store.put(a)
    store.put(b)
    store.unpin(store.pin("a"))  # a used last: b is the least recently used
    assert store.put(c) == ["a", "c"]
    pinned = store.pin("a")
    store.put(b)  # c goes, a is pinned
    assert store.names() == ["a", "b"]
    pinned_b = store.pin("b")
    with pytest.raises(ResourceExhausted, match="in use"):
        store.put(c)
    store.unpin(pinned)
    store.unpin(pinned_b)
    assert store.put(c) == ["b", "c"]
    bad = {**tensors}
    bad.pop(next(k for k in tensors if k.endswith("lora_B.weight")))
    with pytest.raises(Exception, match="needs both lora_A and lora_B"):
        parse_adapter("x", bad, config, model)


def test_load_adapter_and_generate_over_grpc(tiny_models, adapter):
    tensors, config, peft_model = adapter
    data = save({k: v.contiguous() for k, v in tensors.items()})

    async def main():
        eng = HFEngine(tiny_models.policy, "tiny:policy", device="cpu")
        await eng.start()
        async with Replica(TOKEN, eng, close_engine=True) as r, grpc.aio.insecure_channel(r.addr) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            load = rollout_pb2.LoadAdapterRequest(
                name="s1", adapter_safetensors=data, adapter_config_json=json.dumps(config),
                sha256=hashlib.sha256(data).hexdigest(),
            )  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as no_token:
                await stub.LoadAdapter(load)
            assert no_token.value.code() == grpc.StatusCode.UNAUTHENTICATED
            auth = (("authorization", f"Bearer {TOKEN}"),)
            loaded = await stub.LoadAdapter(load, metadata=auth)
            assert list(loaded.held) == ["s1"]
            req = rollout_pb2.GenerateRequest(
                prompts=[common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=PROMPT))],
                params=common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                adapter="s1", raw_logprobs=True, prompt_logprobs=True,
            )  # fmt: skip
            out = await stub.Generate(req)
            req.adapter = "gone"
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.Generate(req)
            return out, unknown.value

    out, unknown = asyncio.run(main())
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and "'gone'" in unknown.details()
    res = out.results[0]
    want_prompt, want = _forward_logprobs(peft_model, PROMPT, list(res.completions[0].token_ids))
    assert list(res.completions[0].logprobs) == pytest.approx(want, abs=1e-4)
    assert list(res.prompt_logprobs) == pytest.approx(want_prompt, abs=1e-4)


def test_the_fleet_client_samples_on_the_replica_until_its_policy_moves(tiny_models, adapter):
    """The training service's client: an adapter is served by the replica (the in-process fallback not called);
    once a policy version is pushed to the replica, the adapter (trained over the base) is no longer sampled
    there: the fallback answers, and says why."""
    tensors, config, peft_model = adapter
    spec = SampleSpec(torch.tensor(PROMPT), num_samples=2, max_tokens=5, temperature=0.0, prompt_logprobs=True)
    calls = []

    def fallback() -> dict:
        calls.append(1)
        return {"sample": b"in-process"}

    async def main():
        eng = HFEngine(tiny_models.policy, "tiny:policy", device="cpu")
        await eng.start()
        async with Replica(TOKEN, eng, close_engine=True) as r:
            fleet = FleetSampler([r.addr], ServiceSettings(api_token=TOKEN), "tiny:policy")
            try:
                fleet.register("a", tensors, 4, 8.0, TARGETS)
                first = await asyncio.to_thread(fleet.sample, "a", spec, {1}, fallback)
                await push_weights(r.addr, load_causal_lm(tiny_models.policy).state_dict(), 1, token=TOKEN)
                second = await asyncio.to_thread(fleet.sample, "a", spec, {1}, fallback)
                return first, second, fleet.served, fleet.in_process
            finally:
                fleet.close()

    first, second, served, in_process = asyncio.run(main())
    assert (served, in_process, len(calls)) == (1, 1, 1) and second == {"sample": b"in-process"}
    resp = pb.SampleResponse.FromString(first["sample"])
    tokens = np.frombuffer(resp.sequences[0].tokens, dtype=np.int32).tolist()
    want_prompt, want = _forward_logprobs(peft_model, PROMPT, tokens)
    assert np.frombuffer(resp.sequences[0].logprobs, dtype=np.float32).tolist() == pytest.approx(want, abs=1e-4)
    assert np.frombuffer(resp.prompt_logprobs, dtype=np.float32)[1:].tolist() == pytest.approx(want_prompt, abs=1e-4)


def test_an_adapted_lm_head_tied_to_the_embedding_replaces_the_head_only(tiny_models):
    """On a policy whose lm_head is the embedding (tied), an adapter on lm_head changes the head's use of the tensor
    and not the input embedding: the replica's log-probs equal PEFT's forward, and the policy's stay the base's."""
    path = resolve_model_path("tiny:llama-tied/policy")
    peft_model = wrap_lora(load_causal_lm(path), 4, 8.0, ["q_proj", "lm_head"]).eval()
    assert peft_model.get_base_model().config.tie_word_embeddings
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    tensors = {k: v.detach() for k, v in get_peft_model_state_dict(peft_model, save_embedding_layers=False).items()}
    config = {"r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "lm_head"]}

    async def main():
        eng = HFEngine(path, "tiny:llama-tied/policy", device="cpu")
        await eng.start()
        try:
            await eng.load_adapter("tied", tensors, config)
            opts = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True, raw_logprobs=True)
            named = await eng.generate([PROMPT], replace(opts, adapter="tied"))
            plain = await eng.generate([PROMPT], opts)
            return named[0].samples[0], plain[0].samples[0]
        finally:
            await eng.close()

    named, plain = asyncio.run(main())
    assert named.logprobs == pytest.approx(_forward_logprobs(peft_model, PROMPT, named.token_ids)[1], abs=1e-4)
    with peft_model.disable_adapter():
        assert plain.logprobs == pytest.approx(_forward_logprobs(peft_model, PROMPT, plain.token_ids)[1], abs=1e-4)
