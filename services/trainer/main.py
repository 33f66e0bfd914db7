"""``rlhf serve trainer``: settings -> the ring driver (``loop.Trainer``) -> its gRPC and HTTP servers."""

from __future__ import annotations

import logging

from rlhf.config import config_warning, load_config
from rlhf.serving import ServiceMetrics, ServiceRunner, ServiceSettings
from rlhf.v1 import trainer_pb2_grpc
from services.trainer.grpc_servicer import SERVICE_NAME, TrainerServicer
from services.trainer.http_app import build_app
from services.trainer.loop import Trainer


async def serve(config_path: str, settings: ServiceSettings) -> None:
    cfg = load_config(config_path)
    warning = config_warning(cfg)
    if warning:  # once per run, in the trainer's log (rlhf up also prints it before anything starts)
        logging.getLogger("rlhf.trainer").warning("%s", warning)
    if not settings.redis_url:
        raise SystemExit("rlhf serve trainer: set RLHF_REDIS_URL (the experience queue)")
    metrics = ServiceMetrics("trainer")
    runner = ServiceRunner("trainer", settings, metrics)
    trainer = Trainer(cfg, settings, runner)
    runner.add_grpc(
        trainer_pb2_grpc.add_TrainerServiceServicer_to_server, [SERVICE_NAME], TrainerServicer(trainer, metrics)
    )
    runner.set_http_app(build_app(trainer, settings, metrics))
    await runner.run(startup=trainer.start, shutdown=trainer.stop)
