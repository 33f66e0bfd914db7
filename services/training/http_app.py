"""REST of the training service: the tinker SDK's HTTP API (``/api/v1/...``, tinker 0.38.0), plus ``GET /v1/info``.

Shapes are the SDK's (tinker/types, services.training.tinker_protocol): JSON bodies, except forward_backward's request
and its result, which are protobuf (proto/rlhf/v1/tinker.proto). Long-running calls answer ``{"request_id": ...}`` at
once and the client polls ``/api/v1/retrieve_future``. Every call but the health checks needs a token: the SDK's
``X-API-Key`` header (``TINKER_API_KEY``) or ``Authorization: Bearer``, one of the service's tokens
(``RLHF_API_TOKEN``, ``RLHF_TRAINING_TOKENS``); each token is one user. The compatibility table: docs/tinker.md.
"""

from __future__ import annotations

from fastapi import FastAPI

from rlhf.serving import ServiceMetrics, ServiceSettings, create_app
from services.training.api_router import TrainingServing, ours, router
from services.training.engine import TrainingEngine
from services.training.serving import TinkerServing, TokenAuth


def build_app(engine: TrainingEngine, settings: ServiceSettings, metrics: ServiceMetrics, tokens: list[str]) -> FastAPI:
    """The training service's app: :class:`TinkerServing` over ``engine`` behind the routes of
    services.training.api_router."""
    app = create_app(
        "training",
        settings,
        metrics,
        title="rlhf training service",
        description="Client-driven LoRA training over one base model: the tinker SDK's HTTP API.",
    )
    app.state.training = TrainingServing(auth=TokenAuth(tokens), tinker=TinkerServing(engine, settings))
    app.include_router(router)
    app.include_router(ours)
    return app
