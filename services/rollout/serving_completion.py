"""``/v1/completions`` over an injected engine: :class:`OpenAIServingCompletion` (validation, prompt encoding, echo,
best_of, prompt log-probs, the JSON answer) and :class:`CompletionChoices` (its stream's choices).

Every field, default and error: docs/services.md#rollout.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from rlhf.serving import InvalidArgument
from rlhf.serving.errors import Internal
from services.rollout.engine import decode_text
from services.rollout.engine_types import PromptResult, Sample
from services.rollout.openai_protocol import (
    ChoiceOut,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    LogprobsOut,
    is_int,
)
from services.rollout.options import SamplingOptions
from services.rollout.serving import OpenAIServing, StreamPiece, StreamSpec, TopLogprobs, token_text, usage


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[float], top: TopLogprobs | None, offset: int = 0
) -> LogprobsOut:
    """The completions log-probs of some tokens; ``offset``: where their text starts in the choice's text."""
    pieces = [token_text(tokenizer, t) for t in token_ids]
    offsets, at = [], offset
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    alts = [{token_text(tokenizer, t): v for t, v in pos} for pos in top] if top is not None else None
    return LogprobsOut(tokens=pieces, token_logprobs=logprobs, text_offset=offsets, top_logprobs=alts)


def echo_logprobs(tokenizer: Any, r: PromptResult, with_top: bool) -> LogprobsOut:
    """The prompt's part of an echoed choice's log-probs, in vLLM's shape: the first token's log-prob and
    alternatives are null (nothing conditions it); each other position's alternatives hold the prompt token too."""
    if r.prompt_logprobs is None:
        raise Internal("the engine returned no prompt log-probs for a request that asked for them")
    out = completion_logprobs(tokenizer, r.prompt_token_ids, r.prompt_logprobs, None)
    if with_top:
        tops = r.prompt_top_logprobs or [None] * len(r.prompt_token_ids)
        out.top_logprobs = [
            None
            if lp is None
            else {**{token_text(tokenizer, a): v for a, v in alts or []}, token_text(tokenizer, t): lp}
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


def best_samples(samples: list[Sample], n: int) -> list[Sample]:
    """best_of: the n samples with the highest cumulative log-prob, most probable first (vLLM's rule)."""
    if len(samples) <= n:
        return samples
    return sorted(samples, key=lambda s: math.fsum(s.logprobs), reverse=True)[:n]


def samples_per_prompt(n: int, best_of: int | None, stream: bool) -> int:
    """How many samples to generate per prompt: ``best_of`` when given (checked against ``n`` and ``stream``)."""
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


def _check_echo(body: CompletionRequest) -> None:
    """The combinations of max_tokens 0, echo and stream that cannot be answered."""
    score_only = body.max_tokens == 0
    if score_only and not body.echo:
        raise InvalidArgument(
            "max_tokens: 0 needs echo: true (it answers the prompt and, with logprobs, its log-probs only)",
            field="max_tokens",
        )
    if body.stream and score_only:
        raise InvalidArgument("max_tokens: 0 cannot be streamed: drop stream", field="max_tokens")


def _scored_only(results: list[PromptResult]) -> None:
    """max_tokens 0: the generated token is dropped from the answer (and from its usage)."""
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


@dataclass(frozen=True)
class CompletionPlan:
    """A validated completions request: what the engine generates and what each choice's text starts with."""

    prompts: list[list[int]]
    opts: SamplingOptions
    echoes: list[str]  # per prompt: the text before each choice's own ("" without echo)
    score_only: bool  # max_tokens 0: the prompt (and its log-probs) only


@dataclass
class CompletionChoices:
    """The choices of a completions stream (a :class:`services.rollout.serving.ChoiceRenderer`). With ``echo`` and
    ``logprobs`` a choice's first chunk holds the prompt, its log-probs and the first new tokens (as vLLM streams
    it: the prompt's log-probs are known once it is prefilled); with ``echo`` alone the prompt opens the stream."""

    tokenizer: Any
    prompts: list[list[int]]
    echoes: list[str]  # per prompt
    n: int
    logprobs: int | None  # the request's: None, none; 0, the sampled tokens'; k, with k alternatives
    offsets: list[int]  # per choice: the text_offset of its next token
    echo: bool = False
    return_token_ids: bool = False
    started: set[int] = field(default_factory=set)  # the choices whose first chunk went out

    def opening(self, index: int) -> CompletionStreamChoice | None:
        text = self.echoes[index // self.n]
        if not text or self.logprobs is not None:  # with log-probs the prompt comes with the first tokens
            return None
        return CompletionStreamChoice(index=index, text=text, logprobs=None, finish_reason=None)

    def piece(self, piece: StreamPiece) -> CompletionStreamChoice | None:
        index, text, lp = piece.index, piece.text, None
        if self.logprobs is not None and piece.token_ids:
            top = piece.top_logprobs if self.logprobs else None
            lp = completion_logprobs(self.tokenizer, piece.token_ids, piece.logprobs, top, self.offsets[index])
            self.offsets[index] += sum(len(t) for t in lp.tokens)
        first = index not in self.started
        prompt = self.prompts[index // self.n]
        if first and self.echo and self.logprobs is not None:
            r = PromptResult(prompt, [], piece.prompt_logprobs, piece.prompt_top_logprobs)
            head = echo_logprobs(self.tokenizer, r, bool(self.logprobs))
            lp = head if lp is None else _joined(head, lp)
            text = self.echoes[index // self.n] + text
        smp = piece.sample
        if not text and lp is None and smp is None and not piece.token_ids:
            return None  # nothing new: each event with tokens is a chunk, its text held back or not (as vLLM)
        self.started.add(index)
        fields: dict[str, Any] = {"finish_reason": None}
        if self.return_token_ids:
            fields["token_ids"] = piece.token_ids
            if first:
                fields["prompt_token_ids"] = prompt
        if smp is not None:
            fields.update(
                finish_reason=smp.finish_reason, stop_reason=smp.stop_reason, policy_version=smp.policy_version
            )
        return CompletionStreamChoice(index=index, text=text, logprobs=lp, **fields)


class OpenAIServingCompletion(OpenAIServing):
    """``POST /v1/completions``: text or token-id prompts as given (no chat template)."""

    async def create_completion(
        self, body: CompletionRequest, raw_request: Request | None = None
    ) -> CompletionResponse | StreamingResponse:
        plan = await self._plan(body)
        self.metrics.observe_batch("/v1/completions", len(plan.prompts) * plan.opts.n)
        if body.stream:
            return self._stream(body, plan)
        results = await self._generate(plan.prompts, plan.opts, "prompt", raw_request)
        return self._response(body, plan, results)

    async def encode_prompts(self, prompt: Any) -> list[list[int]]:
        """The request's prompt(s) as token id lists: text through the served tokenizer, ids as they are."""
        self.engine.check_ready()  # the tokenizer comes with the model
        if isinstance(prompt, str) or is_int(prompt[0]):  # one prompt
            prompt = [prompt]
        for i, p in enumerate(prompt):
            if isinstance(p, str) and not p:
                where = f"prompt[{i}]" if len(prompt) > 1 else "prompt"
                raise InvalidArgument("the prompt is empty: send non-empty text or token ids", field=where)
        texts = [p for p in prompt if isinstance(p, str)]
        encoded = iter(await self.engine.encode_texts(texts) if texts else [])
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompt]

    async def _plan(self, body: CompletionRequest) -> CompletionPlan:
        body.include_usage()  # refuses stream_options without stream
        prompts = await self.encode_prompts(body.prompt)
        best_of = samples_per_prompt(body.n, body.best_of, body.stream)
        _check_echo(body)
        score_only = body.max_tokens == 0
        # max_tokens 0: one token is generated (the engines' unit of work) and dropped from the answer
        opts = body.options(
            self.engine.defaults, n=best_of, top_logprobs=body.logprobs or 0, max_tokens=1 if score_only else None
        )
        if body.echo and body.logprobs is not None:
            opts = replace(opts, prompt_logprobs=body.logprobs)
        raw = [body.prompt] if isinstance(body.prompt, str) or is_int(body.prompt[0]) else body.prompt
        tok = self.engine.tokenizer
        echoes = [(p if isinstance(p, str) else decode_text(tok, list(p))) if body.echo else "" for p in raw]
        return CompletionPlan(prompts, opts, echoes, score_only)

    def _stream(self, body: CompletionRequest, plan: CompletionPlan) -> StreamingResponse:
        self.engine.validate(plan.prompts, plan.opts, field="prompt")  # refused with a 4xx before the stream starts
        n = body.n
        offsets = [len(plan.echoes[i // n]) for i in range(len(plan.prompts) * n)]
        choices = CompletionChoices(
            self.engine.tokenizer,
            plan.prompts,
            plan.echoes,
            n,
            body.logprobs,
            offsets,
            echo=body.echo,
            return_token_ids=body.return_token_ids,
        )
        spec = StreamSpec("text_completion", plan.prompts, plan.opts, n, body.include_usage())
        return self.streams.response(spec, choices)

    def _response(
        self, body: CompletionRequest, plan: CompletionPlan, results: list[PromptResult]
    ) -> CompletionResponse:
        if plan.score_only:
            _scored_only(results)
        tok = self.engine.tokenizer
        want_lp = body.logprobs is not None
        choices: list[ChoiceOut] = []
        for i, r in enumerate(results):
            echo_lp = echo_logprobs(tok, r, bool(body.logprobs)) if body.echo and want_lp else None
            for s in best_samples(r.samples, body.n):
                lp = None
                if want_lp:  # the generated tokens' text starts after the echoed prompt
                    top = s.top_logprobs if body.logprobs else None
                    lp = completion_logprobs(tok, s.token_ids, s.logprobs, top, len(plan.echoes[i]))
                    lp = _joined(echo_lp, lp) if echo_lp is not None else lp
                choices.append(
                    ChoiceOut(
                        index=len(choices),
                        text=plan.echoes[i] + s.text,
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
            model=self.engine.model_name,
            choices=choices,
            usage=usage(results),
            policy_version=self.engine.weights_version,
        )
