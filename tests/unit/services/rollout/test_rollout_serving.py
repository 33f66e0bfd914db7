"""The rollout's serving classes (services.rollout.serving*), in-process against one fake engine: completions (echo,
prompt log-probs, best_of, max_tokens 0), chat (template, tools, tool-call parsing), their streams (held-back text,
the last chunk's fields, usage, an error after the first byte) and the refusals; then the routes over the same fake.
The wire through a real process and a real model is tests/integration/test_rollout_openai.py and its neighbours."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import pytest

from rlhf.serving import InvalidArgument, NotReady, ServiceMetrics, ServiceSettings
from services.rollout.engine_types import PromptResult, Sample, StreamEvent
from services.rollout.http_app import build_app
from services.rollout.openai_protocol import ChatCompletionRequest, CompletionRequest
from services.rollout.options import SamplingOptions
from services.rollout.serving_chat import OpenAIServingChat
from services.rollout.serving_completion import OpenAIServingCompletion

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
LAST_CHAT_KEYS = ("index", "delta", "logprobs", "finish_reason", "token_ids", "stop_reason", "policy_version")
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


class FakeTokenizer:
    """Byte-level: one token per UTF-8 byte, so a character of several bytes is split across tokens. Its chat
    template writes ``<role>content`` per message, the tools when it renders them, then ``<assistant>``."""

    def __init__(self) -> None:
        self.chat_template: str | None = "fake"
        self.renders_tools = True

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, conv: list[dict[str, Any]], tools: Any, add_generation_prompt: bool, tokenize: bool):
        if any(m["content"] == "refuse me" for m in conv):
            raise ValueError("no such message")
        text = "".join(f"<{m['role']}>{m['content']}" for m in conv)
        if tools and self.renders_tools:
            text += "<tools>" + json.dumps(tools)
        return text + "<assistant>"


class FakeEngine:
    """The one fake engine of these tests: sample j of every prompt is ``replies[j]`` (cut at max_tokens or at a
    stop string), each of its tokens with log-prob ``-1 / (j + 1)`` (later samples are more probable) and the
    alternatives ``token + 1``, ``token + 2``...; streamed ``step`` tokens per event (the prompt's log-probs on each
    sample's first), with their text when ``detokenizes`` (as the vLLM engine: pieces of the final text, which
    an ASCII reply has one character per token). ``fail_after``: the stream raises after that many events."""

    kind = "fake"
    model_name = "fake-model"
    weights_version = 7
    weights_checksum = "sha256:fake"
    loaded_at_unix_ms = 1

    def __init__(self, replies: list[str]):
        self.tokenizer = FakeTokenizer()
        self.replies = replies
        self.defaults: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16, "stop": ()}
        self.ready = True
        self.fail_after: int | None = None
        self.step = 1
        self.detokenizes = False
        self.calls: list[tuple[list[list[int]], SamplingOptions]] = []

    def check_ready(self) -> None:
        if not self.ready:
            raise NotReady("loading")

    async def encode_texts(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer.encode(t) for t in texts]

    def validate(self, prompts: list[list[int]], opts: SamplingOptions, field: str = "prompt") -> SamplingOptions:
        if opts.max_tokens > 1000:
            raise InvalidArgument("max_tokens must be below the context", field="max_tokens")
        return opts

    def _sample(self, j: int, opts: SamplingOptions) -> Sample:
        reply = self.replies[j % len(self.replies)]
        ids = self.tokenizer.encode(reply)[: opts.max_tokens]
        text, finish, reason = self.tokenizer.decode(ids), "length" if len(ids) < len(reply.encode()) else "stop", None
        for s in opts.stop:
            if s in text:
                text, finish, reason = text[: text.find(s)], "stop", s
        lp = -1.0 / (j + 1)
        top = [[(t + k, lp - k) for k in range(opts.top_logprobs)] for t in ids] if opts.top_logprobs else None
        return Sample(ids, [lp] * len(ids), finish, text, self.weights_version, reason, top)

    def _result(self, prompt: list[int], opts: SamplingOptions) -> PromptResult:
        r = PromptResult(list(prompt), [self._sample(j, opts) for j in range(opts.n)])
        if opts.prompt_logprobs is not None:
            r.prompt_logprobs = [None] + [-0.5] * (len(prompt) - 1)
            r.prompt_top_logprobs = [None] + [[(0, -0.25)] for _ in prompt[1:]]
        return r

    async def generate(self, prompts: list[list[int]], opts: SamplingOptions, *, field: str = "prompt"):
        self.check_ready()
        opts = self.validate(prompts, opts, field)
        self.calls.append((prompts, opts))
        return [self._result(p, opts) for p in prompts]

    async def generate_stream(self, prompts: list[list[int]], opts: SamplingOptions, *, field: str = "prompt"):
        sent = 0
        for i, r in enumerate(await self.generate(prompts, opts, field=field)):
            for j, s in enumerate(r.samples):
                for k in range(0, len(s.token_ids), self.step):
                    if sent == self.fail_after:
                        raise RuntimeError("the engine died")
                    sent += 1
                    end = k + self.step
                    top = None if s.top_logprobs is None else s.top_logprobs[k:end]
                    last = end >= len(s.token_ids)
                    first = (
                        {}
                        if k
                        else {"prompt_logprobs": r.prompt_logprobs, "prompt_top_logprobs": r.prompt_top_logprobs}
                    )
                    text = (s.text[k:] if last else s.text[k:end]) if self.detokenizes else None
                    yield StreamEvent(
                        i, j, s.token_ids[k:end], s.logprobs[k:end], top, s if last else None, text=text, **first
                    )


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine(["hello world", "good day", "a longer reply"])


@pytest.fixture
def metrics() -> ServiceMetrics:
    return ServiceMetrics("rollout")


def completions(engine: FakeEngine, metrics: ServiceMetrics, **body: Any):
    serving = OpenAIServingCompletion(engine, metrics)  # type: ignore[arg-type]
    return asyncio.run(serving.create_completion(CompletionRequest(**body)))


def chat(engine: FakeEngine, metrics: ServiceMetrics, **body: Any):
    serving = OpenAIServingChat(engine, metrics)  # type: ignore[arg-type]
    return asyncio.run(serving.create_chat_completion(ChatCompletionRequest(**body)))


def streamed(serving: Any, create: str, body: Any) -> list[Any]:
    """The SSE events of a streamed answer: each chunk as JSON, then "[DONE]"."""

    async def read() -> bytes:
        resp = await getattr(serving, create)(body)
        assert resp.media_type == "text/event-stream" and resp.headers["cache-control"] == "no-cache"
        return b"".join([c async for c in resp.body_iterator])

    raw = asyncio.run(read()).decode()
    assert raw.endswith("\n\n") and all(e.startswith("data: ") for e in raw[:-2].split("\n\n"))
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in raw[:-2].split("\n\n")]


def stream_completions(engine: FakeEngine, metrics: ServiceMetrics, **body: Any) -> list[Any]:
    serving = OpenAIServingCompletion(engine, metrics)  # type: ignore[arg-type]
    return streamed(serving, "create_completion", CompletionRequest(stream=True, **body))


def stream_chat(engine: FakeEngine, metrics: ServiceMetrics, **body: Any) -> list[Any]:
    serving = OpenAIServingChat(engine, metrics)  # type: ignore[arg-type]
    return streamed(serving, "create_chat_completion", ChatCompletionRequest(stream=True, **body))


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------------------------------ completions


def test_completion_echo_with_prompt_logprobs_and_token_ids(engine, metrics):
    r = completions(engine, metrics, prompt="ab", max_tokens=5, echo=True, logprobs=1, return_token_ids=True)
    (c,) = r.choices
    assert (c.text, c.finish_reason, c.index) == ("abhello", "length", 0)
    assert (c.token_ids, c.prompt_token_ids) == (list(b"hello"), list(b"ab"))
    lp = c.logprobs
    assert lp.tokens == list("abhello") and lp.text_offset == list(range(7))
    assert lp.token_logprobs == [None, -0.5] + [-1.0] * 5
    # the prompt's alternatives hold the prompt token too; the first prompt token has none
    assert lp.top_logprobs[:2] == [None, {"\x00": -0.25, "b": -0.5}] and lp.top_logprobs[2] == {"h": -1.0}
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (2, 5, 7)
    assert r.policy_version == c.policy_version == 7 and r.model == "fake-model" and r.id.startswith("cmpl-")
    assert engine.calls[0][1].prompt_logprobs == 1 and engine.calls[0][1].top_logprobs == 1


def test_completion_prompts_as_texts_and_ids(engine, metrics):
    r = completions(engine, metrics, prompt=["x", "yz"], n=2, max_tokens=4)
    assert [c.text for c in r.choices] == ["hell", "good", "hell", "good"]
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert engine.calls[0][0] == [[120], [121, 122]]
    r = completions(engine, metrics, prompt=[[1, 2], [3]], max_tokens=4, echo=True)
    assert [c.text for c in r.choices] == ["\x01\x02hell", "\x03hell"] and r.choices[0].logprobs is None


def test_best_of_keeps_the_most_probable_samples(engine, metrics):
    r = completions(engine, metrics, prompt="q", n=2, best_of=3, max_tokens=4)
    assert [c.text for c in r.choices] == ["a lo", "good"] and [c.index for c in r.choices] == [0, 1]
    assert engine.calls[0][1].n == 3 and r.usage.completion_tokens == 12  # all three were generated


def test_max_tokens_0_with_echo_scores_the_prompt_only(engine, metrics):
    r = completions(engine, metrics, prompt="abc", max_tokens=0, echo=True, logprobs=0)
    (c,) = r.choices
    assert (c.text, c.finish_reason, c.stop_reason) == ("abc", "length", None)
    assert c.logprobs.tokens == list("abc") and c.logprobs.token_logprobs == [None, -0.5, -0.5]
    assert c.logprobs.top_logprobs is None and r.usage.completion_tokens == 0
    assert engine.calls[0][1].max_tokens == 1  # one token is generated and dropped


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options", "applies to streams only"),
        ({"prompt": ["hi", ""]}, "prompt[1]", "the prompt is empty"),
        ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of", r"best_of \(2\) must be at least n \(3\)"),
        ({"prompt": "hi", "best_of": 2, "stream": True}, "best_of", "best_of > n cannot be streamed"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens: 0 needs echo"),
        ({"prompt": "hi", "max_tokens": 0, "echo": True, "stream": True}, "max_tokens", "0 cannot be streamed"),
        ({"prompt": "hi", "max_tokens": 1001, "stream": True}, "max_tokens", "below the context"),  # before the stream
    ],
)
def test_completion_refusals(engine, metrics, body, field, message):
    with pytest.raises(InvalidArgument, match=message) as info:
        completions(engine, metrics, **body)
    assert info.value.field == field and not engine.calls


def test_not_ready_is_refused_before_anything(engine, metrics):
    engine.ready = False
    with pytest.raises(NotReady):
        completions(engine, metrics, prompt="hi")
    with pytest.raises(NotReady):
        chat(engine, metrics, messages=user("hi"))


# ------------------------------------------------------------------------------------------------ completion streams


def test_completion_stream_is_the_answer_piece_by_piece(engine, metrics):
    whole = completions(engine, metrics, prompt=["p", "q"], n=2, max_tokens=9, logprobs=1, stop=["o w"])
    usage = {"include_usage": True}
    events = stream_completions(
        engine, metrics, prompt=["p", "q"], n=2, max_tokens=9, logprobs=1, stop=["o w"], stream_options=usage
    )
    assert events[-1] == "[DONE]"
    *chunks, used = events[:-1]
    head = {k: chunks[0][k] for k in ("id", "object", "created", "model")}
    assert head["object"] == "text_completion" and head["id"].startswith("cmpl-") and head["model"] == "fake-model"
    assert all({k: c[k] for k in head} == head for c in events[:-1])
    assert used == {**head, "choices": [], "usage": whole.usage.model_dump(), "policy_version": 7}
    texts, offsets = ["", "", "", ""], [[], [], [], []]
    for c in chunks:
        (ch,) = c["choices"]
        assert "o w" not in ch["text"]  # a stop string that has appeared is held back
        texts[ch["index"]] += ch["text"]
        offsets[ch["index"]] += ch["logprobs"]["text_offset"]
        if ch["finish_reason"] is None:
            assert set(ch) == {"index", "text", "logprobs", "finish_reason"}
        else:  # the last chunk of its choice
            assert set(ch) == {"index", "text", "logprobs", "finish_reason", "stop_reason", "policy_version"}
    assert texts == [c.text for c in whole.choices] == ["hell", "good day", "hell", "good day"]
    assert offsets == [c.logprobs.text_offset for c in whole.choices]
    last = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    ends = [(x["finish_reason"], x["stop_reason"], x["policy_version"]) for x in last]
    assert ends == [("stop", "o w", 7), ("stop", None, 7)] * 2


def test_completion_stream_holds_back_a_split_character_and_opens_with_the_echo(metrics):
    engine = FakeEngine(["é!"])  # two bytes, two tokens: the first decodes to U+FFFD
    events = stream_completions(engine, metrics, prompt="ab", echo=True, max_tokens=5)
    texts = [c["choices"][0]["text"] for c in events[:-1]]
    assert texts == ["ab", "", "é", "!"]  # a chunk per token (as vLLM): the first byte alone has no text
    assert "\ufffd" not in "".join(texts) and events[0]["choices"][0]["finish_reason"] is None


def test_completion_stream_with_echo_logprobs_and_token_ids(engine, metrics):
    """echo with logprobs streamed: each choice's first chunk holds the prompt, its log-probs and the first tokens (no
    opening chunk: the prompt's log-probs come from the engine); with return_token_ids the prompt's ids come in it
    too, and each chunk has its tokens. The pieces add up to the answer given whole."""
    kw = dict(prompt=["ab", "c"], n=2, max_tokens=5, echo=True, logprobs=1, return_token_ids=True)
    whole = completions(engine, metrics, **kw)
    engine.step = 2
    events = stream_completions(engine, metrics, **kw)
    assert events[-1] == "[DONE]"
    texts, ids, firsts = ["", "", "", ""], [[], [], [], []], {}
    lps: list[dict[str, list]] = [
        {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []} for _ in range(4)
    ]
    for c in events[:-1]:
        (ch,) = c["choices"]
        i = ch["index"]
        if i not in firsts:
            firsts[i] = ch
        else:
            assert "prompt_token_ids" not in ch
        texts[i] += ch["text"]
        ids[i] += ch["token_ids"]
        for key in lps[i]:
            lps[i][key] += ch["logprobs"][key]
    assert texts == [c.text for c in whole.choices] == ["abhello", "abgood ", "chello", "cgood "]
    assert ids == [c.token_ids for c in whole.choices]
    assert [firsts[i]["prompt_token_ids"] for i in range(4)] == [c.prompt_token_ids for c in whole.choices]
    assert [firsts[i]["text"] for i in range(4)] == ["abhe", "abgo", "che", "cgo"]  # the prompt and 2 tokens
    assert lps == [c.logprobs.model_dump() for c in whole.choices]
    assert lps[0]["token_logprobs"][:3] == [None, -0.5, -1.0]


def test_completion_stream_of_an_engine_that_detokenizes(engine, metrics):
    """An engine that sends each event's text (vLLM) is streamed as it sends it: one chunk per event."""
    engine.step, engine.detokenizes = 3, True
    whole = completions(engine, metrics, prompt="p", n=2, max_tokens=9, stop=["o w"])
    events = stream_completions(engine, metrics, prompt="p", n=2, max_tokens=9, stop=["o w"])
    pieces: list[list[str]] = [[], []]
    for c in events[:-1]:
        (ch,) = c["choices"]
        pieces[ch["index"]].append(ch["text"])
    assert pieces == [["hel", "l", ""], ["goo", "d d", "ay"]]  # the last: the finish reason, its text cut
    assert ["".join(p) for p in pieces] == [c.text for c in whole.choices]


