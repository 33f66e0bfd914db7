"""The rollout's REST routes: each hands its request to the serving class that ``build_app``
(services.rollout.http_app) puts on ``app.state.rollout`` (a :class:`RolloutServing`).

Every field, default and error of these routes: docs/services.md#rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response

from rlhf.serving import http_error_responses
from rlhf.serving.http import ContractRoute
from services.rollout.engine import EngineBase
from services.rollout.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    GenerateResponse,
    WeightsVersionOut,
)
from services.rollout.serving import ServingGenerate
from services.rollout.serving_chat import OpenAIServingChat
from services.rollout.serving_completion import OpenAIServingCompletion


@dataclass(frozen=True)
class RolloutServing:
    """What the routes call: the serving classes over one engine."""

    engine: EngineBase
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    generate: ServingGenerate


def _serving(request: Request) -> RolloutServing:
    return request.app.state.rollout


def _streamed() -> dict[int | str, dict[str, Any]]:
    return {
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE chunks with stream: true"},
        **http_error_responses(503),
    }


# ContractRoute: the error statuses in OpenAPI, as on the routes create_app adds (include_router keeps the class)
router = APIRouter(route_class=ContractRoute)


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    tags=["rollout"],
    summary="OpenAI-style completions with token ids, sampling log-probs, policy version",
    responses=_streamed(),
)
async def completions(body: CompletionRequest, request: Request) -> Any:
    return await _serving(request).completion.create_completion(body, request)


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    tags=["rollout"],
    summary="OpenAI-style chat completions (the served tokenizer's chat template)",
    responses=_streamed(),
)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    return await _serving(request).chat.create_chat_completion(body, request)


@router.post(
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
    return await _serving(request).generate.create_generate(body, request)


@router.get(
    "/v1/weights/version",
    response_model=WeightsVersionOut,
    tags=["rollout"],
    summary="the weights version served now",
)
async def weights_version(request: Request) -> WeightsVersionOut:
    engine = _serving(request).engine
    return WeightsVersionOut(
        version=engine.weights_version,
        checksum=engine.weights_checksum,
        loaded_at_unix_ms=engine.loaded_at_unix_ms,
        model=engine.model_name,
        engine=engine.kind,
    )


@router.get("/v1/models", tags=["rollout"], summary="the served model (OpenAI clients list models first)")
async def models(request: Request) -> dict[str, Any]:
    name = _serving(request).engine.model_name
    return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "rlhf-pipeline"}]}
