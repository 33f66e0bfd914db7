"""REST for the rollout service: OpenAI / vLLM compatible ``/v1/completions`` and ``/v1/chat/completions`` (streamed
or not, tool calling, prompt log-probs with ``echo``), plus ``/v1/generate`` (token ids in, token ids and sampling
log-probs out), ``/v1/weights/version`` and ``/v1/models``.

Every field, default and error of these routes: docs/services.md#rollout.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from rlhf.serving import (
    InvalidArgument,
    RLHFError,
    ServiceMetrics,
    ServiceSettings,
    cancel_on_disconnect,
    create_app,
    http_error_responses,
    json_response,
)
from rlhf.serving.errors import Internal, as_rlhf_error, error_body
from rlhf.tool_calls import check_parser, parse_tool_calls, template_messages
from services.rollout.engine import EngineBase, decode_text
from services.rollout.engine_types import PromptResult, Sample
from services.rollout.openai_protocol import (
    ChatChoiceOut,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobsOut,
    ChatMessage,
    ChatMessageOut,
    ChatTokenLogprob,
    ChoiceOut,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    GenerateResponse,
    LogprobsOut,
    UsageOut,
    WeightsVersionOut,
    is_int,
)
from services.rollout.options import OFFLOAD_CHARS, SamplingOptions


def _usage(results: list[PromptResult]) -> UsageOut:
    p = sum(len(r.prompt_token_ids) for r in results)
    c = sum(len(s.token_ids) for r in results for s in r.samples)
    return UsageOut(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _piece(engine: EngineBase, token_id: int) -> str:
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _logprobs(
    engine: EngineBase,
    token_ids: list[int],
    logprobs: list[float],
    top: list[list[tuple[int, float]]] | None,
    offset: int = 0,
) -> LogprobsOut:
    """The completions log-probs of some tokens; ``offset``: where their text starts in the choice's text."""
    pieces = [_piece(engine, t) for t in token_ids]
    offsets, at = [], offset
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    alts = [{_piece(engine, t): v for t, v in pos} for pos in top] if top is not None else None
    return LogprobsOut(tokens=pieces, token_logprobs=logprobs, text_offset=offsets, top_logprobs=alts)


def _echo_logprobs(engine: EngineBase, r: PromptResult, with_top: bool) -> LogprobsOut:
    """The prompt's part of an echoed choice's log-probs, in vLLM's shape: the first token's log-prob and
    alternatives are null (nothing conditions it); each other position's alternatives hold the prompt token too."""
    if r.prompt_logprobs is None:
        raise Internal("the engine returned no prompt log-probs for a request that asked for them")
    out = _logprobs(engine, r.prompt_token_ids, r.prompt_logprobs, None)
    if with_top:
        tops = r.prompt_top_logprobs or [None] * len(r.prompt_token_ids)
        out.top_logprobs = [
            None if lp is None else {**{_piece(engine, a): v for a, v in alts or []}, _piece(engine, t): lp}
            for t, lp, alts in zip(r.prompt_token_ids, r.prompt_logprobs, tops, strict=True)
        ]
    return out


def _joined(a: LogprobsOut, b: LogprobsOut) -> LogprobsOut:
    tops = None if a.top_logprobs is None or b.top_logprobs is None else a.top_logprobs + b.top_logprobs
    return LogprobsOut(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        text_offset=a.text_offset + b.text_offset,
        top_logprobs=tops,
    )


def _chat_logprobs(
    engine: EngineBase, token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]] | None
) -> ChatLogprobsOut:
    def entry(t: int, v: float) -> dict[str, Any]:
        piece = _piece(engine, t)
        return {"token": piece, "logprob": v, "bytes": list(piece.encode("utf-8"))}

    tops = top if top is not None else [[] for _ in token_ids]
    return ChatLogprobsOut(
        content=[
            ChatTokenLogprob(**entry(t, v), top_logprobs=[entry(a, av) for a, av in alts])
            for t, v, alts in zip(token_ids, logprobs, tops, strict=True)
        ]
    )


def _best(samples: list[Sample], n: int) -> list[Sample]:
    """best_of: the n samples with the highest cumulative log-prob, most probable first (vLLM's rule)."""
    if len(samples) <= n:
        return samples
    return sorted(samples, key=lambda s: math.fsum(s.logprobs), reverse=True)[:n]


