"""``rlhf serve trainer``: settings -> the ring driver (``loop.Trainer``) -> its gRPC and HTTP servers.

Under torchrun (``WORLD_SIZE`` > 1) only rank 0 is that; every other rank follows it (:func:`follow`)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from rlhf import distributed, runlog
from rlhf.config import config_warning, load_config
from rlhf.serving import ServiceMetrics, ServiceRunner, ServiceSettings
from rlhf.v1 import trainer_pb2_grpc
from services.trainer.engine import TrainerEngine
from services.trainer.grpc_servicer import SERVICE_NAME, TrainerServicer
from services.trainer.http_app import build_app
from services.trainer.loop import Trainer

log = logging.getLogger("rlhf.trainer")


def follow(cfg, settings: ServiceSettings) -> None:
    """Ranks other than 0 of a torchrun trainer group: no servers, no Redis; take part in rank 0's steps, gathers
    and checkpoints until it says stop. SIGTERM is left to rank 0 (it checkpoints with this rank's shards, then
    stops the group); a rank 0 that died fails this rank's next collective, and torchrun ends the group."""
    engine = TrainerEngine(cfg, settings.device)
    log.info("trainer rank %d of %d follows rank 0", engine.group.rank, engine.group.world_size)
    engine.follow()
    distributed.destroy()


async def serve(config_path: str, settings: ServiceSettings) -> None:
    cfg = load_config(config_path)
    if distributed.world_size_from_env() > 1 and int(os.environ.get("RANK", "0")) != 0:
        signal.signal(signal.SIGTERM, lambda *_: log.info("SIGTERM: rank 0 leads the stop"))
        await asyncio.to_thread(follow, cfg, settings)
        return
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
    try:
        await runner.run(startup=trainer.start, shutdown=trainer.stop)
    except runlog.StoppedByRule:
        pass  # a rule stopped the run at start-up (the first push): logged; the exit code follows
    finally:
        # rank 0 of a group leaves it too: gloo work left to interpreter exit aborts the process (pytorch#179291)
        distributed.destroy()
    if trainer.exit_code is not None:  # a failed step (1) or a stopping rule: the runner stopped without a checkpoint
        raise SystemExit(trainer.exit_code)
