"""``rlhf serve training``: settings + config -> engine -> gRPC (health) and HTTP servers.

The base model is the config's ``actor_rollout_ref.actor_rollout.load``; checkpoints go under ``<training.save>/tinker``
(one folder per training run). Tokens: ``RLHF_API_TOKEN`` and the comma-separated ``RLHF_TRAINING_TOKENS``, one per
user.
"""

from __future__ import annotations

import os

from rlhf.config import load_config
from rlhf.serving import ServiceMetrics, ServiceRunner, ServiceSettings
from services.training.engine import TrainingEngine
from services.training.fleet import FleetSampler
from services.training.http_app import build_app
from services.training.sessions import SESSION_TTL_S

FAST_EXIT = True
# both listed in rlhf.serving.settings.LIBRARY_ENV_VARS
TOKENS_ENV = "RLHF_TRAINING_TOKENS"
TTL_ENV = "RLHF_TRAINING_SESSION_TTL_S"


def tokens(settings: ServiceSettings) -> list[str]:
    extra = [t.strip() for t in os.environ.get(TOKENS_ENV, "").split(",") if t.strip()]
    return ([settings.api_token] if settings.api_token else []) + extra


def session_ttl() -> float:
    raw = os.environ.get(TTL_ENV)
    if raw is None:
        return SESSION_TTL_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TTL_ENV}={raw!r}: give seconds, a number > 0") from None
    if not value > 0:
        raise ValueError(f"{TTL_ENV}={raw!r}: give seconds, a number > 0")
    return value


async def serve(config_path: str, settings: ServiceSettings) -> None:
    cfg = load_config(config_path)
    metrics = ServiceMetrics("training")
    accepted = tokens(settings)
    # RLHF_ROLLOUT_ADDRS: rollout replicas that answer the samplers over an adapter (docs/tinker.md)
    fleet = FleetSampler(settings.rollout_addrs, settings, cfg.actor.load) if settings.rollout_addrs else None
    engine = TrainingEngine(
        cfg.actor.load,
        root=os.path.join(cfg.training.save, "tinker"),
        device=settings.device or cfg.training.device,
        session_ttl_s=session_ttl(),
        fleet=fleet,
    )
    runner = ServiceRunner("training", settings, metrics)
    runner.set_http_app(build_app(engine, settings, metrics, accepted))
    runner.add_readiness_check(lambda: engine.ready)
    await runner.run(startup=engine.start, shutdown=engine.close)
