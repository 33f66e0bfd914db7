"""REST for the reward service: ``POST /v1/score`` (batch, per-item status) and OpenRLHF's ``POST /get_reward``."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool
from pydantic.json_schema import SkipJsonSchema

from rlhf.serving import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ServiceMetrics,
    ServiceSettings,
    create_app,
    http_error_responses,
    json_response,
)
from rlhf.serving.http import Declared, TokenId, Utf8Text
from services.reward.engine import MAX_IDS, MAX_ITEMS, MAX_TEXT_CHARS, RewardEngine
from services.reward.scorers import INVALID_INPUT, OK, STATUSES, TIMEOUT, Item

# The engine's limits (a 400 naming the field), stated in the schema. Token ids must also be ids of a reward model's
# vocabulary, and prompt + response must fit its context: those depend on the configured models (400 otherwise).
Text = Annotated[Utf8Text, Declared(maxLength=MAX_TEXT_CHARS)]
NonEmptyText = Annotated[Utf8Text, Declared(minLength=1, maxLength=MAX_TEXT_CHARS)]
TokenIds = Annotated[list[TokenId], Declared(maxItems=MAX_IDS)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ScoreItemIn(_Model):
    # the prompt may be empty only when prompt_ids are given (checked by the engine: 400)
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "anyOf": [
                {"properties": {"prompt": {"minLength": 1}}},
                {"properties": {"prompt_ids": {"minItems": 1}}, "required": ["prompt_ids"]},
            ]
        },
    )

    prompt: Text = Field(description="prompt text (may be empty only when prompt_ids are given)")
    response: Text = Field(description="response text to score")
    label: Text | None = Field(None, description="reference answer for rule scorers (math_answer, exact_match)")
    prompt_ids: TokenIds = Field([], description="optional prompt token ids")
    response_ids: TokenIds = Field([], description="optional response token ids (length rule counts them)")
    finished: StrictBool = Field(True, description="the response ended with EOS or a stop string")


class ScoreRequestIn(_Model):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"items": [{"prompt": "What is 1 plus 2?", "response": "3", "label": "3"}]}]},
    )

    items: list[ScoreItemIn] = Field(min_length=1, max_length=MAX_ITEMS, description="items to score")


class ScoreResultOut(BaseModel):
    score: float | None = Field(description="combined weighted score; null unless status is ok")
    status: Literal[STATUSES] = Field(description="ok, invalid_input, scorer_error or timeout")
    error: str | None = Field(None, description="what failed, when status is not ok")
    components: dict[str, float] = Field(description="per-scorer scores before weighting (those that succeeded)")


class ScorerInfo(BaseModel):
    name: str
    type: str
    weight: float


class ScoreResponseOut(BaseModel):
    results: list[ScoreResultOut] = Field(description="one per item, in request order")
    scorers: list[ScorerInfo]


def _get_reward_schema(schema: dict[str, Any]) -> None:
    # prompts: required (refused with a 400 that says what OpenRLHF sends, rather than pydantic's 422)
    schema["required"] = [*schema.get("required", []), "prompts"]
    schema["properties"]["prompts"].pop("default", None)
    schema["examples"] = [{"query": ["What is 1 plus 2? 3"], "prompts": ["What is 1 plus 2? "], "labels": ["3"]}]


class GetRewardIn(_Model):
    """One query per item; ``prompts`` and ``labels`` (when given) have one entry per query, and each query starts
    with its prompt (400 otherwise: JSON Schema cannot say so)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_get_reward_schema)

    query: list[NonEmptyText] = Field(min_length=1, max_length=MAX_ITEMS, description="prompt + response texts")
    prompts: Annotated[list[NonEmptyText], Declared(minItems=1, maxItems=MAX_ITEMS)] | SkipJsonSchema[None] = Field(
        None, description="the prompt of each query (a prefix of it)"
    )
    labels: list[Text | None] | None = Field(None, description="reference answers, one per query")


class GetRewardOut(BaseModel):
    rewards: list[float]
    scores: list[float]


