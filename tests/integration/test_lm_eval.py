"""lm-eval (EleutherAI's lm-evaluation-harness, ``local-completions``) against a real rollout service on loopback:
a loglikelihood task and a generate_until task written here as YAML over a tiny local jsonl (nothing downloaded),
run through lm-eval's Python API, with the loglikelihoods checked against a direct forward of the tiny policy.

The wire shape under test is vLLM's: ``echo: true`` with ``logprobs: k`` answers the prompt tokens' log-probs (the
first null) before the generated ones, and ``max_tokens: 0`` scores the prompt alone. Both engines compute them."""

from __future__ import annotations

import json
import math

import httpx
import lm_eval  # the `eval` extra, which `make setup` installs: the test fails rather than skips without it
import pytest
import torch
from lm_eval.tasks import TaskManager

from rlhf.models import load_causal_lm, load_tokenizer
from services.cli import main
from tests.integration._procs import REPO, ServiceProc

CONFIG = REPO / "configs/demo.yaml"
MODEL = "tiny:policy"
DOCS = [
    {"question": "what is 1 plus 2?", "answer": "3"},
    {"question": "what is 2 plus 2?", "answer": "4"},
    {"question": "name a colour", "answer": "red"},
]


@pytest.fixture(scope="module")
def stack(tiny_models, tmp_path_factory):
    """A rollout service per engine and a reward service (the demo's rule), started together."""
    logs = tmp_path_factory.mktemp("lm-eval")
    procs = {
        "hf": ServiceProc("rollout", CONFIG, logs, env={"RLHF_ROLLOUT_ENGINE": "hf"}),
        "vllm": ServiceProc("rollout", CONFIG, logs, env={"RLHF_ROLLOUT_ENGINE": "vllm"}),
        "reward": ServiceProc("reward", CONFIG, logs),
    }
    try:
        for proc in procs.values():
            proc.start(wait_ready=False)
        for proc in procs.values():
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(params=["hf", "vllm"])
def svc(request, stack):
    return stack[request.param]


@pytest.fixture(scope="module")
def policy(tiny_models):
    return load_tokenizer(tiny_models.policy), load_causal_lm(tiny_models.policy, device="cpu").eval()


