"""Prompt jobs out, and the run's admission state in Redis: the ``Publisher``.

It publishes prompt jobs from the data set while admission allows (the jobs issued but not yet trained on stay
within ``(max_staleness + 1) x global_batch_size``: AReaL's rule), and it is the one writer of what admission reads:
the count of jobs consumed (trained, or dropped as stale) and the published policy version. Both are written
absolutely and re-asserted every few seconds, so a retry or a Redis that lost its last second of writes never
miscounts. Also here: :func:`retrying`, the trainer's retry of a Redis call while Redis is away.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlhf.config import ConfigError, ExperimentConfig
from rlhf.data import PromptCursor, load_prompts, record_prompt_ids
from rlhf.environments.base import EPISODE_ENVIRONMENT_KEY, EPISODE_MAX_TOKENS_KEY, EPISODE_MAX_TURNS_KEY
from rlhf.retry import retry
from rlhf.transport import Admission, PromptQueue
from rlhf.v1 import common_pb2, experience_pb2

log = logging.getLogger("rlhf.trainer")
# Redis restarting or unreachable for a while: every call the trainer makes is retried (they are all idempotent:
# job ids dedupe publishing, the trained counter is set absolutely, acks and version publishing can be repeated).
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)


async def retrying(what: str, fn, *args, **kwargs):
    """``await fn(*args, **kwargs)``, retried with backoff while Redis is unreachable, for as long as it takes (a
    restart must not end the run)."""
    return await retry(
        lambda: fn(*args, **kwargs), lambda err: isinstance(err, TRANSIENT), what=f"redis unavailable ({what})", log=log
    )


def episode_metadata(cfg: ExperimentConfig) -> dict[str, str]:
    """What makes a prompt job an episode (the rollout replica plays it against the environment service): the
    environment section's name and limits, as PromptJob metadata; empty for single-turn runs."""
    env = cfg.environment
    if not env.name:
        return {}
    max_tokens = env.max_tokens if env.max_tokens is not None else env.max_turns * cfg.max_new_tokens
    return {
        EPISODE_ENVIRONMENT_KEY: env.name,
        EPISODE_MAX_TURNS_KEY: str(env.max_turns),
        EPISODE_MAX_TOKENS_KEY: str(max_tokens),
    }


