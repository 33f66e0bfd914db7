"""The rollout service's REST API through the official ``openai`` client (the hf engine on the tiny policy, a real
process on loopback): completions and chat completions (the chat template), streaming both (token by token on hf),
echo, top_logprobs, n / best_of, frequency / presence / repetition penalties, stop, seed, user, and OpenAI's error
body (``openai.BadRequestError`` with ``param`` set)."""

from __future__ import annotations

import math
import re
import time

import httpx
import openai
import pytest

from rlhf.models import load_tokenizer
from tests.integration._procs import REPO, ServiceProc

CONFIG = "configs/demo.yaml"
MODEL = "tiny:policy"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 1 plus 2?"}]


@pytest.fixture(scope="module")
def svc(tiny_models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("rollout-openai")
    with ServiceProc("rollout", REPO / CONFIG, logs, env={"RLHF_ROLLOUT_ENGINE": "hf"}) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(svc):
    c = openai.OpenAI(base_url=svc.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return load_tokenizer(tiny_models.policy)


def test_completions_echo_logprobs_and_seed(client):
    kw = dict(model=MODEL, prompt="User: what is 1 plus 2?\nAssistant:", max_tokens=8, seed=3, user="someone")
    a = client.completions.create(**kw, logprobs=3)
    b = client.completions.create(**kw)
    (ca,), (cb,) = a.choices, b.choices
    assert a.object == "text_completion" and a.model == MODEL and ca.text == cb.text  # seeded: reproducible
    lp = ca.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == a.usage.completion_tokens
    for sampled, alts in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        # real alternatives: up to 3 (distinct ids can decode to the same text), the most probable of the
        # distribution sampled from, so at least as probable as the sampled token... unless it is the top one
        assert 1 <= len(alts) <= 3 and all(v <= 0 for v in alts.values())
        assert max(alts.values()) >= sampled - 1e-5
    echoed = client.completions.create(**kw, echo=True)
    assert echoed.choices[0].text == kw["prompt"] + cb.text


def test_chat_uses_the_chat_template(client, tokenizer):
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, seed=5, logprobs=True, top_logprobs=2
    )
    (choice,) = chat.choices
    assert chat.object == "chat.completion" and choice.message.role == "assistant"
    # the same sample as a completion of the rendered conversation (same seed): the template was applied
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, seed=5)
    assert choice.message.content == plain.choices[0].text
    assert chat.usage.prompt_tokens == len(ids)
    content = choice.logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    assert all(bytes(c.bytes).decode("utf-8", "replace") == c.token for c in content if c.bytes is not None)


def test_streaming_completions_token_by_token(client):
    kw = dict(model=MODEL, prompt="User: count to ten\nAssistant:", max_tokens=12, seed=11, n=2)
    whole = client.completions.create(**kw)
    texts, finish, chunks = ["", ""], [None, None], [0, 0]
    stream = client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    usage = None
    for ev in stream:
        assert ev.object == "text_completion"
        if ev.usage is not None:
            usage = ev.usage
        for c in ev.choices:
            texts[c.index] += c.text
            chunks[c.index] += 1
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    assert min(chunks) > 2, chunks  # the hf engine streams tokens as they are decoded, not one final chunk
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_chat_and_stop_strings(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=16, seed=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    assert len(whole) > 4
    stop = whole[2:4]  # a stop string that occurs: the text ends before its first occurrence
    cut = client.chat.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == whole[: whole.find(stop)]

    for stop_kw, want in (({}, whole), ({"stop": [stop]}, cut.message.content)):
        parts, roles, finish = [], [], None
        for ev in client.chat.completions.create(**kw, **stop_kw, stream=True):
            assert ev.object == "chat.completion.chunk"
            (c,) = ev.choices
            roles += [c.delta.role] if c.delta.role else []
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
        assert roles == ["assistant"] and "".join(parts) == want  # held-back text never leaks a stop string
        assert finish == ("stop" if stop_kw else "length")


def _greedy(client, **kw) -> tuple[list[int], list[int]]:
    prompt = "User: repeat after me: la la la la\nAssistant:"
    extra = {"return_token_ids": True, "ignore_eos": True, **kw}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra)
    c = r.choices[0]
    return c.prompt_token_ids, c.token_ids


