"""REST for the reference service: ``POST /v1/logprobs``."""

from __future__ import annotations

from fastapi import FastAPI, Response
from pydantic import BaseModel, ConfigDict, Field, StrictFloat

from rlhf.serving import ServiceMetrics, ServiceSettings, create_app, http_error_responses, json_response
from rlhf.serving.http import TokenId
from services.reference.engine import MAX_ITEMS, MAX_TEMPERATURE, MIN_TEMPERATURE, LogProbsItem, ReferenceEngine


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LogProbsItemIn(_Model):
    """Ids of the policy's tokenizer, below the model's ``vocab_size``, with prompt_ids + response_ids at most its
    ``max_length`` (``GET /v1/info``): 400 otherwise, naming the field."""

    prompt_ids: list[TokenId] = Field(min_length=1, description="prompt token ids (at least one)")
    response_ids: list[TokenId] = Field(min_length=1, description="response token ids whose log-probs are wanted")


class LogProbsRequestIn(_Model):
    model_config = ConfigDict(
        extra="forbid", json_schema_extra={"examples": [{"items": [{"prompt_ids": [2, 5, 6], "response_ids": [7, 8]}]}]}
    )

    items: list[LogProbsItemIn] = Field(min_length=1, max_length=MAX_ITEMS)
    temperature: StrictFloat | None = Field(
        None,
        ge=MIN_TEMPERATURE,
        le=MAX_TEMPERATURE,
        allow_inf_nan=False,
        description="default: the service's configured temperature",
    )


class TokenLogProbsOut(BaseModel):
    logprobs: list[float] = Field(description="one per response token")


class LogProbsResponseOut(BaseModel):
    results: list[TokenLogProbsOut] = Field(description="one per item, in request order")
    temperature: float


class InfoOut(BaseModel):
    model: str
    temperature: float
    vocab_size: int = Field(description="token ids must be below it (0 until the model is loaded)")
    max_length: int = Field(description="the most prompt + response tokens per item (0 until the model is loaded)")
    micro_batch_size: int


def build_app(engine: ReferenceEngine, settings: ServiceSettings, metrics: ServiceMetrics) -> FastAPI:
    app = create_app(
        "reference",
        settings,
        metrics,
        title="rlhf reference service",
        description="Per-token log-probs of response tokens under the frozen reference policy.",
    )

    # Rendered once by json_response (the engine's floats need no second validation through a response_model);
    # the schema stays in OpenAPI through `responses`.
    @app.post(
        "/v1/logprobs",
        response_model=None,
        responses={
            200: {"model": LogProbsResponseOut, "description": "one result per item, in request order"},
            **http_error_responses(503),
        },
        tags=["reference"],
        summary="log p_ref(response_t | prompt, response_<t) per response token",
    )
    async def logprobs(body: LogProbsRequestIn) -> Response:
        items = [LogProbsItem(it.prompt_ids, it.response_ids) for it in body.items]
        metrics.observe_batch("/v1/logprobs", len(items))
        results, t = await engine.logprobs(items, body.temperature)
        return json_response({"results": [{"logprobs": lp} for lp in results], "temperature": t})

    @app.get(
        "/v1/info",
        tags=["reference"],
        summary="model, temperature, vocabulary size and context length",
        response_model=InfoOut,
    )
    async def info() -> dict:
        return engine.info()

    return app
