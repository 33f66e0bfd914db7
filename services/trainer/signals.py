"""The ring's scaling signals on the trainer's ``/metrics``: what says whether more rollout replicas would help.

The trainer is the one process that sees the whole ring, so it publishes the run's queue depths (read from Redis every
``REFRESH_S`` and after each step) and its own wait for experience:

- ``rlhf_ring_jobs_waiting``: prompt jobs issued and not yet taken by any replica (the rollout group's lag);
- ``rlhf_ring_jobs_running``: jobs a replica holds (read, not yet written back: the group's pending entries);
- ``rlhf_ring_experience_waiting``: records written and not yet read by the trainer;
- ``rlhf_ring_jobs_admitted`` / ``rlhf_ring_admission_capacity``: jobs issued and not yet trained on, and the
  admission bound on them, ``(max_staleness + 1) x global_batch_size``;
- ``rlhf_trainer_experience_wait_seconds``: per step, the wait for its batch (a histogram; its rate of sum is the
  share of the time the trainer waits).

All labelled ``service="trainer"``. How the chart's autoscaling reads them: docs/deploy.md#scaling-signals.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from prometheus_client import Gauge, Histogram

from rlhf.serving import ServiceMetrics
from rlhf.transport import queue_stats
from rlhf.transport.stream_admin import QueueStats

log = logging.getLogger("rlhf.trainer")

REFRESH_S = 2.0  # a few times per scrape interval (serviceMonitor.interval, 30 s by default); six reads per refresh
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RingSignals:
    def __init__(self, metrics: ServiceMetrics, capacity: int):
        r, name = metrics.registry, metrics.name

        def gauge(metric: str, doc: str):
            return Gauge(metric, doc, ["service"], registry=r).labels(name)

        self.waiting = gauge("rlhf_ring_jobs_waiting", "prompt jobs issued, not yet taken by a replica")
        self.running = gauge("rlhf_ring_jobs_running", "prompt jobs a replica holds, not yet written back")
        self.experience = gauge("rlhf_ring_experience_waiting", "experience records not yet read by the trainer")
        self.admitted = gauge("rlhf_ring_jobs_admitted", "prompt jobs issued and not yet trained on")
        gauge("rlhf_ring_admission_capacity", "jobs admission lets be issued and not yet trained on").set(capacity)
        self.wait = Histogram(
            "rlhf_trainer_experience_wait_seconds",
            "a training step's wait for its batch of experience",
            ["service"],
            buckets=WAIT_BUCKETS,
            registry=r,
        ).labels(name)

    def observe_wait(self, seconds: float) -> None:
        self.wait.observe(seconds)

    def update(self, stats: QueueStats) -> None:
        self.waiting.set(stats.prompts_backlog)
        self.running.set(stats.prompts_pending)
        self.experience.set(stats.experience_backlog)
        self.admitted.set(stats.in_flight)

    async def refresh_loop(self, redis: aioredis.Redis, run_id: str, finished: Callable[[], bool]) -> None:
        """Read the depths every ``REFRESH_S`` until ``finished()``. A failed read keeps the last values (Redis
        down is the readiness probe's to report, not this loop's to end)."""
        while not finished():
            try:
                self.update(await queue_stats(redis, run_id))
            except Exception as err:  # noqa: BLE001 - a gauge refresh must not end the trainer
                log.debug("refreshing the ring's queue depths failed: %s", err)
            await asyncio.sleep(REFRESH_S)
