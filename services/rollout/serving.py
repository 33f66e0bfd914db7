"""The rollout's OpenAI serving layer, the shared part: :class:`OpenAIServing` (a base over an injected engine), the
typed :class:`StreamPiece` a serving class hands its :class:`ChoiceRenderer`, and :class:`StreamRenderer` (Server-Sent
Events over ``engine.generate_stream``); plus ``/v1/generate`` (:class:`ServingGenerate`). The OpenAI endpoints are
services.rollout.serving_completion and serving_chat, the routes services.rollout.api_router.

Every field, default and error: docs/services.md#rollout.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from rlhf.serving import RLHFError, ServiceMetrics, cancel_on_disconnect, json_response
from rlhf.serving.errors import as_rlhf_error, error_body
from services.rollout.engine import EngineBase, decode_text, version_span_fields
from services.rollout.engine_types import PromptResult, Sample
from services.rollout.openai_protocol import (
    ChatStreamChoice,
    CompletionStreamChoice,
    GenerateRequest,
    StreamChunk,
    UsageOut,
)
from services.rollout.options import SamplingOptions

TopLogprobs = list[list[tuple[int, float]]]  # per token, (token id, log-prob) of the most probable, best first
StreamChoice = CompletionStreamChoice | ChatStreamChoice


def usage(results: list[PromptResult]) -> UsageOut:
    p = sum(len(r.prompt_token_ids) for r in results)
    c = sum(len(s.token_ids) for r in results for s in r.samples)
    return UsageOut(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token's own text, special tokens included (what the log-probs name)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class TextStream:
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


@dataclass(frozen=True)
class StreamPiece:
    """What one engine event adds to one streamed choice, as its :class:`ChoiceRenderer` gets it."""

    index: int  # the choice: prompt index x n + sample index
    text: str  # the new text that can be sent (see TextStream for what is held back)
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: TopLogprobs | None
    sample: Sample | None = None  # the finished sample, on the choice's last piece
    # with prompt log-probs asked for, on the choice's first piece (as in PromptResult)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


class ChoiceRenderer(Protocol):
    """One endpoint's stream choices; None: nothing to send for it."""

    def opening(self, index: int) -> StreamChoice | None:
        """Sent for each choice before generation starts (chat: the role; echo without log-probs: the prompt)."""

    def piece(self, piece: StreamPiece) -> StreamChoice | None: ...


@dataclass(frozen=True)
class StreamSpec:
    """One streamed request, as its serving class validated it."""

    object: Literal["text_completion", "chat.completion.chunk"]
    prompts: list[list[int]]
    opts: SamplingOptions
    n: int  # choices per prompt
    include_usage: bool
    prompt_token_ids: list[int] | None = None  # sent in the first chunk only (vLLM's chat return_token_ids)


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


