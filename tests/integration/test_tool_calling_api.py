"""Tool calling through the rollout service's /v1/chat/completions with the official ``openai`` client (a real
process on loopback, the hf engine): ``tools`` rendered by the chat template, hermes ``<tool_call>`` blocks parsed
into ``message.tool_calls`` (``finish_reason: tool_calls``), token ids and log-probs for an outside agent loop, the
``tool`` turn rendered on the way back, ``tool_choice: none``, streaming, and the refusals.

The random tiny policy never writes a tool call, so the module first teaches it one: a few dozen Adam steps on the
tiny policy (about 2 s on the CPU) until greedy decoding writes the call for the weather question, with or without
the tools rendered, and answers the tool's result."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.models import load_tokenizer
from rlhf.tool_calls import template_messages
from tests.integration._procs import ServiceProc, write_config

MODEL = "tool-tiny"  # any name: the served model answers
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
QUESTION = [{"role": "user", "content": "what is the weather in Paris?"}]
CALL_TEXT = ' <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWER = " It is sunny."
GREEDY = dict(model=MODEL, temperature=0, max_tokens=100)


def _follow_up(call_id: str, arguments: str) -> list[dict]:
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": call_id},
    ]


def _render(tok, messages: list[dict], tools: list[dict] | None) -> list[int]:
    text = tok.apply_chat_template(template_messages(messages), tools=tools, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _teach_tool_call(policy_dir, out_dir) -> None:
    """Fine-tune the tiny policy on three turns (the call with tools shown, the same call without them, the answer
    after the tool's result) until greedy decoding reproduces them; save it as a model folder."""
    tok = load_tokenizer(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    turns = [
        (_render(tok, QUESTION, TOOLS), CALL_TEXT),
        (_render(tok, QUESTION, None), CALL_TEXT),
        (_render(tok, _follow_up("call_0", '{"city": "Paris"}'), TOOLS), ANSWER),
    ]
    rows = [(p, tok.encode(t, add_special_tokens=False) + [tok.eos_token_id]) for p, t in turns]
    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100)  # loss on the answers only
    for i, (p, t) in enumerate(rows):
        ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        mask[i, : len(p) + len(t)] = 1
        labels[i, len(p) : len(p) + len(t)] = torch.tensor(t)
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    # one thread: on a loaded 2-core machine two spinning OpenMP threads made these small steps 5x slower
    torch.set_num_threads(1)
    try:
        for step in range(200):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            if loss.item() < 0.02:  # past the point where greedy decoding reproduces every answer
                print(f"taught in {step} steps")
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 0.05, loss.item()
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)