def test_a_stream_error_after_the_first_byte_is_an_event(engine, metrics):
    engine.fail_after = 2
    events = stream_completions(engine, metrics, prompt="p", max_tokens=9)
    assert [c["choices"][0]["text"] for c in events[:2]] == ["h", "e"]
    assert events[2] == {
        "error": {
            "type": "internal",
            "message": events[2]["error"]["message"],
            "param": None,
            "field": None,
            "code": 500,
        }
    }
    assert events[3:] == ["[DONE]"]
    assert re.search(rb'rlhf_errors_total\{[^}]*kind="internal"[^}]*\} 1\.0', metrics.render()[0])


# ------------------------------------------------------------------------------------------------ chat


def test_chat_renders_the_template_and_answers(engine, metrics):
    msgs = [{"role": "system", "content": "brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    r = chat(
        engine, metrics, messages=msgs, max_completion_tokens=5, logprobs=True, top_logprobs=2, return_token_ids=True
    )
    (c,) = r.choices
    assert r.prompt_token_ids == list(b"<system>brief<user>hi<assistant>") and r.id.startswith("chatcmpl-")
    assert (c.message.role, c.message.content, c.message.tool_calls) == ("assistant", "hello", None)
    assert c.finish_reason == "length"
    assert c.token_ids == list(b"hello") and r.usage.completion_tokens == 5
    first = c.logprobs.content[0]
    assert (first.token, first.logprob, first.bytes) == ("h", -1.0, [104])
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("h", -1.0), ("i", -2.0)]


