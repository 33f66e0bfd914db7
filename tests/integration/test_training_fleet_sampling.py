"""Sampling through the fleet: ``rlhf serve training`` with ``RLHF_ROLLOUT_ADDRS`` naming a real ``rlhf serve
rollout`` replica (hf engine, then vllm), driven by the tinker SDK. What it must show: a sampler over saved weights
(LoRA on lm_head too, the SDK's default) is answered by the replica (its count of Generate calls answered OK rises),
its sampled and prompt log-probs equal the training forward to 1e-4, a sampler made before a later optim_step + save
keeps sampling its own version, an adapter the replica evicted (it holds two) is pushed again when it is sampled, and
what the replica cannot serve is sampled in-process."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from rlhf.procs import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "tml-fleet-0123456789"
BASE = "tiny:policy"
PROMPT = [7, 8, 9]
TARGET = [42] * 8
LR = 1e-2


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


@pytest.fixture(scope="module", params=["hf", "vllm"])
def services(request, tmp_path_factory, tiny_models):
    from tests.integration._procs import ServiceProc, write_config  # noqa: PLC0415 - test helper

    if request.param == "vllm":
        pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("fleet")
    env = {"RLHF_API_TOKEN": TOKEN, "RLHF_ROLLOUT_ENGINE": request.param, "RLHF_ROLLOUT_MAX_ADAPTERS": "2"}
    rollout = ServiceProc("rollout", REPO / "configs/demo.yaml", tmp / "rollout-logs", env=env).start(timeout=120)
    cfg = write_config(
        tmp / "training.yaml",
        {
            "run_id": "tinker",
            "training": {"save": str(tmp / "checkpoints"), "device": "cpu"},
            "actor_rollout_ref": {"actor_rollout": {"load": BASE}},
        },
    )
    env = {"RLHF_API_TOKEN": TOKEN, "RLHF_ROLLOUT_ADDRS": rollout.grpc_addr}
    training = ServiceProc("training", cfg, tmp / "training-logs", env=env).start(timeout=120)
    yield training, rollout, request.param
    training.stop()
    rollout.stop()


def _calls(rollout, method: str, code: str = "OK") -> float:
    """The replica's count of ``method`` calls answered with ``code``, from its Prometheus metrics."""
    text = httpx.get(rollout.http_url + "/metrics", timeout=30).text
    total = 0.0
    for labels, value in re.findall(r"^rlhf_requests_total{([^}]*)} ([0-9.e+]+)$", text, flags=re.MULTILINE):
        if f'method="{method}"' in labels and f'code="{code}"' in labels:
            total += float(value)
    return total


def _train(tc, tokens: list[int], steps: int) -> None:
    for _ in range(steps):
        fb = tc.forward_backward([_datum(tokens)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=LR)).result()
        fb.result()


def _target_logprob(sampler) -> float:
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT + TARGET)).result()
    return float(sum(lps[len(PROMPT) :]))


def _check_logprobs(tc, out) -> None:
    """Each sampled token's log-prob and the prompt's equal the training forward of the same tokens."""
    fwd = tc.forward([_datum(PROMPT + s.tokens) for s in out.sequences], "cross_entropy").result()
    for seq, o in zip(out.sequences, fwd.loss_fn_outputs, strict=True):
        lp = o["logprobs"].to_numpy()
        np.testing.assert_allclose(seq.logprobs, lp[len(PROMPT) - 1 :], atol=1e-4)
        if out.prompt_logprobs is not None:
            np.testing.assert_allclose(out.prompt_logprobs[1:], lp[: len(PROMPT) - 1], atol=1e-4)


def test_samplers_are_answered_by_the_replica_each_on_its_own_version(services):
    training, rollout, engine = services
    # vLLM (0.32, CPU) cannot give the prompt's log-probs of n > 1 samples under an lm_head LoRA: it refuses them
    plp = engine == "hf"
    service = tinker.ServiceClient(base_url=training.http_url, api_key=TOKEN)
    tc = service.create_lora_training_client(base_model=BASE, rank=8, seed=2).result()  # train_unembed: lm_head
    prompt = types.ModelInput.from_ints(PROMPT)
    greedy = types.SamplingParams(max_tokens=len(TARGET), temperature=0.0, stop=[])
    hot = types.SamplingParams(max_tokens=len(TARGET), temperature=1.0, seed=3, stop=[])

    base = service.create_sampling_client(base_model=BASE).result()
    calls = _calls(rollout, "Generate")
    base_greedy = base.sample(prompt, 1, greedy).result().sequences[0].tokens
    assert _calls(rollout, "Generate") == calls  # the base model's samplers sample in-process
    assert base_greedy != TARGET

    _train(tc, PROMPT + TARGET, 10)
    v1 = tc.save_weights_and_get_sampling_client().result()
    assert v1.sample(prompt, 1, greedy).result().sequences[0].tokens == TARGET
    out = v1.sample(prompt, 4, hot, include_prompt_logprobs=plp).result()
    assert _calls(rollout, "Generate") == calls + 2  # both answered by the replica
    assert _calls(rollout, "LoadAdapter") >= 1
    assert len(out.sequences) == 4 and all(len(s.tokens) == len(TARGET) for s in out.sequences)
    _check_logprobs(tc, out)

    # a named sampler checkpoint of v1, more steps away from TARGET and another snapshot: three adapters for a replica
    # that holds two, so v1's is evicted and pushed again when v1 samples; v1 and the named one keep v1's weights
    path = tc.save_weights_for_sampler("v1").result().path
    named = service.create_sampling_client(model_path=path).result()
    named_out = named.sample(prompt, 2, hot, include_prompt_logprobs=plp).result()
    _check_logprobs(tc, named_out)
    _train(tc, PROMPT + [43] * 8, 3)
    v2 = tc.save_weights_and_get_sampling_client().result()
    # compute_logprobs (prompt log-probs) on the replica: v2 moved away, the named v1 did not
    assert _target_logprob(v2) < _target_logprob(named) - 1
    loads = _calls(rollout, "LoadAdapter")
    later = v1.sample(prompt, 4, hot, include_prompt_logprobs=plp).result()
    assert _calls(rollout, "LoadAdapter") == loads + 1  # evicted, pushed again
    assert [s.tokens for s in later.sequences] == [s.tokens for s in out.sequences]
    for a, b in zip(later.sequences, out.sequences, strict=True):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert v1.sample(prompt, 1, greedy).result().sequences[0].tokens == TARGET
    assert _calls(rollout, "Generate") >= calls + 6
    # parameters the replicas bound more tightly than the SDK: sampled in-process, still from v1's weights
    calls = _calls(rollout, "Generate")
    wild = v1.sample(prompt, 2, types.SamplingParams(max_tokens=3, temperature=3.0, seed=1, stop=[])).result()
    assert len(wild.sequences) == 2 and _calls(rollout, "Generate") == calls
    if engine == "vllm":  # prompt log-probs of 2 samples: refused by the replica, answered in-process
        refused = _calls(rollout, "Generate", "INVALID_ARGUMENT")
        both = v1.sample(prompt, 2, hot, include_prompt_logprobs=True).result()
        assert both.prompt_logprobs is not None and _calls(rollout, "Generate") == calls
        assert _calls(rollout, "Generate", "INVALID_ARGUMENT") == refused + 1
    with pytest.raises(tinker.BadRequestError, match="sampling_params.top_k"):
        v1.sample(prompt, 1, types.SamplingParams(max_tokens=4, top_k=0)).result()
