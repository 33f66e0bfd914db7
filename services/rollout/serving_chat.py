"""``/v1/chat/completions`` over an injected engine: :class:`OpenAIServingChat` (the served tokenizer's chat template,
tools, tool-call parsing, the JSON answer) and :class:`ChatChoices` (its stream's choices).

Every field, default and error: docs/services.md#rollout.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from rlhf.serving import InvalidArgument, ServiceMetrics
from rlhf.tool_calls import check_parser, parse_tool_calls, template_messages
from services.rollout.engine import EngineBase
from services.rollout.engine_types import PromptResult
from services.rollout.openai_protocol import (
    ChatChoiceOut,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDeltaOut,
    ChatLogprobsOut,
    ChatMessage,
    ChatMessageOut,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
)
from services.rollout.options import OFFLOAD_CHARS
from services.rollout.serving import OpenAIServing, StreamPiece, StreamSpec, TopLogprobs, token_text, usage


def chat_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[float], top: TopLogprobs | None
) -> ChatLogprobsOut:
    def entry(t: int, v: float) -> dict[str, Any]:
        piece = token_text(tokenizer, t)
        return {"token": piece, "logprob": v, "bytes": list(piece.encode("utf-8"))}

    tops = top if top is not None else [[] for _ in token_ids]
    return ChatLogprobsOut(
        content=[
            ChatTokenLogprob(**entry(t, v), top_logprobs=[ChatTopLogprob(**entry(a, av)) for a, av in alts])
            for t, v, alts in zip(token_ids, logprobs, tops, strict=True)
        ]
    )


def chat_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as the chat template takes them."""
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


def rendered_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
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


def _apply_template(tok: Any, conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    try:
        return tok.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=False)
    except Exception as err:  # noqa: BLE001 - jinja's TemplateError (raise_exception in the template) and kin
        raise InvalidArgument(f"the chat template refused the messages: {err}", field="messages") from None


