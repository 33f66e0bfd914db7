"""The trainer's ring driver: the ``Trainer`` object that owns the run's state.

It publishes prompt jobs (bounded by admission: ``training.max_staleness``), consumes experience, runs one update per
``global_batch_size`` experience records, pushes the new weights to every rollout replica (versioned), writes
``metrics.jsonl`` and checkpoints, and acknowledges experience only once a checkpoint covers the step it fed: a
trainer killed at any moment loses nothing, and after a restart it skips the job ids its checkpoint says were trained.
It stops (exit 0) after ``training.train_iters`` steps. The servers around it are in ``grpc_servicer``, ``http_app``
and ``main``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
from pathlib import Path

import grpc
import torch
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rlhf import runlog
from rlhf.config import ExperimentConfig
from rlhf.data import PromptCursor, encode_prompt, load_prompts
from rlhf.serving import (
    NotReady,
    ServiceRunner,
    ServiceSettings,
    open_channel,
)
from rlhf.serving.runner import client_credentials
from rlhf.tracking import Tracker
from rlhf.transport import (
    Admission,
    BufferPool,
    ExperienceQueue,
    MalformedRecord,
    PromptQueue,
    connect,
    drop_trained,
    queue_stats,
)
from rlhf.v1 import common_pb2, experience_pb2, trainer_pb2
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.engine import NoUsableSamples, TrainerEngine, score_failures

log = logging.getLogger("rlhf.trainer")
LEDGER = "trained_jobs.jsonl"  # in the run folder: per checkpoint, the job ids trained since the one before
KEEP_WINDOWS = 2  # checkpoint windows of trained job ids kept for the duplicate filter (see Trainer._checkpoint)
CONSUMER = "trainer-0"
EVENTS = "events.jsonl"  # in the run folder: the ring's changes of state (waiting for a replica, resumed, stopped)
# Redis restarting or unreachable for a while: every call the trainer makes is retried (they are all idempotent:
# job ids dedupe publishing, the trained counter is set absolutely, acks and version publishing can be repeated).
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)


class Trainer:
    def __init__(self, cfg: ExperimentConfig, settings: ServiceSettings, runner: ServiceRunner):
        self.cfg, self.settings, self.runner = cfg, settings, runner
        self.run_id = settings.run_id or cfg.run_id
        self.run_dir = Path(settings.run_dir or Path(cfg.training.save).parent)
        self.ckpt_dir = self.run_dir / "checkpoints" if settings.run_dir else Path(cfg.training.save)
        self.engine: TrainerEngine | None = None
        self.paused = asyncio.Event()
        self.last_metrics: dict[str, float] = {}
        self.trained_job_ids: set[str] = set()  # the duplicate filter: the jobs of the last few checkpoint windows
        self._window: set[str] = set()  # trained (or dropped as stale) since the last checkpoint
        self._window_stale: set[str] = set()  # of those, dropped as stale
        self.stale_dropped = 0
        self._windows: collections.deque[tuple[int, set[str]]] = collections.deque()  # (checkpoint step, job ids)
        self.samples_trained = 0
        self.unacked: list[str] = []
        self.done = False
        self._push_task: asyncio.Task | None = None
        # Bucket buffers of the per-step pushes, reused once a push no longer holds them: fresh memory costs a page
        # fault per 4 KiB (an 86 MB policy: 0.04 s to copy into new memory, 0.009 s into a reused buffer).
        self._push_buffers = BufferPool()
        # One writer of the trainer's state at a time: a step and a checkpoint (the loop's or an admin call's) never
        # interleave, so a checkpoint holds one step's weights with that step's ledger.
        self._state_lock = asyncio.Lock()
        self.dead_lettered = 0
        self._held: list[tuple[str, experience_pb2.Experience]] = []  # read, not yet trained (see _next_batch)
        self._trained_published = 0  # the trained count and policy version last written (see _reassert_loop)
        self._unpushed_jobs = 0  # jobs trained into weights whose push has not landed yet
        self._version_published: int | None = None
        self._admission_lock = asyncio.Lock()
        self._collective: dict = {}  # the collective push's backend and device (start)
        # Replicas whose last push failed: address -> (version, the error). While none serves the newest version the
        # ring waits (see _next_batch) instead of cycling jobs that the old weights would make too stale to train.
        self._lagging: dict[str, tuple[int, str]] = {}
        self._replicas: set[str] = set()  # every replica of the last push to all
        self._announced: set[tuple[str, int]] = set()  # (replica, version) catch-up pushes already logged
        self._waiting: str | None = None

    # ------------------------------------------------------------------ start-up
    async def start(self) -> None:
        self.engine = await asyncio.to_thread(TrainerEngine, self.cfg, self.settings.device)
        if self.settings.weights_transport == "collective":  # a backend this trainer cannot run: refused at start
            from rlhf.transport.weights.collective import trainer_backend

            backend, device = trainer_backend(self.settings.weights_collective_backend, self.engine.device)
            self._collective = {"backend": backend, "device": device}
        self.redis = connect(self.settings.redis_url)
        self.prompts = PromptQueue(self.redis, self.run_id)
        self.experience = ExperienceQueue(self.redis, self.run_id)
        self.admission = Admission(
            self.redis, self.run_id, self.cfg.training.max_staleness, self.cfg.training.global_batch_size
        )
        a = self.cfg.actor
        records = load_prompts(self.cfg.data)
        self.cursor = PromptCursor(records, self.cfg.training.seed, self.cfg.data.shuffle)
        self.prompt_ids = {}
        tok = self.engine.tokenizer
        for r in records:
            self.prompt_ids[r.index] = encode_prompt(
                tok, r.prompt, a.max_prompt_length, a.apply_chat_template, self.cfg.data.system
            )
        self.records = {r.index: r for r in records}
        ckpt = self.cfg.training.load or latest_checkpoint(self.ckpt_dir)
        trained = 0
        if ckpt:
            state = await asyncio.to_thread(load_checkpoint, ckpt, self.engine)
            windows = state.get("trained_job_windows") or [[state["step"], state.get("trained_job_ids", [])]]
            self._windows = collections.deque((int(st), set(ids)) for st, ids in windows)
            self.trained_job_ids = set().union(*(ids for _, ids in self._windows))
            self.samples_trained = state.get("samples_trained", 0)
            self.cursor.epoch, self.cursor.offset = state["data"]["epoch"], state["data"]["offset"]
            self.cursor._order = self.cursor._make_order()
            trained = state["admission_trained"]
        # The trained counter goes back with the weights: to the checkpoint's total, or to 0 when a trainer died
        # before its first checkpoint (its steps are lost with it; their experience was never acknowledged and comes
        # back). Versions never go backwards: weights that differ from what the replicas serve are published under
        # a new, higher version.
        await self.admission.restore(trained)
        self._trained_published = trained
        published = await self.admission.policy_version()
        if ckpt or published is not None:
            self.engine.policy_version = max(self.engine.policy_version, published or 0) + 1
            self.engine.version_segments.append((self.engine.policy_version, self.engine.step_count))
            await self._push_weights()
        if ckpt:
            log.info(
                "resumed from %s at step %d, publishing as version %d",
                ckpt,
                self.engine.step_count,
                self.engine.policy_version,
            )
        elif published is not None:
            log.info(
                "no checkpoint in %s, but the run published version %d: starting over from the initial weights as "
                "version %d",
                self.ckpt_dir,
                published,
                self.engine.policy_version,
            )
        # The trained-jobs total is kept here and set absolutely (a retried increment would count twice).
        self.jobs_trained = (await self.admission.state()).trained
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Steps after the checkpoint are trained again: each step stays in metrics.jsonl once.
        runlog.truncate_after(self.run_dir / LEDGER, self.engine.step_count)
        cut = runlog.truncate_after(self.run_dir / "metrics.jsonl", self.engine.step_count)
        if cut:
            log.info("metrics.jsonl cut back to step %d (%d later line(s) removed)", self.engine.step_count, cut)
        self.tracker = Tracker(self.run_dir, self.run_id, self.cfg.model_dump(), resume_step=self.engine.step_count)
        self._saved_step = self.engine.step_count if ckpt else None
        self.tasks = [
            asyncio.create_task(self._publish_loop()),
            asyncio.create_task(self._train_loop()),
            asyncio.create_task(self._catch_up_loop()),
            asyncio.create_task(self._reassert_loop()),
        ]
        if self.engine.group is not None:
            self.tasks.append(asyncio.create_task(self._heartbeat_loop()))

    async def _redis(self, what: str, fn, *args, **kwargs):
        """``await fn(*args, **kwargs)``, retried with backoff while Redis is unreachable (a restart must not end
        the run)."""
        delay = 0.2
        while True:
            try:
                return await fn(*args, **kwargs)
            except TRANSIENT as err:
                log.warning("redis unavailable (%s: %s: %s); retrying in %.1fs", what, type(err).__name__, err, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def stop(self) -> None:
        """SIGTERM (Ctrl-C under ``rlhf up``, a pod or container stop): finish the step in progress, checkpoint
        what was trained since the last checkpoint, then stop. Killed before it is done, the previous checkpoint
        stands (checkpoints are atomic)."""
        tasks = [*getattr(self, "tasks", []), self._push_task]
        unsaved = self.engine is not None and hasattr(self, "tasks") and not self.done
        if unsaved and self.engine.step_count not in (0, getattr(self, "_saved_step", None)):
            async with self._state_lock:  # waits for a step in progress; none starts after it
                for t in tasks:
                    if t is not None:
                        t.cancel()
                log.info("stopping: checkpointing step %d", self.engine.step_count)
                try:
                    await self._checkpoint()
                except Exception:  # noqa: BLE001 - the previous checkpoint stands
                    log.exception("checkpoint on stop failed")
        for t in tasks:
            if t is not None:
                t.cancel()
        if self.engine is not None and self.engine.group is not None:
            try:  # after the checkpoint, which the other ranks took part in
                await asyncio.to_thread(self.engine.stop_followers)
            except Exception:  # noqa: BLE001 - a dead rank: torchrun ends the group anyway
                log.exception("could not stop the other trainer ranks")
        if getattr(self, "tracker", None) is not None:
            self.tracker.close()
        if getattr(self, "redis", None) is not None:
            await self.redis.aclose()

    async def _heartbeat_loop(self) -> None:
        """A multi-process trainer's other ranks wait in a collective for rank 0's next command; while the ring
        waits for experience, a no-op now and then keeps them under the collective timeout."""
        interval = self.cfg.training.collective_timeout_s / 4
        while True:
            await asyncio.sleep(interval)
            await asyncio.to_thread(self.engine.heartbeat)

    # ------------------------------------------------------------------ publishing prompt jobs
    def _job(self) -> experience_pb2.PromptJob:
        epoch, record = self.cursor.next()
        a = self.cfg.actor
        params = common_pb2.SamplingParams(
            n=a.n_samples_per_prompt if self.cfg.training.stage != "ray_online_dpo" else 2,
            temperature=a.temperature if a.do_sample else 0.0,
            top_p=a.top_p,
            top_k=a.top_k,
            max_tokens=self.cfg.max_new_tokens,
            stop=a.stop,
        )
        job = experience_pb2.PromptJob(
            job_id=f"{self.run_id}-e{epoch}-i{record.index}",
            run_id=self.run_id,
            data_index=record.index,
            epoch=epoch,
            prompt_ids=self.prompt_ids[record.index],
            prompt_text=record.prompt,
            params=params,
            issued_policy_version=self.engine.policy_version,
            issued_at_unix_ms=int(time.time() * 1000),
        )
        if record.label is not None:
            job.label = record.label
        return job

    async def _publish_loop(self) -> None:
        backlog: list[experience_pb2.PromptJob] = []
        while not self.done:
            if self.paused.is_set():
                await asyncio.sleep(0.1)
                continue
            free = await self._redis("admission", self.admission.wait_free, 1)
            while len(backlog) < free:
                backlog.append(self._job())
            results = await self._redis(
                "publishing prompt jobs", self.prompts.publish_many, backlog[:free], self.admission
            )
            # "duplicate" is a job issued before a restart: it is in the streams already, so it is done here too.
            backlog = [job for job, r in zip(backlog[:free], results, strict=True) if r.status == "full"] + backlog[
                free:
            ]
            await asyncio.sleep(0.01)

    # ------------------------------------------------------------------ training
    async def _next_batch(self) -> list[tuple[str, experience_pb2.Experience]]:
        """The next ``global_batch_size`` records, stalest first. Replicas finish jobs in any order, so the trainer
        reads everything that has arrived (admission keeps at most ``max_staleness + 1`` batches in flight) and
        trains the records of the oldest weights first; the fresher ones wait for the next step."""
        t = self.cfg.training
        size = t.global_batch_size
        # Never read more than the steps left will train: a record read and left untrained stays pending at exit.
        ahead = size * min(t.max_staleness + 1, t.train_iters - self.engine.step_count)
        while True:
            if len(self._held) < ahead:
                block = 500 if len(self._held) < size else None  # a full batch in hand: take only what is there
                want = ahead - len(self._held)
                records = await self._redis("reading experience", self.experience.read, CONSUMER, want, block)
                split = drop_trained(records, self.trained_job_ids | {e.job_id for _, e in self._held})
                self.unacked.extend(split.duplicate_ids)
                for entry_id, exp in split.fresh:
                    try:
                        self.engine.check_record(exp)
                    except MalformedRecord as err:
                        await self._dead_letter(entry_id, exp, err.reason)
                    else:
                        self._held.append((entry_id, exp))
            while self.paused.is_set():
                await asyncio.sleep(0.1)
            self._drop_stale()
            if self._waiting is not None:  # the catch-up loop pushes again meanwhile; no new job is admitted
                await asyncio.sleep(0.5)
            elif self._trained_published < self.jobs_trained - self._unpushed_jobs:
                # slots freed by stale drops: no step may come to free them (a sync ring would wait). While no replica
                # serves the newest weights they stay closed: new jobs would only come back stale, in a loop.
                await self._write_admission()
            if len(self._held) >= size:
                break
        self._held.sort(key=lambda r: min((s.policy_version for s in r[1].samples), default=0))
        batch, self._held = self._held[:size], self._held[size:]
        return batch

    def _drop_stale(self) -> int:
        """Consume, without training, the held records whose samples are more than ``training.max_staleness`` steps
        older than the weights the next step updates. Admission bounds the jobs in flight, but replicas finish
        them in any order (and a fault can hold one back), so a record can still arrive too late: the bound is kept
        here. A dropped job counts as consumed for admission and is listed as such in the ledger."""
        if not self._held:
            return 0
        versions = [min((s.policy_version for s in e.samples), default=0) for _, e in self._held]
        behind = self.engine.steps_behind(torch.tensor(versions), self.engine.step_count).tolist()
        bound = self.cfg.training.max_staleness
        stale = [r for r, b in zip(self._held, behind, strict=True) if b > bound]
        if not stale:
            return 0
        self._held = [r for r, b in zip(self._held, behind, strict=True) if b <= bound]
        ids = [e.job_id for _, e in stale]
        self.trained_job_ids.update(ids)  # consumed: a duplicate record of one is dropped too
        self._window.update(ids)
        self._window_stale.update(ids)
        self.unacked.extend(entry for entry, _ in stale)
        self.jobs_trained += len(stale)
        self.stale_dropped += len(stale)
        say = log.debug if self._waiting else log.info  # while waiting, the waiting line says why; once
        say("dropped %d record(s) staler than max_staleness %d before step %d (%s steps behind)", len(stale),
                 bound, self.engine.step_count + 1, max(behind))  # fmt: skip
        return len(stale)

    def _trained(self, job_ids: list[str]) -> None:
        self.trained_job_ids.update(job_ids)
        self._window.update(job_ids)

    def _check_scoring(self, experiences: list[experience_pb2.Experience], failed_fraction: float) -> None:
        """Stop the run (exit ``runlog.EXIT_STOPPED_BY_RULE``, which supervisors should not restart) when more than
        ``reward.max_failed_fraction`` of the samples failed scoring for ``reward.failed_patience`` steps in a row:
        training on the few that scored would be training on a different reward, silently."""
        r = self.cfg.reward
        if failed_fraction <= r.max_failed_fraction:
            self._failed_steps = 0
            return
        self._failed_steps = getattr(self, "_failed_steps", 0) + 1
        detail = score_failures(experiences)
        log.warning("%.0f%% of this step's samples failed scoring (%d/%d steps in a row): %s", 100 * failed_fraction,
                    self._failed_steps, r.failed_patience, detail)  # fmt: skip
        if self._failed_steps >= r.failed_patience:
            self._stop_ring(f"more than {100 * r.max_failed_fraction:.0f}% of the samples failed scoring for "
                            f"{r.failed_patience} steps in a row (reward.max_failed_fraction, reward.failed_patience): "
                            f"{detail}")  # fmt: skip

    def _check_mismatch(self, metrics: dict[str, float]) -> None:
        """Stop the run (exit ``runlog.EXIT_STOPPED_BY_RULE``) when ``mismatch/kl`` is over
        ``training.max_mismatch_kl`` for ``training.mismatch_patience`` steps in a row. Samples made by the weights
        their version names agree with the trainer's log-probs up to numerics; far more means they came from other
        weights (a replica that acknowledged a push but still serves older weights) and are trained on as on-policy
        when they are not. Called after the step's metrics are written, so they show what stopped it. With top-p or
        top-k the sampling log-probs are of the truncated distribution and differ by design: then it only warns."""
        t, a = self.cfg.training, self.cfg.actor
        kl = metrics.get("mismatch/kl")
        if t.max_mismatch_kl is None or kl is None:
            return  # no on-policy token this step: no evidence either way
        if kl <= t.max_mismatch_kl:
            self._mismatch_steps = 0
            return
        self._mismatch_steps = getattr(self, "_mismatch_steps", 0) + 1
        truncated = a.do_sample and (a.top_p < 1.0 or a.top_k > 0)
        by_replica = "; ".join(
            f"replica {r}: {m:.3g} over {n} tokens of version(s) {', '.join(map(str, vs))}"
            for r, (m, n, vs) in sorted(self.engine.mismatch_by_replica.items(), key=lambda kv: -kv[1][0])
        )
        detail = (
            f"mismatch/kl {kl:.3g} (max |log-prob difference| {metrics.get('mismatch/max_abs', float('nan')):.3g}, "
            f"{int(metrics.get('mismatch/tokens', 0))} tokens) between the rollout's sampling log-probs and the "
            f"trainer's at policy version {int(metrics['policy_version']) - 1}, over training.max_mismatch_kl "
            f"{t.max_mismatch_kl:g}" + (f" ({by_replica})" if by_replica else "")
        )
        if truncated:
            log.warning("%s; expected with top_p %g / top_k %d (the sampling log-probs are of the truncated "
                        "distribution), so the run goes on", detail, a.top_p, a.top_k)  # fmt: skip
            return
        meaning = ("these samples were not drawn from the weights their version names: most likely a rollout replica "
                   "acknowledged a weight push but serves other weights (a load that failed silently; restart it), "
                   "or the engine computes another distribution than the trainer (dtype, kernels, sampling "
                   "parameters)")  # fmt: skip
        log.warning("%s (%d/%d steps in a row)", detail, self._mismatch_steps, t.mismatch_patience)
        if self._mismatch_steps >= t.mismatch_patience:
            self._stop_ring(f"trainer-inference mismatch over training.max_mismatch_kl for {self._mismatch_steps} "
                            f"steps in a row (training.mismatch_patience): {detail}; {meaning}")  # fmt: skip

    async def _dead_letter(self, entry_id: str, exp: experience_pb2.Experience, reason: str) -> None:
        """Move an experience record the trainer cannot use to the dead letters (acknowledged there; its job's
        admission slot is released if this run issued it), so no restart meets it again."""
        reason = f"trainer: {reason}"
        payload = exp.SerializeToString()
        moved = await self._redis(
            "dead-lettering", self.experience.dead_letter, [(entry_id, payload, reason, exp.job_id)], CONSUMER
        )
        self.dead_lettered += moved
        log.warning("experience %s (job %s) dead-lettered: %s", entry_id, exp.job_id, reason)

    async def _step(self, batch: list[tuple[str, experience_pb2.Experience]]):
        """One update on ``batch``, or on what is left of it after dead-lettering the records that make it fail.
        Returns (metrics, the batch it trained on); metrics is None when no record was left."""
        while batch:
            try:
                return await asyncio.to_thread(self.engine.step, [e for _, e in batch]), batch
            except NoUsableSamples:
                raise  # every score failed: the scorers' fault, not the records'
            except Exception as err:
                culprits = []
                for entry_id, exp in batch:  # which record makes it fail on its own
                    try:
                        await asyncio.to_thread(self.engine.probe, [exp])
                    except NoUsableSamples:
                        pass
                    except Exception as own:
                        culprits.append((entry_id, exp, f"{type(own).__name__}: {own}"))
                if not culprits:
                    raise
                log.warning("step %d failed (%s: %s); retrying without %d record(s)",
                            self.engine.step_count + 1, type(err).__name__, err, len(culprits))  # fmt: skip
                for entry_id, exp, reason in culprits:
                    await self._dead_letter(entry_id, exp, f"the update step failed on this record: {reason}")
                bad = {entry_id for entry_id, _, _ in culprits}
                batch = [(entry_id, exp) for entry_id, exp in batch if entry_id not in bad]
        return None, batch

    async def _train_loop(self) -> None:
        t = self.cfg.training
        try:
            while self.engine.step_count < t.train_iters:
                t0 = time.perf_counter()
                batch = await self._next_batch()
                wait_s = time.perf_counter() - t0
                async with self._state_lock:
                    await self._train_step(batch, t0, wait_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("training failed")
            os._exit(1)  # a broken trainer must not look healthy; experience stays unacked for the next start
        self.done = True
        log.info("training finished after %d steps", self.engine.step_count)
        self.runner.request_stop()

    async def _train_step(self, batch, t0: float, wait_s: float) -> None:
        """Train on ``batch`` (less any record that makes the step fail), push, checkpoint, write the metrics."""
        t = self.cfg.training
        try:
            metrics, batch = await self._step(batch)
        except NoUsableSamples:
            metrics = None  # no sample scored: no update, and the records are consumed (a retry scores nothing)
            self._check_scoring([e for _, e in batch], 1.0)
            self._trained([e.job_id for _, e in batch])
            self.unacked.extend(entry for entry, _ in batch)
            self.jobs_trained += len(batch)
            await self._write_admission()
            return
        if metrics is None:
            return  # every record was dead-lettered: read another batch
        self._check_scoring([e for _, e in batch], metrics["reward/failed_fraction"])
        self._trained([e.job_id for _, e in batch])
        self.unacked.extend(entry for entry, _ in batch)
        self.samples_trained += int(metrics["samples"])
        push = self.engine.step_count % t.weight_sync_interval == 0
        # Counted at once (and together: no await in between), admitted only once the weights they trained are out.
        self.jobs_trained += len(batch)
        if push:
            self._unpushed_jobs += len(batch)
        # The previous update must be out first: versions reach replicas in order, and the trained count that frees
        # admission only grows.
        await self._settle_push()
        if push and self.engine.group is None:
            # The weights copied into the push's buckets now (the next step changes them; the NaN check and one copy
            # into buffers reused from an earlier push); hashing them and the push (transfer + the replicas' swap)
            # then overlap the next step instead of stalling it.
            version = self.engine.policy_version
            packed = await asyncio.to_thread(self._copy_policy, version)
            self._push_task = asyncio.create_task(self._seal_and_deliver(packed, jobs=len(batch)))
        elif push:
            # A trainer group streams the push (never the whole policy on rank 0): the weights must stay as they are
            # until it is done, so the next step waits for it (this holds _state_lock).
            await self._deliver(None, jobs=len(batch))
        else:
            await self._write_admission()
        if self.engine.step_count >= t.train_iters:
            await self._settle_push()
        if self.engine.step_count % t.save_interval == 0 or self.engine.step_count >= t.train_iters:
            await self._checkpoint()
        elapsed = time.perf_counter() - t0
        stats = await self._redis("queue stats", queue_stats, self.redis, self.run_id)
        metrics.update(
            {
                "time/wait_experience_s": wait_s,
                "time/iteration_s": elapsed,
                "samples_per_s": metrics["samples"] / elapsed,
                "queue/prompts_backlog": float(stats.prompts_backlog),
                "queue/experience_backlog": float(stats.experience_backlog),
                "queue/dead_lettered_by_trainer": float(self.dead_lettered),
                "nonfinite/skipped_updates_total": float(self.engine.skipped_updates),
                "staleness/dropped_records_total": float(self.stale_dropped),
            }
        )
        self.last_metrics = metrics
        runlog.append(self.run_dir / "metrics.jsonl", metrics)
        step = self.engine.step_count
        self.tracker.log(metrics, step)
        if t.log_completions_interval and step % t.log_completions_interval == 0:
            self.tracker.completions(_completion_rows([e for _, e in batch]), step)
        if self.engine.step_count % t.log_interval == 0:
            log.info(
                "step %d reward %.4f kl %.4f samples/s %.1f",
                self.engine.step_count,
                metrics["reward/mean"],
                metrics.get("objective/kl", float("nan")),
                metrics["samples_per_s"],
            )
        self._check_mismatch(metrics)

    async def _pack(self):
        """The live policy packed at its version."""
        from rlhf.transport import pack_weights

        version = self.engine.policy_version
        return await asyncio.to_thread(pack_weights, self.engine.policy_state_dict(), version, version - 1)

    def _copy_policy(self, version: int):
        """The live policy copied into push buckets as ``version`` (not yet hashed: :meth:`_seal_and_deliver`)."""
        from rlhf.transport import copy_weights

        weights = self.engine.policy_state_dict(on_device=True)  # one device-to-bucket copy per tensor
        return copy_weights(weights, version, version - 1, pool=self._push_buffers)

    async def _seal_and_deliver(self, packed, jobs: int) -> None:
        await self._deliver(await asyncio.to_thread(packed.seal), jobs=jobs)

    async def _deliver(self, packed, jobs: int = 0) -> None:
        """Push ``packed`` to every replica, publish its version, then admit the ``jobs`` whose training it carries:
        admission frees the next jobs only once the new weights are out, which is what bounds staleness. ``packed``
        None: a trainer group streams the current weights (see :meth:`_push_to`; hold ``_state_lock``)."""
        addrs = await asyncio.to_thread(expand_targets, self.settings.rollout_addrs)
        if addrs:
            self._replicas = set(addrs)
            version = await self._push_to(addrs, packed)
            await self._redis("publishing the policy version", self.admission.publish_policy_version, version)
            self._version_published = version
        if jobs:
            self._unpushed_jobs -= jobs
            await self._write_admission()

    async def _write_admission(self) -> None:
        """Write the jobs consumed (trained or dropped as stale), less those trained into weights not out yet. Both
        terms change together, so the value only grows."""
        async with self._admission_lock:  # never overtaken by an older value re-asserted
            total = self.jobs_trained - self._unpushed_jobs
            await self._redis("admission", self.admission.set_trained, total)
            self._trained_published = total

    async def _reassert_loop(self, interval_s: float = 2.0) -> None:
        """Write the admission counter and the policy version again every few seconds. Redis acknowledges a write
        before its AOF is on disk (everysec), so a machine crash can take back the last second: a trained count
        rolled back would keep a synchronous ring waiting forever (no slot free, so no job, so no step to write it
        again). Both writes are absolute and monotonic where it matters, so repeating them is harmless."""
        while not self.done:
            await asyncio.sleep(interval_s)
            try:
                async with self._admission_lock:
                    await self.admission.set_trained(self._trained_published)
                version = self._version_published
                if version is not None:
                    await self.admission.publish_policy_version(version)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - Redis restarting: the next round writes them
                log.debug("re-asserting the admission state failed: %s", err)

    async def _catch_up_loop(self, interval_s: float = 2.0) -> None:
        """Bring replicas that serve an older version than the run's published one up to date: a replica that
        started or restarted after a push (a crash, a scale-up) waits for this before it takes a job (see the
        rollout worker), so it never generates samples from weights many versions old."""
        from rlhf.v1 import rollout_pb2_grpc, weights_pb2

        while not self.done:
            await asyncio.sleep(interval_s)
            try:
                published = await self.admission.policy_version()
                addrs = await asyncio.to_thread(expand_targets, self.settings.rollout_addrs)
                if published is None or not addrs or (self._push_task is not None and not self._push_task.done()):
                    continue
                lagging = []
                names = await asyncio.to_thread(_tls_names, self.settings.rollout_addrs)
                for addr in addrs:
                    channel = open_channel(addr, self.settings, server_name=names.get(addr))
                    try:
                        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
                        served = await stub.GetWeightsVersion(weights_pb2.GetWeightsVersionRequest(), timeout=5)
                    except grpc.aio.AioRpcError:
                        continue  # down or starting: asked again next time
                    finally:
                        await channel.close()
                    if served.version < published:
                        lagging.append((addr, served.version))
                    elif addr in self._lagging:  # it loaded the newest weights itself (a restart from a checkpoint)
                        self._note_push(served.version, {addr: served})
                if not lagging:
                    continue
                targets = [a for a, _ in lagging]
                async with self._state_lock:  # between steps: the weights of one version
                    for addr, served in lagging:  # once per replica and version; the retries are quiet
                        key = (addr, published)
                        say = log.debug if key in self._announced else log.info
                        self._announced.add(key)
                        say("replica %s serves version %d, the run is at %d: pushing version %d", addr, served,
                            published, self.engine.policy_version)  # fmt: skip
                    if self.engine.group is not None:  # streamed: the weights may not change until it is done
                        await self._push_to(targets, None)
                        continue
                    packed = await self._pack()
                await self._push_to(targets, packed)
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - Redis restarting, a replica going away: try again later
                log.warning("catching up lagging replicas failed (%s: %s); retrying", type(err).__name__, err)

    async def _push_to(self, addrs: list[str], packed) -> int:
        """Push ``packed`` to ``addrs``, or with ``packed`` None (a trainer group; hold ``_state_lock``) stream the
        engine's current weights: gathered bucket by bucket, twice (the digests, then the bytes), so rank 0 holds
        one bucket, never the whole policy, and training waits for the push. Returns the version pushed."""
        from rlhf.transport import push_weights_many, push_weights_streamed

        tls: dict = {}
        creds = client_credentials(self.settings)
        if creds is not None:  # TLS ring: verify each replica against its service's name, not its pod address
            names = await asyncio.to_thread(_tls_names, self.settings.rollout_addrs)
            tls = {"tls": creds, "server_names": names}
        kw = {"token": self.settings.api_token, "timeout": 120.0, "transport": self.settings.weights_transport,
              **tls, **self._collective}  # fmt: skip
        if packed is None:
            packed = self.engine.policy_stream(self.engine.policy_version)
            results = await push_weights_streamed(addrs, packed, **kw)
        else:
            results = await push_weights_many(addrs, packed, **kw)
        self._note_push(packed.version, results)
        return packed.version

    def _note_push(self, version: int, results: dict) -> None:
        """Record which replicas took ``version``. A refusal no retry can fix stops the run at once; a replica that
        failed otherwise is retried by the catch-up loop, and while no replica serves the newest version the ring
        says it is waiting (one log line and one event per change of state, not one per record)."""
        from rlhf.transport.weights.errors import is_final_refusal

        final = {a: r for a, r in results.items() if isinstance(r, BaseException) and is_final_refusal(r)}
        if final:
            addr, err = next(iter(final.items()))
            self._stop_ring(
                f"replica {addr} refused version {version} of the weights, and no retry can change that: "
                f"{_error_text(err)}. The trainer pushes the policy in its checkpoint layout "
                f"(actor_rollout.load: {self.cfg.actor.load}); the replica expects the tensors of the model it "
                "serves: give rollout the same model as the trainer, and an architecture `rlhf up` accepts"
            )
        for addr, res in results.items():
            if isinstance(res, BaseException):
                before = self._lagging.get(addr)
                self._lagging[addr] = (version, _error_text(res))
                if before is None or before[1] != self._lagging[addr][1]:
                    log.warning("weight sync to %s failed: %s", addr, res)
            elif addr in self._lagging:
                del self._lagging[addr]
                log.info("replica %s now serves version %d", addr, version)
        for addr in set(self._lagging) - self._replicas:  # gone since (scaled down, renamed)
            del self._lagging[addr]
        if not self._lagging or self._replicas - set(self._lagging):
            self._set_waiting(None)
        else:
            addr, (v, err) = next(iter(self._lagging.items()))
            self._set_waiting(f"waiting for {addr} to load version {v}: {err}")

    def _set_waiting(self, message: str | None) -> None:
        if message == self._waiting:
            return
        was, self._waiting = self._waiting, message
        if message is not None:
            log.warning("%s", message)
            runlog.append(self.run_dir / EVENTS, {"event": "waiting", "step": self.engine.step_count,
                                                  "message": message})  # fmt: skip
        elif was is not None:
            log.info("a replica serves the newest weights again; training goes on")
            runlog.append(self.run_dir / EVENTS, {"event": "resumed", "step": self.engine.step_count})

    def _stop_ring(self, message: str) -> None:
        """Stop the run (exit ``runlog.EXIT_STOPPED_BY_RULE``: supervisors do not restart it) with ``message``: the
        one way every stopping rule ends a run (log line, ``stopped`` event)."""
        log.error("stopping the run: %s", message)
        runlog.append(self.run_dir / EVENTS, {"event": "stopped", "step": self.engine.step_count, "message": message})
        os._exit(runlog.EXIT_STOPPED_BY_RULE)

    async def _settle_push(self) -> None:
        """Wait for the weight push in flight, if any (its failure ends training like any other)."""
        task, self._push_task = self._push_task, None
        if task is not None:
            await task

    async def _push_weights(self) -> None:
        if not await asyncio.to_thread(expand_targets, self.settings.rollout_addrs):
            return
        if self.engine.group is None:
            await self._deliver(await self._pack())
            return
        async with self._state_lock:
            await self._deliver(None)

    async def checkpoint(self) -> Path:
        """Save now (an admin call): waits for a step in progress, so the checkpoint holds whole steps only."""
        if self.engine is None:
            raise NotReady("the trainer is still starting; no state to checkpoint yet")
        async with self._state_lock:
            return await self._checkpoint()

    async def _checkpoint(self) -> Path:
        """Save, then acknowledge the experience the saved steps consumed. Hold ``_state_lock``.

        The job ids trained since the previous checkpoint close a window: they go to the run's ledger
        (``trained_jobs.jsonl``, written before the checkpoint so a checkpoint never covers jobs the ledger lacks) and
        stay in the duplicate filter for ``KEEP_WINDOWS`` checkpoints. Older ones are forgotten there and in the issued
        ids: their experience was acknowledged before the next checkpoint began, so no record of them can come back,
        and the trainer's memory, its checkpoints and Redis stay bounded however long the run is."""
        step = self.engine.step_count
        dropped: set[str] = set()
        if self._window:
            line = {"step": step, "job_ids": sorted(self._window - self._window_stale)}
            if self._window_stale:
                line["dropped_stale"] = sorted(self._window_stale)
            runlog.append(self.run_dir / LEDGER, line)
            if self._windows and self._windows[-1][0] == step:
                self._windows[-1][1].update(self._window)
            else:
                self._windows.append((step, self._window))
            self._window, self._window_stale = set(), set()
            while len(self._windows) > KEEP_WINDOWS:
                dropped |= self._windows.popleft()[1]
            self.trained_job_ids -= dropped
        extra = {
            "trained_job_ids": sorted(self.trained_job_ids),
            "trained_job_windows": [[st, sorted(ids)] for st, ids in self._windows],
            "samples_trained": self.samples_trained,
            "data": self.cursor.state(),
            "admission_trained": self.jobs_trained,
            "run_id": self.run_id,
        }
        path = await asyncio.to_thread(save_checkpoint, self.ckpt_dir, self.engine, extra)
        self._saved_step = self.engine.step_count
        if self.unacked:
            unacked = list(self.unacked)
            await self._redis("acknowledging experience", self.experience.ack, unacked)
            self.unacked = self.unacked[len(unacked) :]
        if dropped:
            await self._redis("forgetting trained job ids", self.prompts.forget_jobs, sorted(dropped))
        return path

    async def status(self) -> trainer_pb2.StatusResponse:
        try:
            stats = await queue_stats(self.redis, self.run_id)
        except TRANSIENT:
            try:  # once more: after a Redis restart the pool may hand out a connection the old server closed
                stats = await queue_stats(self.redis, self.run_id)
            except TRANSIENT as err:
                raise NotReady(f"Redis is unreachable ({type(err).__name__}); the queue depths are unknown") from None
        m = self.last_metrics
        return trainer_pb2.StatusResponse(
            run_id=self.run_id,
            stage=self.cfg.training.stage,
            step=self.engine.step_count if self.engine else 0,
            policy_version=self.engine.policy_version if self.engine else 0,
            paused=self.paused.is_set(),
            queues=trainer_pb2.QueueDepths(
                prompts_pending=stats.prompts_pending,
                prompts_backlog=stats.prompts_backlog,
                experience_backlog=stats.experience_backlog,
                dead_letters=stats.dead_letters,
            ),
            mean_staleness=m.get("staleness/mean", 0.0),
            max_staleness=self.cfg.training.max_staleness,
            metrics={k: float(v) for k, v in m.items()},
            samples_trained=self.samples_trained,
        )