class Publisher:
    def __init__(self, cfg: ExperimentConfig, run_id: str, redis, tokenizer, paused: asyncio.Event):
        self.cfg, self.run_id, self.paused = cfg, run_id, paused
        self.prompts = PromptQueue(redis, run_id)
        t = cfg.training
        self.admission = Admission(redis, run_id, t.max_staleness, t.global_batch_size)
        a = cfg.actor
        records = load_prompts(cfg.data)
        self.cursor = PromptCursor(records, t.seed, cfg.data.shuffle)
        self.prompt_ids = {}
        for r in records:  # text through the chat template (with the row's system prompt), or preprocessed ids
            self.prompt_ids[r.index] = record_prompt_ids(tokenizer, r, a.max_prompt_length, a.apply_chat_template)
            if r.max_tokens is not None and r.max_tokens > cfg.max_new_tokens:
                raise ConfigError(
                    f"data.map_keys.max_tokens: row {r.index} of {cfg.data.path} asks for {r.max_tokens} new tokens, "
                    f"more than actor_rollout.max_new_tokens ({cfg.max_new_tokens}), which sizes the training batch"
                )
        # The trained-jobs total is kept here and set absolutely (a retried increment would count twice).
        self.jobs_trained = 0
        self.unpushed_jobs = 0  # jobs trained into weights whose push has not landed yet
        self.trained_published = 0  # the trained count and policy version last written (see reassert_loop)
        self.version_published: int | None = None
        self._lock = asyncio.Lock()

    async def restore(self, trained: int, data: dict[str, Any] | None) -> int | None:
        """Start where a checkpoint left off (``data``: its cursor; None: from the start). The trained counter goes
        back with the weights: to the checkpoint's total ``trained``, or to 0 when a trainer died before its first
        checkpoint (its steps are lost with it; their experience was never acknowledged and comes back). Returns the
        policy version the run last published, if any."""
        if data is not None:
            self.cursor.epoch, self.cursor.offset = data["epoch"], data["offset"]
            self.cursor._order = self.cursor._make_order()
        await self.admission.restore(trained)
        self.trained_published = trained
        return await self.admission.policy_version()

    async def read_trained(self) -> None:
        self.jobs_trained = (await self.admission.state()).trained

    # ------------------------------------------------------------------ prompt jobs
    def _job(self, policy_version: int) -> experience_pb2.PromptJob:
        epoch, record = self.cursor.next()
        d = self.cfg.sampling_defaults()
        params = common_pb2.SamplingParams(
            n=self.cfg.training.stage.traits.samples_per_prompt or self.cfg.actor.n_samples_per_prompt,
            temperature=d["temperature"],
            top_p=d["top_p"],
            top_k=d["top_k"],
            max_tokens=record.max_tokens or d["max_tokens"],
            stop=d["stop"],
        )
        job = experience_pb2.PromptJob(
            job_id=f"{self.run_id}-e{epoch}-i{record.index}",
            run_id=self.run_id,
            data_index=record.index,
            epoch=epoch,
            prompt_ids=self.prompt_ids[record.index],
            prompt_text=record.prompt,
            params=params,
            issued_policy_version=policy_version,
            issued_at_unix_ms=int(time.time() * 1000),
        )
        if record.label is not None:
            job.label = record.label
        job.metadata.update(episode_metadata(self.cfg))
        return job

    async def publish_loop(self, done: Callable[[], bool], policy_version: Callable[[], int]) -> None:
        """Publish jobs as admission frees slots, until ``done()``; each job names ``policy_version()``, the
        version of the weights the trainer holds when it is issued."""
        backlog: list[experience_pb2.PromptJob] = []
        while not done():
            if self.paused.is_set():
                await asyncio.sleep(0.1)
                continue
            free = await retrying("admission", self.admission.wait_free, 1)
            while len(backlog) < free:
                backlog.append(self._job(policy_version()))
            results = await retrying(
                "publishing prompt jobs", self.prompts.publish_many, backlog[:free], self.admission
            )
            # "duplicate" is a job issued before a restart: it is in the streams already, so it is done here too.
            backlog = [job for job, r in zip(backlog[:free], results, strict=True) if r.status == "full"] + backlog[
                free:
            ]
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ the admission counter
    def consumed(self, jobs: int, pushed_later: bool = False) -> None:
        """``jobs`` trained on or dropped. ``pushed_later``: trained into weights not out yet, so admitted only once
        :meth:`pushed` says they are (counted together, with no await in between)."""
        self.jobs_trained += jobs
        if pushed_later:
            self.unpushed_jobs += jobs

    @property
    def behind(self) -> bool:
        """Consumed jobs not yet written to admission (slots that stale drops freed while no step came)."""
        return self.trained_published < self.jobs_trained - self.unpushed_jobs

    async def write_admission(self) -> None:
        """Write the jobs consumed (trained or dropped as stale), less those trained into weights not out yet. Both
        terms change together, so the value only grows."""
        async with self._lock:  # never overtaken by an older value re-asserted
            total = self.jobs_trained - self.unpushed_jobs
            await retrying("admission", self.admission.set_trained, total)
            self.trained_published = total

    async def pushed(self, version: int | None, jobs: int) -> None:
        """The weights of ``version`` are out (None: no replica to push to), carrying the training of ``jobs``:
        publish the version, then admit those jobs. Admission frees the next jobs only once the new weights are out,
        which is what bounds staleness."""
        if version is not None:
            await retrying("publishing the policy version", self.admission.publish_policy_version, version)
            self.version_published = version
        if jobs:
            self.unpushed_jobs -= jobs
            await self.write_admission()

    async def reassert_loop(self, done: Callable[[], bool], interval_s: float = 2.0) -> None:
        """Write the admission counter and the policy version again every few seconds. Redis acknowledges a write
        before its AOF is on disk (everysec), so a machine crash can take back the last second: a trained count
        rolled back would keep a synchronous ring waiting forever (no slot free, so no job, so no step to write it
        again). Both writes are absolute and monotonic where it matters, so repeating them is harmless."""
        while not done():
            await asyncio.sleep(interval_s)
            try:
                async with self._lock:
                    await self.admission.set_trained(self.trained_published)
                version = self.version_published
                if version is not None:
                    await self.admission.publish_policy_version(version)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - Redis restarting: the next round writes them
                log.debug("re-asserting the admission state failed: %s", err)