def _items_from_get_reward(body: GetRewardIn) -> list[Item]:
    if body.prompts is None:
        raise InvalidArgument("prompts is missing: send the prompt of each query (OpenRLHF sends it)", "prompts")
    if len(body.prompts) != len(body.query):
        raise InvalidArgument(
            f"prompts has {len(body.prompts)} entries for {len(body.query)} queries; send one each", "prompts"
        )
    if body.labels is not None and len(body.labels) != len(body.query):
        raise InvalidArgument(
            f"labels has {len(body.labels)} entries for {len(body.query)} queries; send one each (or none)", "labels"
        )
    items = []
    for i, (q, p) in enumerate(zip(body.query, body.prompts, strict=True)):
        if not p:
            raise InvalidArgument(f"prompts[{i}] is empty: send the prompt of query[{i}]", f"prompts[{i}]")
        if not q.startswith(p):
            raise InvalidArgument(
                f"query[{i}] does not start with prompts[{i}]: send query = prompt + response", f"query[{i}]"
            )
        items.append(Item(prompt=p, response=q[len(p) :], label=body.labels[i] if body.labels else None))
    return items


def build_app(engine: RewardEngine, settings: ServiceSettings, metrics: ServiceMetrics) -> FastAPI:
    app = create_app(
        "reward",
        settings,
        metrics,
        title="rlhf reward service",
        description="Scores (prompt, response[, label]) with the configured scorers, combined by weight. "
        "A failing scorer gives the item an error status, never a score of 0.",
    )

    # The results are already typed by the engine: rendered once by json_response rather than validated again
    # through a response_model; the schema stays in OpenAPI through `responses`.
    @app.post(
        "/v1/score",
        response_model=None,
        responses={
            200: {"model": ScoreResponseOut, "description": "one result per item, in request order"},
            **http_error_responses(503),
        },
        tags=["reward"],
        summary="score a batch; every item gets a score or an error status",
    )
    async def score(body: ScoreRequestIn) -> Response:
        items = [
            Item(it.prompt, it.response, it.label, it.prompt_ids, it.response_ids, it.finished) for it in body.items
        ]
        metrics.observe_batch("/v1/score", len(items))
        outcomes = await engine.score(items)
        results = [
            {"score": o.score, "status": o.status, "error": o.error or None, "components": o.components}
            for o in outcomes
        ]
        return json_response({"results": results, "scorers": engine.describe()})

    @app.post(
        "/get_reward",
        response_model=None,
        responses={
            200: {"model": GetRewardOut, "description": "one reward per query"},
            **http_error_responses(503, 504),  # 504: a scorer timed out; 500: a scorer failed (never a 0 reward)
        },
        tags=["reward"],
        summary="OpenRLHF remote reward: {query, prompts, labels} -> {rewards}",
    )
    async def get_reward(body: GetRewardIn) -> Response:
        items = _items_from_get_reward(body)
        metrics.observe_batch("/get_reward", len(items))
        outcomes = await engine.score(items)
        failed = [(i, o) for i, o in enumerate(outcomes) if o.status != OK]
        if failed:
            i, o = failed[0]
            more = f" (and {len(failed) - 1} more failed items)" if len(failed) > 1 else ""
            msg = f"query[{i}]: {o.error}{more}; no rewards returned rather than made-up ones"
            if all(o.status == INVALID_INPUT for _, o in failed):
                raise InvalidArgument(msg, f"query[{i}]")
            if any(o.status == TIMEOUT for _, o in failed):
                raise DeadlineExceeded(msg, f"query[{i}]")
            raise Internal(msg, f"query[{i}]")
        rewards = [float(o.score) for o in outcomes]
        return json_response({"rewards": rewards, "scores": rewards})

    @app.get("/v1/scorers", response_model=list[ScorerInfo], tags=["reward"], summary="the configured scorers")
    async def scorers() -> list[ScorerInfo]:
        return [ScorerInfo(**d) for d in engine.describe()]

    return app