def _n_and_best_of(n: int, best_of: int | None, stream: bool) -> int:
    if best_of is None:
        return n
    if best_of < n:
        raise InvalidArgument(f"best_of ({best_of}) must be at least n ({n})", field="best_of")
    if stream and best_of > n:
        raise InvalidArgument(
            "best_of > n cannot be streamed: the best samples are known only at the end; drop stream or best_of",
            field="best_of",
        )
    return best_of


class _TextStream:
    """The text of one streamed choice, piece by piece. Held back: a stop string that has appeared and the last
    ``len(longest stop) - 1`` characters (they may begin one; the final text is cut before it), and a trailing U+FFFD
    (a character whose bytes are split across tokens). The finished sample's text then gives the rest."""

    def __init__(self, tokenizer: Any, opts: SamplingOptions):
        self.tokenizer = tokenizer
        self.stop = opts.stop
        self.hold = max((len(s) for s in opts.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = decode_text(self.tokenizer, self.ids)
        safe = len(text) - self.hold
        # the token that completes a stop string arrives before the engine's verdict: stop short of it
        safe = min([safe, *(text.find(s) for s in self.stop if s in text)])
        while safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= self.sent:
            return ""
        out, self.sent = text[self.sent : safe], safe
        return out

    def finish(self, ids: list[int], final_text: str) -> str:
        self.ids += ids
        out, self.sent = final_text[self.sent :], max(self.sent, len(final_text))
        return out


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


def build_app(
    engine: EngineBase, settings: ServiceSettings, metrics: ServiceMetrics, *, tool_call_parser: str = "hermes"
) -> FastAPI:
    check_parser(tool_call_parser)
    app = create_app(
        "rollout",
        settings,
        metrics,
        title="rlhf rollout service",
        description="Generates with the current policy weights (vLLM or transformers): OpenAI-style completions, "
        "tokens-in/tokens-out generation with per-token sampling log-probs, and the served weights version.",
    )

    async def encode_prompts(prompt: Any) -> list[list[int]]:
        engine.check_ready()  # the tokenizer comes with the model
        if isinstance(prompt, str) or is_int(prompt[0]):  # one prompt
            prompt = [prompt]
        for i, p in enumerate(prompt):
            if isinstance(p, str) and not p:
                where = f"prompt[{i}]" if len(prompt) > 1 else "prompt"
                raise InvalidArgument("the prompt is empty: send non-empty text or token ids", field=where)
        texts = [p for p in prompt if isinstance(p, str)]
        encoded = iter(await engine.encode_texts(texts) if texts else [])
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompt]

    def chat_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
        conv = []
        for i, m in enumerate(messages):
            if m.tool_calls and m.role != "assistant":
                raise InvalidArgument("only assistant messages carry tool_calls", field=f"messages[{i}].tool_calls")
            c: dict[str, Any] = {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
            if m.tool_calls:
                c["tool_calls"] = [t.model_dump() for t in m.tool_calls]
            if m.tool_call_id is not None:
                c["tool_call_id"] = m.tool_call_id
            conv.append(c)
        return template_messages(conv)  # tool-call arguments as objects, as templates expect them

    async def render_chat(messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation (and ``tools``, when given) through the served tokenizer's chat template, with the
        generation prompt (vLLM's chat endpoint does the same); the rendered text holds any special tokens, so none
        are added when tokenizing."""
        engine.check_ready()
        tok = engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise InvalidArgument(
                "the served model's tokenizer has no chat template: use /v1/completions with the prompt as text",
                field="messages",
            )
        conv = chat_conversation(messages)

        def template(with_tools: list[dict[str, Any]] | None) -> str:
            try:
                return tok.apply_chat_template(conv, tools=with_tools, add_generation_prompt=True, tokenize=False)
            except Exception as err:  # noqa: BLE001 - jinja's TemplateError (raise_exception in the template) and kin
                raise InvalidArgument(f"the chat template refused the messages: {err}", field="messages") from None

        def render() -> list[int]:
            text = template(tools)
            # a template that does not render tools would let the model call functions it was never shown
            if tools and text == template(None):
                raise InvalidArgument(
                    "the served model's chat template does not render tools: send them in the messages instead",
                    field="tools",
                )
            return list(tok.encode(text, add_special_tokens=False))

        size = sum(len(c["content"]) for c in conv) + (len(json.dumps(tools)) if tools else 0)
        if size > OFFLOAD_CHARS:
            return await asyncio.to_thread(render)
        return render()

    def stream_response(
        kind: str,
        prompts: list[list[int]],
        opts: SamplingOptions,
        n: int,
        include_usage: bool,
        chunk: Callable[[int, str, list[int], list[float], Any, Sample | None], dict[str, Any] | None],
        first: Callable[[int], dict[str, Any] | None],
        first_fields: dict[str, Any] | None = None,
    ) -> StreamingResponse:
        """SSE over ``engine.generate_stream``: ``first(index)`` opens each choice (chat: the role; echo: the
        prompt), ``chunk(index, text, token_ids, logprobs, top, sample)`` renders each piece (None: nothing to
        send); ``first_fields`` go in the first chunk only (vLLM's ``prompt_token_ids``). Errors after the first
        byte are sent as an ``error`` event (the status is already 200), then ``[DONE]``."""
        rid = f"{'chatcmpl' if kind == 'chat.completion.chunk' else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": rid, "object": kind, "created": created, "model": engine.model_name}

        async def events() -> AsyncIterator[bytes]:
            texts = [_TextStream(engine.tokenizer, opts) for _ in range(len(prompts) * n)]
            generated = 0
            try:
                once = dict(first_fields or {})
                for index in range(len(texts)):
                    opening = first(index)
                    if opening is not None:
                        yield _sse({**head, **once, "choices": [opening]})
                        once = {}
                async for ev in engine.generate_stream(prompts, opts, field="prompt"):
                    index = ev.prompt_index * n + ev.sample_index
                    generated += len(ev.token_ids)
                    ts = texts[index]
                    text = ts.finish(ev.token_ids, ev.sample.text) if ev.sample is not None else ts.push(ev.token_ids)
                    c = chunk(index, text, ev.token_ids, ev.logprobs, ev.top_logprobs, ev.sample)
                    if c is not None:
                        yield _sse({**head, "choices": [c]})
                if include_usage:
                    p = sum(len(x) for x in prompts)
                    usage = {"prompt_tokens": p, "completion_tokens": generated, "total_tokens": p + generated}
                    yield _sse({**head, "choices": [], "usage": usage, "policy_version": engine.weights_version})
            except Exception as err:  # noqa: BLE001 - the status line is sent: report in the stream
                rerr: RLHFError = as_rlhf_error(err)
                metrics.count_error(rerr.kind)
                yield _sse(error_body(rerr))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def use_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
        """The tools to render and parse for: None when there are none or ``tool_choice`` is ``none``. Choices that
        need constrained decoding are refused."""
        choice = body.tool_choice
        if choice == "required" or not isinstance(choice, str | None):
            what = "required" if choice == "required" else f"a named function ({choice.function.name!r})"
            raise InvalidArgument(
                f"tool_choice {what} is not supported: the service does not constrain decoding; use auto (the model "
                "may call a tool) or none",
                field="tool_choice",
            )
        if not body.tools or choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in body.tools]

    # The engine call runs under cancel_on_disconnect: a client that hangs up cancels its generation (streams: the
    # server cancels the response, which closes the engine's event iterator).
    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        tags=["rollout"],
        summary="OpenAI-style completions with token ids, sampling log-probs, policy version",
        responses={
            200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE chunks with stream: true"},
            **http_error_responses(503),
        },
    )
    async def completions(body: CompletionRequest, request: Request) -> Any:
        body.include_usage()  # refuses stream_options without stream
        prompts = await encode_prompts(body.prompt)
        n = body.n
        best_of = _n_and_best_of(n, body.best_of, body.stream)
        want_lp = body.logprobs is not None
        score_only = body.max_tokens == 0  # the prompt (and its log-probs) only: nothing generated
        if score_only and not body.echo:
            raise InvalidArgument(
                "max_tokens: 0 needs echo: true (it answers the prompt and, with logprobs, its log-probs only)",
                field="max_tokens",
            )
        if body.stream and body.echo and want_lp:
            raise InvalidArgument(
                "echo with logprobs cannot be streamed (the prompt's log-probs come with the finished request): "
                "drop stream",
                field="echo",
            )
        if body.stream and score_only:
            raise InvalidArgument("max_tokens: 0 cannot be streamed: drop stream", field="max_tokens")
        # max_tokens 0: one token is generated (the engines' unit of work) and dropped from the answer
        opts = body.options(
            engine.defaults, n=best_of, top_logprobs=body.logprobs or 0, max_tokens=1 if score_only else None
        )
        if body.echo and want_lp:
            opts = replace(opts, prompt_logprobs=body.logprobs)
        raw = [body.prompt] if isinstance(body.prompt, str) or is_int(body.prompt[0]) else body.prompt
        echoes = [
            (p if isinstance(p, str) else decode_text(engine.tokenizer, list(p))) if body.echo else "" for p in raw
        ]
        metrics.observe_batch("/v1/completions", len(prompts) * opts.n)

        if body.stream:
            engine.validate(prompts, opts, field="prompt")  # refused with a 4xx before the stream starts
            offsets = [len(echoes[i // n]) for i in range(len(prompts) * n)]  # text_offset of the next token

            def first(index: int) -> dict[str, Any] | None:
                text = echoes[index // n]
                return {"index": index, "text": text, "logprobs": None, "finish_reason": None} if text else None

            def chunk(index, text, ids, lps, top, smp):
                lp = None
                if want_lp and ids:
                    lp = _logprobs(engine, ids, lps, top if body.logprobs else None, offsets[index]).model_dump()
                    offsets[index] += sum(len(t) for t in lp["tokens"])
                if not text and lp is None and smp is None:
                    return None  # tokens whose text is held back, nothing else to say
                c = {"index": index, "text": text, "logprobs": lp, "finish_reason": None}
                if smp is not None:
                    c.update(
                        finish_reason=smp.finish_reason, stop_reason=smp.stop_reason, policy_version=smp.policy_version
                    )
                return c

            include_usage = body.include_usage()
            return stream_response("text_completion", prompts, opts, n, include_usage, chunk, first)

        results = await cancel_on_disconnect(request, engine.generate(prompts, opts, field="prompt"))
        if score_only:
            for r in results:
                r.samples = [
                    replace(
                        s,
                        token_ids=[],
                        logprobs=[],
                        text="",
                        top_logprobs=None if s.top_logprobs is None else [],
                        finish_reason="length",
                        stop_reason=None,
                    )
                    for s in r.samples
                ]
        choices = []
        for i, r in enumerate(results):
            echo_lp = _echo_logprobs(engine, r, bool(body.logprobs)) if body.echo and want_lp else None
            for s in _best(r.samples, n):
                lp = None
                if want_lp:  # the generated tokens' text starts after the echoed prompt
                    top = s.top_logprobs if body.logprobs else None
                    lp = _logprobs(engine, s.token_ids, s.logprobs, top, len(echoes[i]))
                    lp = _joined(echo_lp, lp) if echo_lp is not None else lp
                choices.append(
                    ChoiceOut(
                        index=len(choices),
                        text=echoes[i] + s.text,
                        finish_reason=s.finish_reason,
                        stop_reason=s.stop_reason,
                        logprobs=lp,
                        token_ids=s.token_ids if body.return_token_ids else None,
                        prompt_token_ids=r.prompt_token_ids if body.return_token_ids else None,
                        policy_version=s.policy_version,
                    )
                )
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=engine.model_name,
            choices=choices,
            usage=_usage(results),
            policy_version=engine.weights_version,
        )

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        tags=["rollout"],
        summary="OpenAI-style chat completions (the served tokenizer's chat template)",
        responses={
            200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE chunks with stream: true"},
            **http_error_responses(503),
        },
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        body.include_usage()  # refuses stream_options without stream
        if body.top_logprobs and not body.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs: true", field="top_logprobs")
        tools = use_tools(body)
        prompt = await render_chat(body.messages, tools)
        n = body.n

        def message(text: str, finish_reason: str) -> tuple[str | None, list[dict[str, Any]] | None, str]:
            """The sample's text -> (content, tool calls, finish reason); "tool_calls" when it called any (vLLM
            reports it for tool_choice auto whatever ended the text)."""
            if tools is None:
                return text, None, finish_reason
            content, calls = parse_tool_calls(text, tool_call_parser)
            if body.parallel_tool_calls is False:
                calls = calls[:1]
            return (content, calls, "tool_calls") if calls else (text, None, finish_reason)

        top_k = (body.top_logprobs or 0) if body.logprobs else 0
        opts = body.options(engine.defaults, max_tokens=body.max_completion_tokens, top_logprobs=top_k)
        metrics.observe_batch("/v1/chat/completions", opts.n)

        if body.stream:
            engine.validate([prompt], opts, field="messages")

            def first(index: int) -> dict[str, Any]:
                return {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }

            def chunk(index, text, ids, lps, top, smp):
                lp = _chat_logprobs(engine, ids, lps, top).model_dump() if body.logprobs and ids else None
                if tools is not None:
                    # a block is a call only once it is whole: with tools the text comes in the last chunk, parsed
                    # (log-probs and token ids still stream token by token)
                    text = ""
                if not text and lp is None and smp is None and not (body.return_token_ids and ids):
                    return None
                delta: dict[str, Any] = {"content": text} if text else {}
                finish = None
                if smp is not None:
                    content, calls, finish = message(smp.text, smp.finish_reason)
                    if tools is not None and content:
                        delta["content"] = content
                    if calls:
                        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
                c = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
                if body.return_token_ids:
                    c["token_ids"] = ids  # this chunk's tokens (vLLM's)
                if smp is not None:
                    c.update(stop_reason=smp.stop_reason, policy_version=smp.policy_version)
                return c

            include_usage = body.include_usage()
            ids_first = {"prompt_token_ids": prompt} if body.return_token_ids else None
            return stream_response(
                "chat.completion.chunk", [prompt], opts, n, include_usage, chunk, first, first_fields=ids_first
            )

        results = await cancel_on_disconnect(request, engine.generate([prompt], opts, field="messages"))
        choices = []
        for j, s in enumerate(results[0].samples):
            content, calls, finish = message(s.text, s.finish_reason)
            choices.append(
                ChatChoiceOut(
                    index=j,
                    message=ChatMessageOut(content=content, tool_calls=calls),
                    logprobs=_chat_logprobs(engine, s.token_ids, s.logprobs, s.top_logprobs) if body.logprobs else None,
                    finish_reason=finish,
                    stop_reason=s.stop_reason,
                    token_ids=s.token_ids if body.return_token_ids else None,
                    policy_version=s.policy_version,
                )
            )
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=engine.model_name,
            choices=choices,
            usage=_usage(results),
            prompt_token_ids=results[0].prompt_token_ids if body.return_token_ids else None,
            policy_version=engine.weights_version,
        )

    # The training clients' hot path: the engine's results are typed already, so they are rendered once
    # (json_response) instead of being validated again through a response_model; OpenAPI keeps the schema.
    @app.post(
        "/v1/generate",
        response_model=None,
        tags=["rollout"],
        responses={
            200: {"model": GenerateResponse, "description": "one result per prompt, in order"},
            **http_error_responses(503),
        },
        summary="token ids in; token ids, sampling log-probs and finish reasons out",
    )
    async def generate(body: GenerateRequest, request: Request) -> Response:
        opts = body.options(engine.defaults)
        metrics.observe_batch("/v1/generate", len(body.prompt_token_ids) * opts.n)
        prompts = [list(p) for p in body.prompt_token_ids]
        results = await cancel_on_disconnect(request, engine.generate(prompts, opts, field="prompt_token_ids"))
        return json_response(
            {
                "request_id": f"gen-{uuid.uuid4().hex}",
                "policy_version": engine.weights_version,
                "results": [
                    {
                        "prompt_token_ids": r.prompt_token_ids,
                        "completions": [
                            {
                                "token_ids": s.token_ids,
                                "logprobs": s.logprobs,
                                "finish_reason": s.finish_reason,
                                "stop_reason": s.stop_reason,
                                "text": s.text,
                                "policy_version": s.policy_version,
                            }
                            for s in r.samples
                        ],
                    }
                    for r in results
                ],
            }
        )

    @app.get(
        "/v1/weights/version",
        response_model=WeightsVersionOut,
        tags=["rollout"],
        summary="the weights version served now",
    )
    async def weights_version() -> WeightsVersionOut:
        return WeightsVersionOut(
            version=engine.weights_version,
            checksum=engine.weights_checksum,
            loaded_at_unix_ms=engine.loaded_at_unix_ms,
            model=engine.model_name,
            engine=engine.kind,
        )

    @app.get("/v1/models", tags=["rollout"], summary="the served model (OpenAI clients list models first)")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "owned_by": "rlhf-pipeline"}]}

    return app