def test_penalties_change_greedy_decoding(client):
    prompt, plain = _greedy(client)
    assert len(set(plain)) < len(plain), "precondition: the tiny model repeats tokens when greedy"
    # the tiny model's logits are within ~1 of each other: a penalty of 2 per occurrence rules repeats out
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        _, toks = _greedy(client, **kw)
        assert len(set(toks)) == len(toks), (kw, toks)
    # repetition: prompt tokens are penalized too (logits are positive and negative here: divided or multiplied)
    _, toks = _greedy(client, repetition_penalty=10.0)
    assert toks != plain and not set(toks) & set(prompt) and len(set(toks)) == len(toks), toks
    # a small penalty keeps the decoding greedy and deterministic
    assert _greedy(client, frequency_penalty=0.01) == _greedy(client, frequency_penalty=0.01)


def test_best_of_returns_the_most_probable_samples(client):
    kw = dict(model=MODEL, prompt="User: hello\nAssistant:", max_tokens=6, seed=21, logprobs=0)
    every = client.completions.create(**kw, n=5).choices  # sample j uses seed + j, as under best_of
    by_score = sorted(every, key=lambda c: math.fsum(c.logprobs.token_logprobs), reverse=True)
    best = client.completions.create(**kw, n=2, best_of=5)
    assert [c.text for c in best.choices] == [c.text for c in by_score[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in every)  # all 5 were generated


def test_errors_are_openai_errors_with_param(client):
    cases = [
        (openai.BadRequestError, dict(prompt="hi", max_tokens=100000), "max_tokens"),
        (openai.BadRequestError, dict(prompt="hi", n=3, best_of=2), "best_of"),
        (openai.BadRequestError, dict(prompt="hi", best_of=3, stream=True), "best_of"),
        (openai.BadRequestError, dict(prompt="hi", max_tokens=0), "max_tokens"),
        (openai.BadRequestError, dict(prompt=[2, 5, 600]), "prompt[2]"),
        (openai.BadRequestError, dict(prompt="hi", stream_options={"include_usage": True}), "stream_options"),
        (openai.UnprocessableEntityError, dict(prompt="hi", logit_bias={"5": 1}), "logit_bias"),
        (openai.UnprocessableEntityError, dict(prompt="hi", presence_penalty=3), "presence_penalty"),
        (
            openai.UnprocessableEntityError,
            dict(prompt="hi", extra_body={"repetition_penalty": 0}),
            "repetition_penalty",
        ),
    ]
    for exc, kw, param in cases:
        with pytest.raises(exc) as info:
            client.completions.create(model=MODEL, **kw)
        err = info.value
        assert err.param == param and err.body["field"] == param, (kw, err.body)
        assert err.status_code == err.body["code"] and err.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2)
    assert info.value.param == "top_logprobs"
    with pytest.raises(openai.UnprocessableEntityError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    assert info.value.param == "messages[0].role"
    # streams refuse bad input before the first byte: an error status, not an event
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=100000, stream=True)
    assert info.value.param == "max_tokens"
    # and the service still answers
    assert client.models.list().data[0].id == MODEL


def test_a_stream_closed_early_stops_its_generation(svc, client):
    """A client that stops reading a stream and closes it cancels the hf rows still decoding (the engine's steps
    stop counting them), and the service keeps serving."""

    def engine_rows() -> float:  # sequences per engine step, summed
        m = re.search(
            r'^rlhf_batch_size_sum\{[^}]*method="engine_step"[^}]*\} (\S+)$',
            httpx.get(svc.http_url + "/metrics").text,
            re.M,
        )
        return float(m.group(1)) if m else 0.0

    before = engine_rows()
    stream = client.completions.create(
        model=MODEL, prompt="hi", n=16, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    assert first.choices and first.object == "text_completion"
    stream.close()
    time.sleep(1.5)
    settled = engine_rows()
    time.sleep(1.5)
    assert engine_rows() == settled, (before, settled)
    assert settled - before < 16 * 400 / 2, (before, settled)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason == "length"