def _direct(policy, ids: list[int]) -> list[float]:
    """log p(ids[j] | ids[:j]) for j >= 1 by one plain forward of the policy (temperature 1)."""
    _, model = policy
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_echo_returns_prompt_logprobs_in_vllms_shape(svc, policy):
    tok, _ = policy
    ids = tok.encode("User: what is 1 plus 2?\nAssistant: 3", add_special_tokens=False)
    want = _direct(policy, ids)
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 2, "temperature": 0}
    with httpx.Client(base_url=svc.http_url, timeout=60) as http:
        only = http.post("/v1/completions", json={**body, "max_tokens": 0}).json()
        plus = http.post("/v1/completions", json={**body, "max_tokens": 1}).json()
        lp = only["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert only["usage"]["completion_tokens"] == 0 and only["choices"][0]["text"] == tok.decode(ids)
        assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], want, strict=True)) < 1e-4
        for t, v, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            # the prompt token and its 2 most probable alternatives (distinct ids may share a text)
            assert 1 <= len(top) <= 3 and top[t] == v and max(top.values()) >= v
        # lm-eval's request (max_tokens 1): the prompt's entries, then the generated token's
        lp1 = plus["choices"][0]["logprobs"]
        assert len(lp1["token_logprobs"]) == len(ids) + 1 and lp1["token_logprobs"][: len(ids)] == pytest.approx(
            [None, *lp["token_logprobs"][1:]], abs=1e-5
        )
        assert lp1["text_offset"][-1] == len(tok.decode(ids))  # the generated text starts after the echo
        # what cannot be answered is refused, naming the field
        r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["field"] == "max_tokens"
        r = http.post("/v1/completions", json={**body, "max_tokens": 0, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["field"] == "max_tokens"
        # streamed: the prompt and its entries come in the first chunk, with the first tokens; the pieces add up to
        # the answer given whole (greedy)
        more = {**body, "max_tokens": 6, "ignore_eos": True}
        whole = http.post("/v1/completions", json=more).json()["choices"][0]
        r = http.post("/v1/completions", json={**more, "stream": True})
        chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks]
        assert len(choices) > 1 and choices[0]["text"].startswith(tok.decode(ids))
        assert len(choices[0]["logprobs"]["tokens"]) > len(ids)  # the prompt's entries and the first token's
        assert "".join(c["text"] for c in choices) == whole["text"]
        streamed = {k: [x for c in choices if c["logprobs"] for x in c["logprobs"][k]] for k in whole["logprobs"]}
        assert streamed["tokens"] == whole["logprobs"]["tokens"]
        assert streamed["text_offset"] == whole["logprobs"]["text_offset"]
        assert streamed["token_logprobs"] == pytest.approx(whole["logprobs"]["token_logprobs"], abs=1e-5)


TASK_LL = """
task: tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "User: {{{{question}}}}\\nAssistant:"
doc_to_target: " {{{{answer}}}}"
metric_list:
  - metric: perplexity
  - metric: acc
"""

TASK_GEN = """
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "User: {{{{question}}}}\\nAssistant:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  temperature: 0
metric_list:
  - metric: exact_match
"""


def test_lm_eval_local_completions(svc, policy, tiny_models, tmp_path):
    tok, _ = policy
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tiny_ll.yaml").write_text(TASK_LL.format(data=data))
    (tmp_path / "tiny_gen.yaml").write_text(TASK_GEN.format(data=data))
    model_args = {
        "model": MODEL,
        "base_url": svc.http_url + "/v1/completions",
        "tokenizer": str(tiny_models.policy),
        "tokenizer_backend": "huggingface",
        "tokenized_requests": True,  # token ids on the wire, as lm-eval's default
        "max_length": 512,
        "max_retries": 1,
        "batch_size": 4,  # several prompts per request
    }
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["tiny_ll", "tiny_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,  # no stderr resampling: seconds of CPU for nothing checked here
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )
    ll, gen = out["results"]["tiny_ll"], out["results"]["tiny_gen"]
    assert math.isfinite(ll["perplexity,none"]) and ll["perplexity,none"] > 1 and 0 <= ll["acc,none"] <= 1
    assert 0 <= gen["exact_match,none"] <= 1
    # every loglikelihood is the policy's own: the continuation tokens' log-probs summed, by a direct forward
    samples = out["samples"]["tiny_ll"]
    assert len(samples) == len(DOCS)
    for s in samples:
        ((ctx, cont),) = s["arguments"]
        whole = tok.encode(ctx + cont, add_special_tokens=False)
        n_ctx = len(tok.encode(ctx, add_special_tokens=False))
        want = sum(_direct(policy, whole)[n_ctx - 1 :])
        got, _greedy = s["resps"][0][0]
        assert got == pytest.approx(want, abs=1e-3), (ctx, cont)
    # one generated answer per doc (the tiny random policy's text: exact_match above is a real number, not a score)
    gens = out["samples"]["tiny_gen"]
    assert len(gens) == len(DOCS) and all(isinstance(g["resps"][0][0], str) for g in gens)


EVAL_PROMPTS = [{"prompt": f"what is {a} plus {b}?", "label": str(a + b)} for a, b in ((1, 2), (3, 4), (5, 6))]


def test_rlhf_eval_writes_the_trainers_eval_rows(stack, tmp_path, capsys):
    """``rlhf eval --rollout --reward``: the eval section through running services, reported as the trainer's
    evaluation reports (a metrics.jsonl row of eval/* metrics, TensorBoard), the row on stdout."""
    data = tmp_path / "heldout.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in EVAL_PROMPTS))
    out = tmp_path / "run"
    fields = [f"eval.path={data}", "eval.n=2", "eval.temperature=1.0", "eval.max_new_tokens=4"]
    rollout, reward = stack["hf"].grpc_addr, stack["reward"].grpc_addr
    rc = main(["eval", "--config", str(CONFIG), "--rollout", rollout, "--reward", reward, "--out", str(out), *fields])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert json.loads(cap.out.strip().splitlines()[-1]) == row
    assert row["step"] == 0 and row["eval/prompts"] == 3 and row["eval/samples"] == 6
    assert 0 <= row["eval/reward_mean"] <= 1 and 0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= 1
    assert 1 <= row["eval/response_length_mean"] <= 4 and row["eval/failed_fraction"] == 0
    assert row["eval/policy_version"] == 0 and any((out / "tensorboard").iterdir())
    assert "generating 3 prompts x 2 samples" in cap.err and "scoring 6 samples" in cap.err
    # what cannot run says why, with exit 2 and nothing written
    rc = main(["eval", "--config", str(CONFIG), "--rollout", rollout, "--reward", reward, "--out", str(tmp_path / "x")])
    assert rc == 2 and "eval.path" in capsys.readouterr().err
    rc = main(["eval", "--config", str(CONFIG), "--checkpoint", str(tmp_path / "none"), *fields])
    assert rc == 2 and "--checkpoint" in capsys.readouterr().err