def test_chat_parses_tool_calls(metrics):
    engine = FakeEngine([f"sure {CALL} {CALL.replace('Paris', 'Rome')}"])
    r = chat(engine, metrics, messages=user("weather?"), tools=[WEATHER], max_completion_tokens=500)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content == "sure"
    assert [json.loads(t.function.arguments) for t in c.message.tool_calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert b"<tools>" in bytes(engine.calls[0][0][0])
    one = chat(
        engine, metrics, messages=user("w"), tools=[WEATHER], parallel_tool_calls=False, max_completion_tokens=500
    )
    assert len(one.choices[0].message.tool_calls) == 1
    # tool_choice none: neither rendered nor parsed
    none = chat(engine, metrics, messages=user("w"), tools=[WEATHER], tool_choice="none", max_completion_tokens=500)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content.startswith("sure <tool_call>")
    assert b"<tools>" not in bytes(engine.calls[-1][0][0])


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice", "tool_choice required is not supported"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            "tool_choice",
            r"a named function \('get_weather'\)",
        ),
        ({"messages": user("refuse me")}, "messages", "the chat template refused the messages: no such message"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
            "only assistant messages carry tool_calls",
        ),
        ({"max_tokens": 1001, "stream": True}, "max_tokens", "below the context"),  # before the stream
    ],
)
def test_chat_refusals(engine, metrics, body, field, message):
    with pytest.raises(InvalidArgument, match=message) as info:
        chat(engine, metrics, **{"messages": user("hi"), **body})
    assert info.value.field == field and not engine.calls