def _render(tok: Any, conv: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    text = _apply_template(tok, conv, tools)
    # a template that does not render tools would let the model call functions it was never shown
    if tools and text == _apply_template(tok, conv, None):
        raise InvalidArgument(
            "the served model's chat template does not render tools: send them in the messages instead",
            field="tools",
        )
    return list(tok.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class ChatOutput:
    """A finished sample as the answer shows it."""

    content: str | None
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str


@dataclass(frozen=True)
class ToolParsing:
    """How a sample's text becomes the answer: with tools, the tool-call blocks are parsed out of it."""

    tools: list[dict[str, Any]] | None  # None: the text is the content
    parser: str
    parallel: bool  # false: at most one call per choice, the first (as vLLM does)

    def output(self, text: str, finish_reason: str) -> ChatOutput:
        """The answer of a sample's text; its finish reason is tool_calls when the text called any (vLLM reports it
        for tool_choice auto whatever ended the text)."""
        if self.tools is None:
            return ChatOutput(text, None, finish_reason)
        content, calls = parse_tool_calls(text, self.parser)
        if not self.parallel:
            calls = calls[:1]
        return ChatOutput(content, calls, "tool_calls") if calls else ChatOutput(text, None, finish_reason)


@dataclass(frozen=True)
class ChatChoices:
    """The choices of a chat stream (a :class:`services.rollout.serving.ChoiceRenderer`)."""

    tokenizer: Any
    parsing: ToolParsing
    logprobs: bool
    return_token_ids: bool

    def opening(self, index: int) -> ChatStreamChoice:
        delta = ChatDeltaOut(role="assistant", content="")
        return ChatStreamChoice(index=index, delta=delta, logprobs=None, finish_reason=None)

    def piece(self, piece: StreamPiece) -> ChatStreamChoice | None:
        ids, smp = piece.token_ids, piece.sample
        lp = chat_logprobs(self.tokenizer, ids, piece.logprobs, piece.top_logprobs) if self.logprobs and ids else None
        # a block is a call only once it is whole: with tools the text comes in the last chunk, parsed (log-probs
        # and token ids still stream as they come); without, each event with tokens is a chunk, its text held back
        # or not (as vLLM)
        tools = self.parsing.tools is not None
        text = "" if tools else piece.text
        if not text and lp is None and smp is None and not (self.return_token_ids and ids) and (tools or not ids):
            return None
        delta: dict[str, Any] = {"content": text} if text or not tools else {}
        fields: dict[str, Any] = {"finish_reason": None}
        if smp is not None:
            out = self.parsing.output(smp.text, smp.finish_reason)
            if self.parsing.tools is not None and out.content:
                delta["content"] = out.content
            if out.tool_calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(out.tool_calls)]
            fields.update(
                finish_reason=out.finish_reason, stop_reason=smp.stop_reason, policy_version=smp.policy_version
            )
        if self.return_token_ids:
            fields["token_ids"] = ids  # this chunk's tokens (vLLM's)
        return ChatStreamChoice(index=piece.index, delta=ChatDeltaOut(**delta), logprobs=lp, **fields)


class OpenAIServingChat(OpenAIServing):
    """``POST /v1/chat/completions``: the conversation through the served tokenizer's chat template."""

    def __init__(self, engine: EngineBase, metrics: ServiceMetrics, *, tool_call_parser: str = "hermes"):
        check_parser(tool_call_parser)
        super().__init__(engine, metrics)
        self.tool_call_parser = tool_call_parser

    async def create_chat_completion(
        self, body: ChatCompletionRequest, raw_request: Request | None = None
    ) -> ChatCompletionResponse | StreamingResponse:
        body.include_usage()  # refuses stream_options without stream
        if body.top_logprobs and not body.logprobs:
            raise InvalidArgument("top_logprobs needs logprobs: true", field="top_logprobs")
        tools = rendered_tools(body)
        prompt = await self.render_chat(body.messages, tools)
        parsing = ToolParsing(tools, self.tool_call_parser, body.parallel_tool_calls is not False)
        top_k = (body.top_logprobs or 0) if body.logprobs else 0
        opts = body.options(self.engine.defaults, max_tokens=body.max_completion_tokens, top_logprobs=top_k)
        self.metrics.observe_batch("/v1/chat/completions", opts.n)
        if body.stream:
            self.engine.validate([prompt], opts, field="messages")  # refused with a 4xx before the stream starts
            choices = ChatChoices(self.engine.tokenizer, parsing, body.logprobs, body.return_token_ids)
            ids_first = prompt if body.return_token_ids else None
            spec = StreamSpec("chat.completion.chunk", [prompt], opts, body.n, body.include_usage(), ids_first)
            return self.streams.response(spec, choices)
        results = await self._generate([prompt], opts, "messages", raw_request)
        return self._response(body, parsing, results)

    async def render_chat(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation (and ``tools``, when given) through the served tokenizer's chat template, with the
        generation prompt (vLLM's chat endpoint does the same); the rendered text holds any special tokens, so none
        are added when tokenizing."""
        self.engine.check_ready()
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise InvalidArgument(
                "the served model's tokenizer has no chat template: use /v1/completions with the prompt as text",
                field="messages",
            )
        conv = chat_conversation(messages)
        size = sum(len(c["content"]) for c in conv) + (len(json.dumps(tools)) if tools else 0)
        if size > OFFLOAD_CHARS:
            return await asyncio.to_thread(_render, tok, conv, tools)
        return _render(tok, conv, tools)

    def _response(
        self, body: ChatCompletionRequest, parsing: ToolParsing, results: list[PromptResult]
    ) -> ChatCompletionResponse:
        tok = self.engine.tokenizer
        choices = []
        for j, s in enumerate(results[0].samples):
            out = parsing.output(s.text, s.finish_reason)
            choices.append(
                ChatChoiceOut(
                    index=j,
                    message=ChatMessageOut(content=out.content, tool_calls=out.tool_calls),
                    logprobs=chat_logprobs(tok, s.token_ids, s.logprobs, s.top_logprobs) if body.logprobs else None,
                    finish_reason=out.finish_reason,
                    stop_reason=s.stop_reason,
                    token_ids=s.token_ids if body.return_token_ids else None,
                    policy_version=s.policy_version,
                )
            )
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.engine.model_name,
            choices=choices,
            usage=usage(results),
            prompt_token_ids=results[0].prompt_token_ids if body.return_token_ids else None,
            policy_version=self.engine.weights_version,
        )