def _completion_rows(experiences: list[experience_pb2.Experience], limit: int = 8) -> list[dict]:
    """The first sample of up to ``limit`` records: prompt, response, reward (None when its scoring failed)."""
    rows = []
    for exp in experiences[:limit]:
        if exp.samples:
            s = exp.samples[0]
            ok = s.score_status == common_pb2.ITEM_STATUS_OK
            rows.append({"prompt": exp.prompt_text, "response": s.response_text, "reward": s.score if ok else None,
                         "policy_version": s.policy_version})  # fmt: skip
    return rows


def _error_text(err: BaseException) -> str:
    """A push failure in one line: a gRPC error's code and details (not its debug string)."""
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}"


def _tls_names(addrs: list[str]) -> dict[str, str]:
    """Expanded target -> the host name it was resolved from (for TLS name checks)."""
    return {t: a.rpartition(":")[0].strip("[]") for a in addrs for t in expand_targets([a]) if t != a}


def expand_targets(addrs: list[str]) -> list[str]:
    """Every replica behind each ``host:port``: a compose service name or a Kubernetes headless Service resolves to
    one address per replica, and each must get the weights (one gRPC connection would reach only one of them).
    Resolved before every push, since replicas come and go."""
    out: list[str] = []
    for addr in addrs:
        host, _, port = addr.rpartition(":")
        try:
            infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError):
            out.append(addr)  # unresolvable now: try as given, the push reports the failure
            continue
        for ip in dict.fromkeys(info[4][0] for info in infos):
            target = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
            if target not in out:
                out.append(target)
    return out
