"""Named adapters on the vllm engine (``RLHF_ROLLOUT_MAX_ADAPTERS`` set): each a LoRARequest of its own, LoRA on
lm_head included. What it must show: a request naming an adapter samples with it (log-probs equal PEFT's forward,
the prompt's too), the policy's requests are the base's, the least recently used adapter is evicted from vLLM and
from disk, an unknown name is NOT_FOUND, and raw log-probs of a reshaped distribution are refused."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from peft import get_peft_model_state_dict

from rlhf.lora import wrap_lora
from rlhf.models import load_causal_lm
from rlhf.serving.errors import InvalidArgument, NotFound
from services.rollout.options import SamplingOptions

pytest.importorskip("vllm")

from services.rollout.vllm_engine import VllmEngine

TARGETS = ["q_proj", "v_proj", "lm_head"]
PROMPT = [2, 5, 6, 7, 8]


def _adapter(policy, seed: int):
    model = wrap_lora(load_causal_lm(policy), 4, 8.0, TARGETS).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    tensors = {k: v.detach() for k, v in get_peft_model_state_dict(model, save_embedding_layers=False).items()}
    return tensors, model


def _forward_logprobs(model, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[float]]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    lp = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(prompt[1:] + tokens)[:, None]).squeeze(1).tolist()
    return lp[: len(prompt) - 1], lp[len(prompt) - 1 :]


def test_vllm_serves_named_adapters_beside_the_policy(tiny_models, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCH_COMPILE_DISABLE", "1")):
        os.environ.setdefault(k, v)
    (ta, ma), (tb, _) = _adapter(tiny_models.policy, 1), _adapter(tiny_models.policy, 2)
    config = {"r": 4, "lora_alpha": 8.0, "target_modules": TARGETS}
    greedy = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True, raw_logprobs=True, prompt_logprobs=0)

    async def main():
        eng = VllmEngine(tiny_models.policy, "tiny:policy", mode="inproc", max_adapters=2)
        await eng.start()
        try:
            assert await eng.load_adapter("a", ta, config) == ["a"]
            await eng.load_adapter("b", tb, config)
            named = (await eng.generate([PROMPT], SamplingOptions(**{**greedy.__dict__, "adapter": "a"})))[0]
            plain = (await eng.generate([PROMPT], greedy))[0]
            with pytest.raises(InvalidArgument, match="raw_logprobs"):
                await eng.generate([PROMPT], SamplingOptions(max_tokens=2, temperature=0.7, raw_logprobs=True))
            with pytest.raises(InvalidArgument, match="do not match"):
                await eng.load_adapter("bad", ta, {**config, "r": 8})
            folders = sorted(p.name for p in eng.named.root.iterdir())  # a's, b's
            pinned = eng.named.store.pin("a")  # a request on a: a is in use and the most recently used, b goes
            held = await eng.load_adapter("c", tb, config)
            eng.named.store.unpin(pinned)
            await asyncio.sleep(0.5)  # the unload runs as a task
            loras = await eng._call(lambda llm: llm.list_loras())
            left = sorted(p.name for p in eng.named.root.iterdir())
            with pytest.raises(NotFound, match="'b'"):
                await eng.generate([PROMPT], SamplingOptions(max_tokens=2, adapter="b"))
            return named, plain, held, loras, folders, left
        finally:
            await eng.close()

    named, plain, held, loras, folders, left = asyncio.run(main())
    s = named.samples[0]
    want_prompt, want = _forward_logprobs(ma, PROMPT, s.token_ids)
    assert s.logprobs == pytest.approx(want, abs=2e-4)
    assert named.prompt_logprobs[1:] == pytest.approx(want_prompt, abs=2e-4)
    base = _forward_logprobs(load_causal_lm(tiny_models.policy).eval(), PROMPT, plain.samples[0].token_ids)[1]
    assert plain.samples[0].logprobs == pytest.approx(base, abs=2e-4)
    assert held == ["a", "c"] and len(loras) == 2  # b unloaded from vLLM...
    assert folders[1] not in left and folders[0] in left and len(left) == 2  # ...and from disk