class StreamRenderer:
    """SSE chunks over ``engine.generate_stream``, each choice rendered by the endpoint's :class:`ChoiceRenderer`.
    Errors after the first byte are sent as an ``error`` event (the status is already 200), then ``[DONE]``. A client
    that hangs up: the server cancels the response, which closes the engine's event iterator."""

    def __init__(self, engine: EngineBase, metrics: ServiceMetrics):
        self.engine = engine
        self.metrics = metrics

    def response(self, spec: StreamSpec, choices: ChoiceRenderer) -> StreamingResponse:
        prefix = "chatcmpl" if spec.object == "chat.completion.chunk" else "cmpl"
        head = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": spec.object,
            "created": int(time.time()),
            "model": self.engine.model_name,
        }
        return StreamingResponse(
            self.events(spec, choices, head), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def events(self, spec: StreamSpec, choices: ChoiceRenderer, head: dict[str, Any]) -> AsyncIterator[bytes]:
        def chunk(**fields: Any) -> bytes:
            return _sse(StreamChunk(**head, **fields).model_dump(exclude_unset=True))

        texts = [TextStream(self.engine.tokenizer, spec.opts) for _ in range(len(spec.prompts) * spec.n)]
        generated = 0
        try:
            once = {} if spec.prompt_token_ids is None else {"prompt_token_ids": spec.prompt_token_ids}
            for index in range(len(texts)):
                opening = choices.opening(index)
                if opening is not None:
                    yield chunk(**once, choices=[opening])
                    once = {}
            async for ev in self.engine.generate_stream(spec.prompts, spec.opts, field="prompt"):
                index = ev.prompt_index * spec.n + ev.sample_index
                generated += len(ev.token_ids)
                if ev.text is not None:  # the engine's own detokenizer (vLLM), stop strings held back
                    text = ev.text
                elif ev.sample is not None:
                    text = texts[index].finish(ev.token_ids, ev.sample.text)
                else:
                    text = texts[index].push(ev.token_ids)
                piece = StreamPiece(
                    index,
                    text,
                    ev.token_ids,
                    ev.logprobs,
                    ev.top_logprobs,
                    ev.sample,
                    ev.prompt_logprobs,
                    ev.prompt_top_logprobs,
                )
                c = choices.piece(piece)
                if c is not None:
                    yield chunk(choices=[c])
            if spec.include_usage:
                p = sum(len(x) for x in spec.prompts)
                used = UsageOut(prompt_tokens=p, completion_tokens=generated, total_tokens=p + generated)
                yield chunk(choices=[], usage=used, policy_version=self.engine.weights_version)
        except Exception as err:  # noqa: BLE001 - the status line is sent: report in the stream
            rerr: RLHFError = as_rlhf_error(err)
            self.metrics.count_error(rerr.kind)
            yield _sse(error_body(rerr))
        yield b"data: [DONE]\n\n"


class OpenAIServing:
    """What the serving classes share: the injected engine, the metrics, the stream renderer."""

    def __init__(self, engine: EngineBase, metrics: ServiceMetrics):
        self.engine = engine
        self.metrics = metrics
        self.streams = StreamRenderer(engine, metrics)

    async def _generate(
        self, prompts: list[list[int]], opts: SamplingOptions, field: str, raw_request: Request | None
    ) -> list[PromptResult]:
        work = self.engine.generate(prompts, opts, field=field)
        if raw_request is None:  # called in-process: no client to hang up
            return await work
        return await cancel_on_disconnect(raw_request, work)  # a client that hangs up cancels its generation


class ServingGenerate(OpenAIServing):
    """``/v1/generate``: token ids in; token ids, sampling log-probs and finish reasons out."""

    async def create_generate(self, body: GenerateRequest, raw_request: Request | None = None) -> Response:
        opts = body.options(self.engine.defaults)
        self.metrics.observe_batch("/v1/generate", len(body.prompt_token_ids) * opts.n)
        prompts = [list(p) for p in body.prompt_token_ids]
        results = await self._generate(prompts, opts, "prompt_token_ids", raw_request)
        # The training clients' hot path: the engine's results are typed already, so they are rendered once
        # (json_response) instead of being validated again through a response model; OpenAPI keeps the schema.
        return json_response(
            {
                "request_id": f"gen-{uuid.uuid4().hex}",
                "policy_version": self.engine.weights_version,
                "results": [
                    {
                        "prompt_token_ids": r.prompt_token_ids,
                        "completions": [_completion(s) for s in r.samples],
                    }
                    for r in results
                ],
            }
        )


def _completion(s: Sample) -> dict[str, Any]:
    """One ``/v1/generate`` completion; its version spans as rollout.proto's ``Completion`` has them (empty lists
    when one version sampled every token)."""
    spans = version_span_fields(s.spans)
    return {
        "token_ids": s.token_ids,
        "logprobs": s.logprobs,
        "finish_reason": s.finish_reason,
        "stop_reason": s.stop_reason,
        "text": s.text,
        "policy_version": s.policy_version,
        "span_starts": spans.get("span_starts", []),
        "span_versions": spans.get("span_versions", []),
    }
