"""Rollout worker mode: a rollout replica that pulls prompt jobs from Redis and pushes experience back.

Started by :func:`maybe_start_worker` (from ``services.rollout.main``) when ``RLHF_REDIS_URL`` is set, beside the
gRPC/HTTP servers and sharing their engine. This module is the queue side (read, reclaim, publish-and-ack, stop);
one job -> one record is :class:`services.rollout.jobs.JobRunner`, built by :meth:`RolloutWorker.job_runner`.

Design: docs/code-tour.md#1-a-prompt-job-to-its-training-step (a job's path), docs/services.md#rollout (failures,
the ``RLHF_ROLLOUT_*`` settings), docs/weight-sync.md#replicas-that-start-late (waiting for the published version).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlhf.environments.client import EnvironmentClient
from rlhf.retry import retry
from rlhf.serving.errors import InvalidArgument
from rlhf.serving.runner import open_channel
from rlhf.serving.settings import ServiceSettings, register_env_var
from rlhf.transport import ExperienceQueue, PromptQueue, connect, encode, get_policy_version
from rlhf.v1 import (
    experience_pb2,
    reference_pb2_grpc,
    reward_pb2_grpc,
)
from services.rollout.jobs import JobFailed, JobRunner, JobSettings
from services.rollout.options import default_options

if TYPE_CHECKING:  # pragma: no cover
    from rlhf.config import ExperimentConfig
    from rlhf.environments.client import EnvironmentClient
    from rlhf.serving import ServiceMetrics
    from services.rollout.engine_types import RolloutEngine

log = logging.getLogger("rlhf.rollout.worker")

MAX_INFLIGHT_ENV = "RLHF_ROLLOUT_MAX_INFLIGHT_JOBS"
RECLAIM_IDLE_ENV = "RLHF_ROLLOUT_RECLAIM_IDLE_S"
RPC_TIMEOUT_ENV = "RLHF_ROLLOUT_RPC_TIMEOUT_S"
CATCH_UP_WAIT_ENV = "RLHF_ROLLOUT_CATCH_UP_WAIT_S"
for _name in (MAX_INFLIGHT_ENV, RECLAIM_IDLE_ENV, RPC_TIMEOUT_ENV, CATCH_UP_WAIT_ENV):
    register_env_var(_name)


@dataclass
class WorkerStats:
    processed: int = 0  # experience written and job acked
    duplicates: int = 0  # finished, but another replica had already acked the job (nothing written)
    reclaimed: int = 0  # jobs taken over from idle consumers
    dead_lettered: int = 0  # refused by the engine as invalid
    handed_back: int = 0  # unfinished when the drain ended: left for another replica's next reclaim
    failed: dict[str, int] = field(default_factory=dict)  # kind -> count (jobs left pending)
    samples: int = 0
    started_at: float = field(default_factory=time.monotonic)

    def fail(self, kind: str) -> None:
        self.failed[kind] = self.failed.get(kind, 0) + 1


def _env_num(env: Mapping[str, str], name: str, default: float, cast: type = float) -> Any:
    raw = env.get(name, "")
    if raw == "":
        return cast(default)
    try:
        value = cast(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value


class RolloutWorker:
    """Prompt jobs in, experience out, for one replica. ``await worker.run()``; ``worker.stop()`` ends it. The queue
    side is here; each job runs on a :class:`~services.rollout.jobs.JobRunner` that :meth:`run` makes once the
    reward, reference and environment clients are open."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        redis_url: str,
        run_id: str,
        reward_addr: str,
        reference_addr: str,
        replica_id: str | None = None,
        settings: ServiceSettings | None = None,
        metrics: ServiceMetrics | None = None,
        max_inflight_jobs: int = 8,
        reclaim_idle_s: float = 60.0,
        reclaim_interval_s: float | None = None,
        rpc_timeout_s: float = 60.0,
        rpc_retries: int = 3,
        rpc_backoff_s: float = 0.2,
        max_deliveries: int | None = 10,
        block_ms: int = 500,
        drain_s: float = 10.0,
        default_sampling: Mapping[str, Any] | None = None,
        ref_temperature: float | None = None,
        catch_up_wait_s: float = 60.0,
        environment_addr: str | None = None,
        environment_timeout_s: float | None = None,
        episode_attempts: int = 3,
    ):
        if max_inflight_jobs < 1:
            raise ValueError("max_inflight_jobs must be at least 1")
        self.engine = engine
        self.redis_url = redis_url
        self.run_id = run_id
        self.reward_addr = reward_addr
        self.reference_addr = reference_addr
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}"
        self.settings = settings or ServiceSettings()
        self.metrics = metrics
        self.max_inflight_jobs = max_inflight_jobs
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self.reclaim_interval_s = reclaim_interval_s if reclaim_interval_s is not None else max(reclaim_idle_s / 4, 0.1)
        self.max_deliveries = max_deliveries
        self.block_ms = block_ms
        self.drain_s = drain_s
        self.catch_up_wait_s = catch_up_wait_s
        self.environment_addr = environment_addr
        # a call's deadline: past the service's own per-call timeout, whose error names the environment that was slow
        self.environment_timeout_s = environment_timeout_s if environment_timeout_s is not None else rpc_timeout_s
        self.job_settings = JobSettings(
            replica_id=self.replica_id,
            run_id=run_id,
            defaults=dict(default_sampling or {}),
            ref_temperature=ref_temperature,
            rpc_timeout_s=rpc_timeout_s,
            rpc_retries=rpc_retries,
            rpc_backoff_s=rpc_backoff_s,
            episode_attempts=episode_attempts,
        )
        self.stats = WorkerStats()
        self._stop = asyncio.Event()
        self._inflight: dict[str, asyncio.Task] = {}  # prompt entry id -> task
        if metrics is not None:  # per replica; the ring-wide depths are the trainer's (docs/deploy.md#scaling-signals)
            metrics.gauge_of(
                "rlhf_rollout_jobs_in_flight", "prompt jobs this replica holds now", lambda: len(self._inflight)
            )
            metrics.gauge_of(
                "rlhf_rollout_job_slots",
                "prompt jobs this replica holds at most (RLHF_ROLLOUT_MAX_INFLIGHT_JOBS)",
                lambda: self.max_inflight_jobs,
            )
        self.running = False
        self._task: asyncio.Task | None = None

    @classmethod
    def from_settings(
        cls,
        engine: RolloutEngine,
        settings: ServiceSettings,
        cfg: ExperimentConfig | None = None,
        *,
        metrics: ServiceMetrics | None = None,
        env: Mapping[str, str] | None = None,
        **kw: Any,
    ) -> RolloutWorker:
        """Build from ServiceSettings (``RLHF_REDIS_URL`` etc.) and the ``RLHF_ROLLOUT_*`` variables."""
        env = os.environ if env is None else env
        missing = [
            n
            for n, v in (
                ("RLHF_REDIS_URL", settings.redis_url),
                ("RLHF_REWARD_ADDR", settings.reward_addr),
                ("RLHF_REFERENCE_ADDR", settings.reference_addr),
            )
            if not v
        ]
        if missing:
            raise ValueError(f"rollout worker mode needs {', '.join(missing)}")
        run_id = settings.run_id or (cfg.run_id if cfg is not None else None)
        if not run_id:
            raise ValueError("rollout worker mode needs a run id: RLHF_RUN_ID or the config's run_id")
        defaults: dict[str, Any] = {}
        if cfg is not None:
            defaults = default_options(cfg)
        opts: dict[str, Any] = {
            "max_inflight_jobs": _env_num(env, MAX_INFLIGHT_ENV, 8, int),
            "reclaim_idle_s": _env_num(env, RECLAIM_IDLE_ENV, 60.0),
            "rpc_timeout_s": _env_num(env, RPC_TIMEOUT_ENV, 60.0),
            "catch_up_wait_s": _env_num(env, CATCH_UP_WAIT_ENV, 60.0),
            "drain_s": settings.shutdown_grace_s,
            "default_sampling": defaults,
            "ref_temperature": cfg.logprob_temperature if cfg is not None else None,
            "environment_timeout_s": cfg.environment.timeout_s + 5.0 if cfg is not None else None,
        }
        opts.update(kw)
        return cls(
            engine,
            redis_url=settings.redis_url,
            run_id=run_id,
            reward_addr=settings.reward_addr,
            reference_addr=settings.reference_addr,
            environment_addr=settings.environment_addr,
            replica_id=settings.replica_id,
            settings=settings,
            metrics=metrics,
            **opts,
        )

    # ------------------------------------------------------------------------------------------------ life cycle

    def start(self) -> asyncio.Task:
        """Run in the background of the current event loop (the service's hook); stop with :meth:`aclose`."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"rollout-worker-{self.replica_id}")
            self._task.add_done_callback(self._on_exit)
        return self._task

    def _on_exit(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("rollout worker %s crashed", self.replica_id, exc_info=task.exception())

    async def aclose(self) -> None:
        """Stop taking jobs and wait for the jobs in flight (up to ``drain_s``; the rest stay pending)."""
        self.stop()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._task), self.drain_s + 10)
            if not self._task.done():
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task

    def stop(self) -> None:
        """Stop taking jobs; :meth:`run` returns after the jobs in flight finish (or ``drain_s`` passes)."""
        self._stop.set()

    def job_runner(
        self,
        reward: reward_pb2_grpc.RewardServiceStub,
        reference: reference_pb2_grpc.ReferenceServiceStub,
        environment: EnvironmentClient | None = None,
    ) -> JobRunner:
        """The runner of this worker's jobs over these clients (:meth:`run` opens them)."""
        return JobRunner(
            self.engine,
            reward,
            reference,
            environment,
            self.job_settings,
            count_failure=self._count_failure,
            metrics=self.metrics,
        )

    async def run(self) -> None:
        self.running = True
        redis = connect(self.redis_url)
        self._prompts = PromptQueue(redis, self.run_id, max_deliveries=self.max_deliveries)
        self._experience = ExperienceQueue(redis, self.run_id)
        reward_ch = open_channel(self.reward_addr, self.settings)
        ref_ch = open_channel(self.reference_addr, self.settings)
        env = None
        if self.environment_addr:
            env = EnvironmentClient(
                self.environment_addr, self.settings.api_token, self.environment_timeout_s, settings=self.settings
            )
        jobs = self.job_runner(
            reward_pb2_grpc.RewardServiceStub(reward_ch), reference_pb2_grpc.ReferenceServiceStub(ref_ch), env
        )
        log.info(
            "rollout worker %s: run %s, reward %s, reference %s, up to %d jobs at once",
            self.replica_id,
            self.run_id,
            self.reward_addr,
            self.reference_addr,
            self.max_inflight_jobs,
        )
        try:
            while not self.engine.ready and not self._stop.is_set():
                await asyncio.sleep(0.1)
            await self._loop(jobs)
        finally:
            await self._drain()
            await reward_ch.close()
            await ref_ch.close()
            if env is not None:
                await env.aclose()
            await redis.aclose()
            self.running = False
            log.info("rollout worker %s stopped: %s", self.replica_id, self.stats)

    async def _behind(self) -> int | None:
        """The run's published policy version when this replica serves an older one (it started or restarted after
        that push), else None. Such a replica takes no job until the trainer brings it up to date (its samples would
        be as many versions stale as it is behind), or until ``catch_up_wait_s`` passed without a push: then the
        trainer is down or cannot reach it, and it serves the run's newest checkpoint (loaded at start-up), which is
        what a trainer resumes from; a live trainer drops its samples if they are past the staleness bound."""
        now = time.monotonic()
        if now >= self._published_checked + 0.5:
            self._published_checked = now
            self._published = await get_policy_version(self._prompts.redis, self.run_id)
        if self._published is None or self.engine.weights_version >= self._published:
            self._behind_since = None
            return None
        if self._behind_since is None:
            self._behind_since = now
        if now - self._behind_since >= self.catch_up_wait_s:
            if not self._gave_up:
                log.warning(
                    "%s: no weights push within %.0f s (the run is at version %d): taking jobs with version %d",
                    self.replica_id,
                    self.catch_up_wait_s,
                    self._published,
                    self.engine.weights_version,
                )
            self._gave_up = True
            return None
        self._gave_up = False
        return self._published

    async def _loop(self, jobs: JobRunner) -> None:
        next_reclaim = time.monotonic() + self.reclaim_interval_s
        error_backoff = 0.2
        stop_wait = asyncio.create_task(self._stop.wait())
        self._published, self._published_checked, waiting = None, float("-inf"), False
        self._behind_since: float | None = None
        self._gave_up = False
        self._first_logged = False
        try:
            while not self._stop.is_set():
                free = self.max_inflight_jobs - len(self._inflight)
                if free <= 0:
                    await asyncio.wait({stop_wait, *self._inflight.values()}, return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    behind = await self._behind()
                    if behind is not None:
                        if not waiting:
                            log.info(
                                "%s: serving weights version %d, the run is at %d: waiting for the trainer's "
                                "push before taking jobs",
                                self.replica_id,
                                self.engine.weights_version,
                                behind,
                            )
                        waiting = True
                        await asyncio.wait({stop_wait}, timeout=0.2)
                        continue
                    if waiting:
                        log.info("%s: weights version %d: taking jobs", self.replica_id, self.engine.weights_version)
                        waiting = False
                    records = []
                    if time.monotonic() >= next_reclaim:
                        next_reclaim = time.monotonic() + self.reclaim_interval_s
                        records = await self._prompts.reclaim(self.replica_id, self.reclaim_idle_ms, count=free)
                        records = [r for r in records if r[0] not in self._inflight]  # our own slow jobs
                        self.stats.reclaimed += len(records)
                        if records:
                            log.info("%s: reclaimed %d idle job(s)", self.replica_id, len(records))
                    if not records:
                        read = asyncio.create_task(self._prompts.read(self.replica_id, free, self.block_ms))
                        done, _ = await asyncio.wait({read, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                        if read not in done:  # stopping: whatever the read returns stays pending (unacked)
                            read.cancel()
                            with contextlib.suppress(BaseException):
                                await read
                            break
                        records = [r for r in read.result() if r[0] not in self._inflight]
                    error_backoff = 0.2
                except Exception as err:  # noqa: BLE001 - redis down or restarting: retry, jobs stay in Redis
                    self._count_failure("redis")
                    log.warning(
                        "%s: queue error (%s: %s); retrying in %.1fs",
                        self.replica_id,
                        type(err).__name__,
                        err,
                        error_backoff,
                    )
                    await asyncio.sleep(error_backoff)
                    error_backoff = min(error_backoff * 2, 5.0)
                    continue
                if records and not self._first_logged:  # what a late joiner starts with (tests/e2e/test_late_replica)
                    self._first_logged = True
                    log.info(
                        "%s: first job with weights version %d (the run published %s)",
                        self.replica_id,
                        self.engine.weights_version,
                        self._published,
                    )
                for entry_id, job in records:
                    task = asyncio.create_task(self._run_job(jobs, entry_id, job), name=f"rollout-job-{job.job_id}")
                    self._inflight[entry_id] = task
                    task.add_done_callback(lambda _t, e=entry_id: self._inflight.pop(e, None))
        finally:
            stop_wait.cancel()

    async def _drain(self) -> None:
        """Finish the jobs in flight (up to ``drain_s``), then hand back the rest: they stay pending in Redis with
        an idle time past every threshold, so another replica's next reclaim pass takes them (a replica killed here
        hands back nothing: its jobs are reclaimed after the idle timeout instead)."""
        inflight = dict(self._inflight)
        if not inflight:
            return
        t0 = time.monotonic()
        log.info("%s: waiting up to %.1fs for %d job(s) in flight", self.replica_id, self.drain_s, len(inflight))
        _, pending = await asyncio.wait(inflight.values(), timeout=self.drain_s)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            left = [e for e, t in inflight.items() if t in pending]
            if not self._stop.is_set():  # cancelled, not stopped (a crash path): reclaimed after the idle timeout
                log.warning("%s: %d job(s) left unacknowledged for another replica", self.replica_id, len(left))
                return
            try:
                handed = await self._prompts.hand_back(self.replica_id, left)
                self.stats.handed_back += handed
                log.warning("%s: %d job(s) handed back to the other replicas", self.replica_id, handed)
            except Exception as err:  # noqa: BLE001 - left pending: reclaimed after the idle timeout
                log.warning(
                    "%s: %d job(s) left unacknowledged for another replica (%s)", self.replica_id, len(left), err
                )
        log.info(
            "%s: drained in %.2fs: %d job(s) finished, %d not",
            self.replica_id,
            time.monotonic() - t0,
            len(inflight) - len(pending),
            len(pending),
        )

    # ------------------------------------------------------------------------------------------------ one job

    def _count_failure(self, kind: str) -> None:
        self.stats.fail(kind)
        if self.metrics is not None:
            self.metrics.count_error(f"rollout_job_{kind}")

    async def _run_job(self, jobs: JobRunner, entry_id: str, job: experience_pb2.PromptJob) -> None:
        t0 = time.perf_counter()
        code = "OK"
        try:
            exp = await jobs.process(job)
            written = await self._publish(exp, entry_id)
            if written is None:
                code = "DUPLICATE"
                self.stats.duplicates += 1
                log.info("%s: job %s was finished by another replica; nothing written", self.replica_id, job.job_id)
            else:
                self.stats.processed += 1
                self.stats.samples += len(exp.samples)
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except InvalidArgument as err:
            code = "INVALID_ARGUMENT"
            self._count_failure("invalid_argument")
            reason = f"rollout replica {self.replica_id} refused the job: {err}"
            try:  # the queue's own dead-letter step (atomic: dead stream + count + ack)
                self.stats.dead_lettered += await self._prompts.dead_letter(
                    [(entry_id, encode(job), reason, job.job_id)], self.replica_id
                )
                log.warning("%s: job %s dead-lettered: %s", self.replica_id, job.job_id, err)
            except Exception as dl_err:  # noqa: BLE001 - left pending: max_deliveries dead-letters it later
                log.warning("%s: could not dead-letter job %s: %s", self.replica_id, job.job_id, dl_err)
        except JobFailed as err:
            code = err.kind.upper()
            self._count_failure(err.kind)
            log.warning("%s: job %s failed (%s), left pending: %s", self.replica_id, job.job_id, err.kind, err)
        except Exception as err:
            code = "ERROR"
            self._count_failure("error")
            log.exception("%s: job %s failed, left pending: %s", self.replica_id, job.job_id, err)
        finally:
            if self.metrics is not None:
                self.metrics.observe_request("RolloutJob", "redis", time.perf_counter() - t0, code)

    async def _publish(self, exp: experience_pb2.Experience, entry_id: str) -> str | None:
        """:meth:`ExperienceQueue.publish_and_ack`, retried while Redis is unreachable or its replicas lag (a
        restart, a Sentinel failover, ``wait_replicas`` not met yet), for up to the reclaim idle time: the work is
        kept instead of regenerated. A retry is safe: once a try went through, the job is no longer pending and the
        next writes nothing. Past that time the job is left pending, and reclaimed (re-issued) as any failed job."""
        return await retry(
            lambda: self._experience.publish_and_ack(exp, entry_id),
            lambda err: isinstance(err, (RedisConnectionError, RedisTimeoutError)),
            what=f"{self.replica_id}: writing the experience of job {exp.job_id} failed",
            log=log,
            deadline=time.monotonic() + self.reclaim_idle_ms / 1000,
            max_s=2.0,
        )


def maybe_start_worker(
    engine: RolloutEngine,
    settings: ServiceSettings,
    cfg: ExperimentConfig | None = None,
    *,
    metrics: ServiceMetrics | None = None,
    **kw: Any,
) -> RolloutWorker | None:
    """Worker mode when ``RLHF_REDIS_URL`` is set: build the worker from the settings and start it in the
    background; returns None (and starts nothing) otherwise."""
    if not settings.redis_url:
        return None
    worker = RolloutWorker.from_settings(engine, settings, cfg, metrics=metrics, **kw)
    worker.start()
    return worker


__all__ = [
    "MAX_INFLIGHT_ENV",
    "RECLAIM_IDLE_ENV",
    "RPC_TIMEOUT_ENV",
    "CATCH_UP_WAIT_ENV",
    "JobFailed",
    "RolloutWorker",
    "WorkerStats",
    "maybe_start_worker",
]