@pytest.fixture(scope="module")
def taught(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("tool-policy") / "policy"
    _teach_tool_call(tiny_models.policy, out)
    return out


@pytest.fixture(scope="module")
def svc(taught, tmp_path_factory):
    logs = tmp_path_factory.mktemp("rollout-tools")
    cfg = write_config(
        logs / "rollout.yaml",
        {"actor_rollout_ref": {"actor_rollout": {"load": str(taught), "engine": "hf", "tool_call_parser": "hermes"}}},
    )
    # one torch thread: the tiny model decodes as fast, and far faster when other processes load the cores
    env = {"RLHF_ROLLOUT_ENGINE": "hf", "OMP_NUM_THREADS": "1"}
    with ServiceProc("rollout", cfg, logs, env=env) as p:
        yield p


@pytest.fixture(scope="module")
def client(svc):
    c = openai.OpenAI(base_url=svc.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tok(taught):
    return load_tokenizer(taught)


def test_a_tool_call_and_the_turn_after_it(client, tok):
    r = client.chat.completions.create(
        **GREEDY, messages=QUESTION, tools=TOOLS, logprobs=True, extra_body={"return_token_ids": True}
    )
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls", choice
    msg = choice.message
    assert msg.role == "assistant" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    # token in, token out: the prompt as the template rendered it (tools included), the sampled ids and their
    # log-probs, one per token, which is what an agent loop outside needs to make a training record
    assert r.prompt_token_ids == _render(tok, QUESTION, TOOLS)
    ids = choice.token_ids
    assert tok.decode(ids, skip_special_tokens=True) == CALL_TEXT
    lps = choice.logprobs.content
    assert len(lps) == len(ids) == r.usage.completion_tokens
    assert all(math.isfinite(t.logprob) and t.logprob <= 0 for t in lps)
    assert r.usage.prompt_tokens == len(r.prompt_token_ids)

    # the call goes back as the assistant turn, then the tool's result: the template renders both
    follow = _follow_up(call.id, call.function.arguments)
    follow[1] = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    r2 = client.chat.completions.create(**GREEDY, messages=follow, tools=TOOLS, extra_body={"return_token_ids": True})
    assert r2.prompt_token_ids == _render(tok, follow, TOOLS)
    (c2,) = r2.choices
    assert (c2.finish_reason, c2.message.content, c2.message.tool_calls) == ("stop", ANSWER, None)


def test_tool_choice_none_and_no_tools_leave_the_text_alone(client, tok):
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        r = client.chat.completions.create(**GREEDY, messages=QUESTION, **kw, extra_body={"return_token_ids": True})
        assert r.prompt_token_ids == _render(tok, QUESTION, None), kw  # the tools are not rendered
        (choice,) = r.choices
        # the taught model writes the block anyway: it is text, not a call
        assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None), kw
        assert choice.message.content == CALL_TEXT, kw
    # tool_choice auto is the default with tools
    auto = client.chat.completions.create(
        **GREEDY, messages=QUESTION, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False
    )
    assert auto.choices[0].finish_reason == "tool_calls" and len(auto.choices[0].message.tool_calls) == 1


def test_streamed_tool_call(client, tok):
    calls: dict[int, dict] = {}
    content, finish, logprobs, ids, prompt_ids = "", None, 0, [], []
    stream = client.chat.completions.create(
        **GREEDY, messages=QUESTION, tools=TOOLS, logprobs=True, stream=True, extra_body={"return_token_ids": True}
    )
    for ev in stream:
        (c,) = ev.choices
        prompt_ids.append((ev.model_extra or {}).get("prompt_token_ids"))
        content += c.delta.content or ""
        logprobs += len(c.logprobs.content) if c.logprobs else 0
        ids += (c.model_extra or {}).get("token_ids") or []
        for d in c.delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            slot["name"] += d.function.name or ""
            slot["arguments"] += d.function.arguments or ""
        finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0] and calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert logprobs == len(ids) > 10  # the log-probs and token ids still stream token by token
    assert tok.decode(ids, skip_special_tokens=True) == CALL_TEXT
    # vLLM's shape: the prompt's ids in the first chunk only
    assert prompt_ids[0] == _render(tok, QUESTION, TOOLS) and not any(prompt_ids[1:])


def test_refusals_name_the_field(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [
        (openai.BadRequestError, dict(tools=TOOLS, tool_choice="required"), "tool_choice"),
        (openai.BadRequestError, dict(tools=TOOLS, tool_choice=named), "tool_choice"),
        (openai.UnprocessableEntityError, dict(tools=[]), "tools"),
        (openai.UnprocessableEntityError, dict(tools=[{"type": "retrieval"}]), "tools[0].type"),
    ]
    for exc, kw, param in cases:
        with pytest.raises(exc) as info:
            client.chat.completions.create(**GREEDY, messages=QUESTION, **kw)
        assert info.value.param == param, (kw, info.value.body)
        assert info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        bad = [{"role": "user", "content": "hi", "tool_calls": _follow_up("c", "{}")[1]["tool_calls"]}]
        client.chat.completions.create(**GREEDY, messages=bad)
    assert info.value.param == "messages[0].tool_calls"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**GREEDY, messages=QUESTION, tools=TOOLS, tool_choice="required")
    assert "does not constrain decoding" in info.value.body["message"]
