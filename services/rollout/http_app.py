"""REST for the rollout service: OpenAI / vLLM compatible ``/v1/completions`` and ``/v1/chat/completions`` (streamed
or not, tool calling, prompt log-probs with ``echo``), plus ``/v1/generate`` (token ids in, token ids and sampling
log-probs out), ``/v1/weights/version`` and ``/v1/models``.

Every field, default and error of these routes: docs/services.md#rollout.
"""

from __future__ import annotations

from fastapi import FastAPI

from rlhf.serving import ServiceMetrics, ServiceSettings, create_app
from services.rollout.api_router import RolloutServing, router
from services.rollout.engine import EngineBase
from services.rollout.serving import ServingGenerate
from services.rollout.serving_chat import OpenAIServingChat
from services.rollout.serving_completion import OpenAIServingCompletion


def build_app(
    engine: EngineBase, settings: ServiceSettings, metrics: ServiceMetrics, *, tool_call_parser: str = "hermes"
) -> FastAPI:
    """The rollout's app: the serving classes over ``engine`` (services.rollout.serving*) behind the routes of
    services.rollout.api_router."""
    chat = OpenAIServingChat(engine, metrics, tool_call_parser=tool_call_parser)  # refuses an unknown parser
    app = create_app(
        "rollout",
        settings,
        metrics,
        title="rlhf rollout service",
        description="Generates with the current policy weights (vLLM or transformers): OpenAI-style completions, "
        "tokens-in/tokens-out generation with per-token sampling log-probs, and the served weights version.",
    )
    app.state.rollout = RolloutServing(
        engine=engine,
        completion=OpenAIServingCompletion(engine, metrics),
        chat=chat,
        generate=ServingGenerate(engine, metrics),
    )
    app.include_router(router)
    return app
