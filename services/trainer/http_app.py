"""The trainer's REST API: ``GET /v1/status`` and token-protected ``/v1/checkpoint``, ``/v1/pause``, ``/v1/resume``."""

from __future__ import annotations

from fastapi import Depends
from google.protobuf.json_format import MessageToDict

from rlhf.serving import ServiceMetrics, ServiceSettings, create_app, http_error_responses, http_token_dependency
from services.trainer.loop import Trainer


def build_app(trainer: Trainer, settings: ServiceSettings, metrics: ServiceMetrics):
    app = create_app("trainer", settings, metrics, description="RLHF trainer: status and admin calls")
    admin = [Depends(http_token_dependency(settings))]

    # 503: Redis unreachable (status) or the trainer still starting (checkpoint); 401/403 come with the token check
    @app.get(
        "/v1/status",
        summary="step, policy version, queue depths, staleness and the last step's metrics",
        responses=http_error_responses(503),
    )
    async def status() -> dict:
        return MessageToDict(await trainer.status(), preserving_proto_field_name=True)

    @app.post(
        "/v1/checkpoint",
        dependencies=admin,
        summary="write a checkpoint now (token required)",
        responses=http_error_responses(503),
    )
    async def checkpoint() -> dict:
        path = await trainer.checkpoint()
        return {"path": str(path), "step": trainer.engine.step_count}

    @app.post("/v1/pause", dependencies=admin, summary="stop publishing and training (token required)")
    async def pause() -> dict:
        trainer.paused.set()
        return {"paused": True}

    @app.post("/v1/resume", dependencies=admin, summary="resume after /v1/pause (token required)")
    async def resume() -> dict:
        trainer.paused.clear()
        return {"paused": False}

    return app
