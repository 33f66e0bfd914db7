"""``rlhf serve rollout``: settings + config -> engine -> gRPC and HTTP servers (+ the Redis worker when configured).

Both servers bind first; the engine (``actor_rollout_ref.actor_rollout.engine``, overridden by
``RLHF_ROLLOUT_ENGINE``) then loads the model, and only then is the service ready. With ``RLHF_REDIS_URL`` set the
worker (:mod:`services.rollout.worker`) also pulls prompt jobs, sharing the engine with REST and gRPC clients.
``RLHF_ROLLOUT_GPU_MEMORY_UTILIZATION`` / ``RLHF_ROLLOUT_MAX_MODEL_LEN`` override the config's fields of those
names. Design: docs/services.md#rollout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rlhf.config import load_config
from rlhf.serving import ServiceMetrics, ServiceRunner, ServiceSettings, register_env_var
from rlhf.serving.model_process import forward_threads, set_torch_threads
from services.rollout.engine_types import EngineHooks, SwapResult
from services.rollout.factory import ENGINE_ENV_VAR, apply_rollout_env, engine_kind, make_engine
from services.rollout.grpc_servicer import SERVICE_NAME, RolloutServicer, add_to_server
from services.rollout.http_app import build_app
from services.rollout.late_join import load_latest_checkpoint
from services.rollout.swap import SwapGate
from services.rollout.worker import maybe_start_worker  # at import: registers the RLHF_ROLLOUT_* variables

register_env_var(ENGINE_ENV_VAR)

log = logging.getLogger("rlhf.rollout")

# `rlhf serve` may skip interpreter finalisation after serve() returns: the engine is closed by then (the vLLM engine
# thread joined, an AsyncLLM engine-core subprocess shut down) and nothing relies on atexit hooks.
FAST_EXIT = True


SWAP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GateCollector(Collector):
    """The swap gate's state at each scrape: ``rlhf_rollout_busy_seconds_total`` (seconds with at least one request
    admitted; an idle fraction is 1 - its rise over the wall time) and ``rlhf_rollout_active_requests``."""

    def __init__(self, service: str, gate: SwapGate):
        self.service, self.gate = service, gate

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        busy = CounterMetricFamily(
            "rlhf_rollout_busy_seconds", "seconds with at least one request admitted", labels=["service"]
        )
        busy.add_metric([self.service], self.gate.busy_seconds())
        active = GaugeMetricFamily("rlhf_rollout_active_requests", "requests admitted now", labels=["service"])
        active.add_metric([self.service], self.gate.active)
        yield busy
        yield active


def engine_hooks(metrics: ServiceMetrics) -> EngineHooks:
    """Engine observations -> Prometheus: sequences per engine step (``rlhf_batch_size{method="engine_step"}``),
    prompt and generated tokens (``rlhf_tokens_total{kind}``), and per weight update installed its wait for the
    requests in flight (``rlhf_rollout_swap_wait_seconds``) and its pause (``rlhf_rollout_swap_seconds``)."""
    wait = Histogram(
        "rlhf_rollout_swap_wait_seconds",
        "a weight update's wait for the requests in flight (to finish, or with partial rollouts to stop)",
        ["service"],
        buckets=SWAP_BUCKETS,
        registry=metrics.registry,
    ).labels(metrics.name)
    pause = Histogram(
        "rlhf_rollout_swap_seconds",
        "a weight update's install, generation paused",
        ["service"],
        buckets=SWAP_BUCKETS,
        registry=metrics.registry,
    ).labels(metrics.name)

    def on_swap(result: SwapResult) -> None:
        wait.observe(result.wait_seconds)
        pause.observe(result.swap_seconds)

    return EngineHooks(
        on_step=lambda n: metrics.observe_batch("engine_step", n),
        on_tokens=metrics.add_tokens,
        on_swap=on_swap,
    )


async def serve(config_path: str, settings: ServiceSettings) -> None:
    cfg = apply_rollout_env(load_config(config_path))
    kind = engine_kind(cfg)
    if kind == "vllm":  # before anything imports torch (OMP_NUM_THREADS is read when torch loads)
        from services.rollout.vllm_engine import set_vllm_env_defaults  # noqa: PLC0415 - loads torch, which must come after this

        set_vllm_env_defaults(settings.device)
    else:  # the hf engine's decode: one torch thread fewer than the process has, the serving loop keeps a core
        set_torch_threads(forward_threads(settings.model_threads))
    metrics = ServiceMetrics("rollout")
    engine = make_engine(cfg, kind=kind, device=settings.device, hooks=engine_hooks(metrics))
    metrics.registry.register(GateCollector(metrics.name, engine.gate))
    runner = ServiceRunner("rollout", settings, metrics)
    servicer = RolloutServicer(engine, settings, metrics)
    runner.add_grpc(
        add_to_server,  # the generated add_..._to_server, with a copy-free decoder for UpdateWeights
        [SERVICE_NAME],
        servicer,
    )
    parser = cfg.actor_rollout_ref.actor_rollout.tool_call_parser
    runner.set_http_app(build_app(engine, settings, metrics, tool_call_parser=parser))
    runner.add_readiness_check(lambda: engine.ready)
    worker = None

    async def startup() -> None:
        nonlocal worker
        if settings.weights_data_port is not None and settings.tls:
            log.warning("rollout: RLHF_WEIGHTS_DATA_PORT ignored: the data plane is plaintext and TLS is on")
        elif settings.weights_data_port is not None:
            port = await servicer.start_data_plane(settings.host, settings.weights_data_port)
            log.info("rollout: weights data plane on %s:%d", settings.host, port)
        await engine.start()
        if settings.redis_url:  # a replica of a run: start from the run's newest checkpoint, if any (late_join.py)
            await load_latest_checkpoint(engine, cfg, settings)
        log.info(
            "rollout: %s engine serving %s (weights version %d)", engine.kind, engine.model_name, engine.weights_version
        )
        worker = maybe_start_worker(engine, settings, cfg, metrics=metrics)

    # SIGTERM (a scale-in, a preStop hook): the worker stops reading jobs at once, before the servers' grace period;
    # shutdown() then waits for its jobs in flight (docs/reliability.md, "An elastic fleet")
    runner.add_stop_hook(lambda: worker.stop() if worker is not None else None)

    async def shutdown() -> None:
        if worker is not None:
            await worker.aclose()
        await servicer.close_data_plane()
        await engine.close()

    await runner.run(startup=startup, shutdown=shutdown)
