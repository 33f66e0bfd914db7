"""``rlhf serve reward``: settings + config -> engine -> gRPC and HTTP servers."""

from __future__ import annotations

from rlhf.config import load_config
from rlhf.serving import ServiceMetrics, ServiceRunner, ServiceSettings
from rlhf.serving.model_process import forward_threads
from rlhf.v1 import reward_pb2_grpc
from services.reward.engine import RewardEngine
from services.reward.grpc_servicer import SERVICE_NAME, RewardServicer
from services.reward.http_app import build_app

# `rlhf serve` may skip interpreter finalisation after serve() returns: nothing here relies on atexit hooks.
FAST_EXIT = True


async def serve(config_path: str, settings: ServiceSettings) -> None:
    cfg = load_config(config_path)
    metrics = ServiceMetrics("reward")
    engine = RewardEngine(
        cfg,
        device=settings.device,
        metrics=metrics,
        model_process=settings.model_process,
        threads=forward_threads(settings.model_threads),
    )
    runner = ServiceRunner("reward", settings, metrics)
    runner.add_grpc(
        reward_pb2_grpc.add_RewardServiceServicer_to_server, [SERVICE_NAME], RewardServicer(engine, metrics)
    )
    runner.set_http_app(build_app(engine, settings, metrics))
    await runner.run(startup=engine.start, shutdown=engine.close)
