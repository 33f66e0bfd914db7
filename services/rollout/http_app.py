"""REST for the rollout service.

- ``POST /v1/completions``: the OpenAI / vLLM completions shape (``prompt`` as text, token ids, or a list of either;
  ``n``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``, ``stop_token_ids``, ``seed``,
  ``ignore_eos``, ``logprobs``, ``return_token_ids``), plus ``policy_version`` (the weights version that produced
  every choice). ``logprobs: N`` returns the sampled tokens' log-probs (``tokens``, ``token_logprobs``,
  ``text_offset``); ``top_logprobs`` is null: alternatives are not computed. Text prompts are tokenized as given
  (no chat template), as vLLM's completions endpoint does.
- ``POST /v1/generate``: token ids in, token ids + per-token sampling log-probs + finish reasons out.
- ``GET /v1/weights/version``: the weights version served now.
- ``GET /v1/models``: the served model, for OpenAI clients.

Fields a request leaves out take the service's defaults (the experiment config's ``actor_rollout``: temperature,
top_p, top_k, max_new_tokens, stop). Bad input is refused with 4xx naming the field (422 for a body that does not
match the schema, 400 for values the model cannot take: ids outside the vocabulary, prompts that fill the context).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from rlhf.serving import (
    InvalidArgument,
    ServiceMetrics,
    ServiceSettings,
    cancel_on_disconnect,
    create_app,
    json_response,
)
from rlhf.serving.http import Utf8Text
from services.rollout.engine import (
    MAX_N,
    MAX_SEED,
    MAX_STOP,
    MAX_TEMPERATURE,
    EngineBase,
    PromptResult,
    resolve_options,
)

TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]
PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Sampling(_Model):
    n: StrictInt = Field(1, ge=1, le=MAX_N, description="samples per prompt")
    max_tokens: StrictInt | None = Field(None, ge=1, description="new tokens per sample (default: the service's)")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0: greedy (default: the service's)")
    top_p: float | None = Field(None, gt=0, le=1, description="nucleus sampling (default: the service's)")
    top_k: StrictInt | None = Field(None, ge=-1, description="-1 or 0: off (default: the service's)")
    stop: Utf8Text | list[Utf8Text] | None = Field(None, description="stop string(s); not included in the text")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP, description="token ids that end a sample")
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED, description="sample j uses seed + j: reproducible")
    ignore_eos: StrictBool = Field(False, description="keep generating after EOS")

    def options(self, defaults: dict[str, Any]):
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return resolve_options(defaults, n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                               max_tokens=self.max_tokens, stop=stop, stop_token_ids=self.stop_token_ids,
                               seed=self.seed, ignore_eos=self.ignore_eos)  # fmt: skip


class CompletionRequest(_Sampling):
    model: str | None = Field(None, description="accepted for OpenAI compatibility; the served model answers")
    prompt: Utf8Text | list[Utf8Text] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="the prompt(s): " + PROMPT_SHAPES
    )
    logprobs: StrictInt | None = Field(None, ge=0, le=20, description="return the sampled tokens' log-probs")
    return_token_ids: StrictBool = Field(False, description="return prompt and completion token ids (vLLM)")
    stream: Literal[False] = Field(False, description="streaming is not supported")
    echo: Literal[False] = Field(False, description="echoing the prompt is not supported")
    user: str | None = Field(None, description="accepted for OpenAI compatibility; ignored")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(x, str) for x in v) or all(_is_int(x) for x in v):
                return v
            if all(isinstance(x, list) and all(_is_int(t) for t in x) for x in v):
                return v
        if isinstance(v, list) and not v:
            raise ValueError("the prompt list is empty: send at least one prompt")
        raise ValueError(f"must be {PROMPT_SHAPES}")


class GenerateRequest(_Sampling):
    prompt_token_ids: list[list[TokenId]] = Field(min_length=1, description="one list of token ids per prompt")


class LogprobsOut(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    text_offset: list[int]
    top_logprobs: None = None


class ChoiceOut(BaseModel):
    index: int
    text: str
    finish_reason: str
    stop_reason: int | str | None = None
    logprobs: LogprobsOut | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    policy_version: int


class UsageOut(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[ChoiceOut]
    usage: UsageOut
    policy_version: int = Field(description="the weights version serving when the request finished")


class CompletionOut(BaseModel):
    token_ids: list[int]
    logprobs: list[float] = Field(description="log-prob of each generated token under the sampling distribution")
    finish_reason: str = Field(description="stop (EOS, stop id or stop string) or length")
    stop_reason: int | str | None = None
    text: str
    policy_version: int


class PromptResultOut(BaseModel):
    prompt_token_ids: list[int]
    completions: list[CompletionOut]


class GenerateResponse(BaseModel):
    request_id: str
    policy_version: int
    results: list[PromptResultOut]


class WeightsVersionOut(BaseModel):
    version: int
    checksum: str
    loaded_at_unix_ms: int
    model: str
    engine: str


def _usage(results: list[PromptResult]) -> UsageOut:
    p = sum(len(r.prompt_token_ids) for r in results)
    c = sum(len(s.token_ids) for r in results for s in r.samples)
    return UsageOut(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


def _logprobs(engine: EngineBase, token_ids: list[int], logprobs: list[float]) -> LogprobsOut:
    tok = engine.tokenizer
    pieces = [tok.decode([t], skip_special_tokens=False) for t in token_ids]
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return LogprobsOut(tokens=pieces, token_logprobs=logprobs, text_offset=offsets)


def build_app(engine: EngineBase, settings: ServiceSettings, metrics: ServiceMetrics) -> FastAPI:
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
        if isinstance(prompt, str) or _is_int(prompt[0]):  # one prompt
            prompt = [prompt]
        for i, p in enumerate(prompt):
            if isinstance(p, str) and not p:
                where = f"prompt[{i}]" if len(prompt) > 1 else "prompt"
                raise InvalidArgument("the prompt is empty: send non-empty text or token ids", field=where)
        texts = [p for p in prompt if isinstance(p, str)]
        encoded = iter(await engine.encode_texts(texts) if texts else [])
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompt]

    # The engine call runs under cancel_on_disconnect: a client that hangs up cancels its generation.
    @app.post("/v1/completions", response_model=CompletionResponse, tags=["rollout"],
              summary="OpenAI-style completions with token ids, sampling log-probs, policy version")  # fmt: skip
    async def completions(body: CompletionRequest, request: Request) -> CompletionResponse:
        prompts = await encode_prompts(body.prompt)
        opts = body.options(engine.defaults)
        metrics.observe_batch("/v1/completions", len(prompts) * opts.n)
        results = await cancel_on_disconnect(request, engine.generate(prompts, opts, field="prompt"))
        choices = []
        for r in results:
            for s in r.samples:
                choices.append(
                    ChoiceOut(
                        index=len(choices),
                        text=s.text,
                        finish_reason=s.finish_reason,
                        stop_reason=s.stop_reason,
                        logprobs=_logprobs(engine, s.token_ids, s.logprobs) if body.logprobs is not None else None,
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

    # The training clients' hot path: the engine's results are typed already, so they are rendered once
    # (json_response) instead of being validated again through a response_model; OpenAPI keeps the schema.
    @app.post("/v1/generate", response_model=None, tags=["rollout"],
              responses={200: {"model": GenerateResponse, "description": "one result per prompt, in order"}},
              summary="token ids in; token ids, sampling log-probs and finish reasons out")  # fmt: skip
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

    @app.get("/v1/weights/version", response_model=WeightsVersionOut, tags=["rollout"],
             summary="the weights version served now")  # fmt: skip
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