def test_chat_refuses_a_template_that_cannot_serve_the_request(engine, metrics):
    engine.tokenizer.renders_tools = False
    with pytest.raises(InvalidArgument, match="does not render tools") as info:
        chat(engine, metrics, messages=user("hi"), tools=[WEATHER])
    assert info.value.field == "tools"
    engine.tokenizer.chat_template = None
    with pytest.raises(InvalidArgument, match="has no chat template") as info:
        chat(engine, metrics, messages=user("hi"))
    assert info.value.field == "messages"


# ------------------------------------------------------------------------------------------------ chat streams


def test_chat_stream_opens_with_the_role_and_ids_then_streams_content(engine, metrics):
    kw = dict(messages=user("hi"), n=2, max_tokens=6, logprobs=True, return_token_ids=True)
    whole = chat(engine, metrics, **kw)
    events = stream_chat(engine, metrics, **kw)
    assert events[-1] == "[DONE]"
    opening, *chunks = events[:-1]
    assert opening["object"] == "chat.completion.chunk" and opening["id"].startswith("chatcmpl-")
    assert opening["prompt_token_ids"] == whole.prompt_token_ids  # in the first chunk only
    assert opening["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "prompt_token_ids" not in chunks[0]
    content, ids, finish = ["", ""], [[], []], [None, None]
    for c in chunks[1:]:
        (ch,) = c["choices"]
        assert "prompt_token_ids" not in c and "role" not in ch["delta"]
        content[ch["index"]] += ch["delta"].get("content", "")
        ids[ch["index"]] += ch["token_ids"]
        assert len(ch["logprobs"]["content"]) == len(ch["token_ids"])
        if ch["finish_reason"] is not None:
            finish[ch["index"]] = ch["finish_reason"]
            assert tuple(ch) == LAST_CHAT_KEYS  # in the order the wire had them
    assert content == [c.message.content for c in whole.choices]
    assert ids == [c.token_ids for c in whole.choices] and finish == [c.finish_reason for c in whole.choices]


def test_chat_stream_with_tools_sends_the_parsed_answer_last(metrics):
    engine = FakeEngine([f"ok {CALL}"])
    events = stream_chat(engine, metrics, messages=user("w"), tools=[WEATHER], max_tokens=100, return_token_ids=True)
    chunks = [c["choices"][0] for c in events[1:-1]]
    *middle, last = chunks
    assert all(c["delta"] == {} and c["finish_reason"] is None for c in middle)  # token ids only, no text yet
    assert sum(len(c["token_ids"]) for c in chunks) == len(f"ok {CALL}".encode())
    (call,) = last["delta"]["tool_calls"]
    assert last["delta"]["content"] == "ok" and last["finish_reason"] == "tool_calls"
    assert list(call) == ["index", "id", "type", "function"] and call["index"] == 0
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


# ------------------------------------------------------------------------------------------------ the routes


def test_the_routes_reach_the_serving_classes(engine, metrics):
    app = build_app(engine, ServiceSettings(), metrics)  # type: ignore[arg-type]

    async def calls() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rollout") as client:
            return [
                await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}),
                await client.post(
                    "/v1/chat/completions", json={"messages": user("hi"), "max_tokens": 2, "stream": True}
                ),
                await client.post("/v1/generate", json={"prompt_token_ids": [[1, 2]], "max_tokens": 2}),
                await client.get("/v1/weights/version"),
                await client.get("/v1/models"),
                await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}),
            ]

    done, stream, gen, version, models, refused = asyncio.run(calls())
    assert done.json()["choices"][0]["text"] == "he"
    assert stream.headers["content-type"].startswith("text/event-stream") and stream.text.endswith("data: [DONE]\n\n")
    assert gen.json()["results"][0]["completions"][0]["token_ids"] == list(b"he") and gen.json()["policy_version"] == 7
    assert version.json() == {
        "version": 7,
        "checksum": "sha256:fake",
        "loaded_at_unix_ms": 1,
        "model": "fake-model",
        "engine": "fake",
    }
    assert models.json()["data"] == [{"id": "fake-model", "object": "model", "owned_by": "rlhf-pipeline"}]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_an_unknown_tool_call_parser_is_refused_at_build(engine, metrics):
    with pytest.raises(ValueError):
        build_app(engine, ServiceSettings(), metrics, tool_call_parser="nope")  # type: ignore[arg-type]
