"""``rlhf serve environment``: settings + config (``environment``) -> engine -> gRPC and HTTP servers."""

from __future__ import annotations

from rlhf.config import load_config
from rlhf.serving import ServiceMetrics, ServiceRunner, ServiceSettings
from rlhf.v1 import environment_pb2_grpc
from services.environment.engine import EnvironmentEngine
from services.environment.grpc_servicer import SERVICE_NAME, EnvironmentServicer
from services.environment.http_app import build_app

# `rlhf serve` may skip interpreter finalisation after serve() returns: the engine closed its episodes by then.
FAST_EXIT = True


def build_runner(engine: EnvironmentEngine, settings: ServiceSettings, metrics: ServiceMetrics) -> ServiceRunner:
    """Both servers over ``engine``; ``runner.run(startup=engine.start, shutdown=engine.close)`` serves them."""
    runner = ServiceRunner("environment", settings, metrics)
    runner.add_grpc(
        environment_pb2_grpc.add_EnvironmentServiceServicer_to_server,
        [SERVICE_NAME],
        EnvironmentServicer(engine, settings, metrics),
    )
    runner.set_http_app(build_app(engine, settings, metrics))
    return runner


async def serve(config_path: str, settings: ServiceSettings) -> None:
    cfg = load_config(config_path)
    metrics = ServiceMetrics("environment")
    engine = EnvironmentEngine.from_config(cfg, metrics=metrics)
    await build_runner(engine, settings, metrics).run(startup=engine.start, shutdown=engine.close)
