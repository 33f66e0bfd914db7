"""REST for the reference service: ``POST /v1/logprobs``."""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from rlhf.serving import ServiceMetrics, ServiceSettings, create_app, json_response
from services.reference.engine import MAX_ITEMS, MAX_TEMPERATURE, MIN_TEMPERATURE, LogProbsItem, ReferenceEngine

TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LogProbsItemIn(_Model):
    prompt_ids: list[TokenId] = Field(min_length=1, description="prompt token ids (at least one)")
    response_ids: list[TokenId] = Field(min_length=1, description="response token ids whose log-probs are wanted")


class LogProbsRequestIn(_Model):
    items: list[LogProbsItemIn] = Field(min_length=1, max_length=MAX_ITEMS)
    temperature: float | None = Field(
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
        responses={200: {"model": LogProbsResponseOut, "description": "one result per item, in request order"}},
        tags=["reference"],
        summary="log p_ref(response_t | prompt, response_<t) per response token",
    )
    async def logprobs(body: LogProbsRequestIn) -> Response:
        items = [LogProbsItem(it.prompt_ids, it.response_ids) for it in body.items]
        metrics.observe_batch("/v1/logprobs", len(items))
        results, t = await engine.logprobs(items, body.temperature)
        return json_response({"results": [{"logprobs": lp} for lp in results], "temperature": t})

    @app.get("/v1/info", tags=["reference"], summary="model, temperature, vocabulary size and context length")
    async def info() -> dict:
        return engine.info()

    return app
