"""``rlhf serve reference``: settings + config -> engine -> gRPC and HTTP servers."""

from __future__ import annotations

from rlhf.config import load_config
from rlhf.serving import ServiceMetrics, ServiceRunner, ServiceSettings
from rlhf.serving.model_process import forward_threads
from rlhf.v1 import reference_pb2_grpc
from services.reference.engine import ReferenceEngine
from services.reference.grpc_servicer import SERVICE_NAME, ReferenceServicer
from services.reference.http_app import build_app

# `rlhf serve` may skip interpreter finalisation after serve() returns: nothing here relies on atexit hooks.
FAST_EXIT = True


async def serve(config_path: str, settings: ServiceSettings) -> None:
    cfg = load_config(config_path)
    metrics = ServiceMetrics("reference")
    engine = ReferenceEngine(
        cfg,
        device=settings.device,
        metrics=metrics,
        model_process=settings.model_process,
        threads=forward_threads(settings.model_threads),
    )
    runner = ServiceRunner("reference", settings, metrics)
    servicer = ReferenceServicer(engine, metrics)
    runner.add_grpc(reference_pb2_grpc.add_ReferenceServiceServicer_to_server, [SERVICE_NAME], servicer)
    runner.set_http_app(build_app(engine, settings, metrics))
    await runner.run(startup=engine.start, shutdown=engine.close)
