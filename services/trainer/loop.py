"""The trainer's ring driver: the ``Trainer`` object that owns the run.

It consumes experience, runs one update per ``global_batch_size`` records, writes ``metrics.jsonl`` and checkpoints,
and acknowledges experience only once a checkpoint covers it; it stops after ``training.train_iters`` steps or by a
stopping rule. Its parts: ``publisher``, ``fleet``, ``ledger``, ``engine``; the servers around it: ``grpc_servicer``,
``http_app``, ``main``. Design: docs/code-tour.md#1-a-prompt-job-to-its-training-step, docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from rlhf import runlog
from rlhf.config import ExperimentConfig
from rlhf.serving import NotReady, ServiceRunner, ServiceSettings
from rlhf.tracking import Tracker
from rlhf.transport import ExperienceQueue, MalformedRecord, connect, drop_trained, queue_stats
from rlhf.v1 import common_pb2, experience_pb2, trainer_pb2
from services.trainer.batch import NoUsableSamples, score_failures
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.engine import TrainerEngine
from services.trainer.evaluate import Evaluator
from services.trainer.fleet import Fleet, collective_backend
from services.trainer.ledger import Ledger
from services.trainer.publisher import TRANSIENT, Publisher, retrying
from services.trainer.signals import RingSignals

log = logging.getLogger("rlhf.trainer")
CONSUMER = "trainer-0"
EVENTS = "events.jsonl"  # in the run folder: the ring's changes of state (waiting for a replica, resumed, stopped)


class Trainer:
    def __init__(self, cfg: ExperimentConfig, settings: ServiceSettings, runner: ServiceRunner):
        self.cfg, self.settings, self.runner = cfg, settings, runner
        self.run_id = settings.run_id or cfg.run_id
        self.run_dir = Path(settings.run_dir or Path(cfg.training.save).parent)
        self.ckpt_dir = self.run_dir / "checkpoints" if settings.run_dir else Path(cfg.training.save)
        self.engine: TrainerEngine | None = None
        self.publisher: Publisher | None = None
        self.fleet: Fleet | None = None
        self.ledger = Ledger(self.run_dir)
        self.paused = asyncio.Event()
        self.last_metrics: dict[str, float] = {}
        self.stale_dropped = 0
        self.samples_trained = 0
        self.done = False
        # One writer of the trainer's state at a time: a step and a checkpoint (the loop's or an admin call's) never
        # interleave, so a checkpoint holds one step's weights with that step's ledger.
        self._state_lock = asyncio.Lock()
        self.dead_lettered = 0
        self._held: list[tuple[str, experience_pb2.Experience]] = []  # read, not yet trained (see _next_batch)
        # what start() builds; stop() may run before it did, or after it failed half-way
        self.redis = None
        self.experience: ExperienceQueue | None = None
        self.tracker: Tracker | None = None
        self.evaluator: Evaluator | None = None
        self.tasks: list[asyncio.Task] = []
        self.signals: RingSignals | None = None  # the ring's scaling signals on /metrics (services/trainer/signals.py)
        self._saved_step: int | None = None  # the step of the newest checkpoint written or resumed from
        self._failed_steps = 0  # in a row (reward.failed_patience)
        self._mismatch_steps = 0  # in a row (training.mismatch_patience)
        # Set when the run ends without a checkpoint (a failed step, a stopping rule): the process's exit code
        # (services/trainer/main.py raises it).
        self.exit_code: int | None = None

    # ------------------------------------------------------------------ start-up
    async def start(self) -> None:
        self.engine = await asyncio.to_thread(TrainerEngine, self.cfg, self.settings.device)
        # a collective backend this trainer cannot run: refused at start
        collective = collective_backend(self.settings, self.engine.device)
        self.redis = connect(self.settings.redis_url)
        self.experience = ExperienceQueue(self.redis, self.run_id)
        self.publisher = Publisher(self.cfg, self.run_id, self.redis, self.engine.tokenizer, self.paused)
        self.fleet = Fleet(
            self.settings,
            self.engine,
            self.publisher,
            self._state_lock,
            self.run_dir / EVENTS,
            self._stop_ring,
            collective,
        )
        ckpt = self.cfg.training.load or latest_checkpoint(self.ckpt_dir)
        trained, data = 0, None
        if ckpt:
            state = await asyncio.to_thread(load_checkpoint, ckpt, self.engine)
            self.ledger.restore(state)
            self.samples_trained = state.get("samples_trained", 0)
            data = state["data"]
            trained = state["admission_trained"]
        published = await self.publisher.restore(trained, data)
        # Versions never go backwards: weights that differ from what the replicas serve are published under a new,
        # higher version. A 4-bit actor base (QLoRA) differs from the full-precision folder the replicas load.
        if ckpt or published is not None or self.cfg.actor.load_in_4bit:
            self.engine.state.republish(published)
            await self.fleet.push_current()
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
        await self.publisher.read_trained()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Steps after the checkpoint are trained again: each step stays in metrics.jsonl once.
        self.ledger.truncate_after(self.engine.step_count)
        cut = runlog.truncate_after(self.run_dir / "metrics.jsonl", self.engine.step_count)
        if cut:
            log.info("metrics.jsonl cut back to step %d (%d later line(s) removed)", self.engine.step_count, cut)
        self.tracker = Tracker(self.run_dir, self.run_id, self.cfg.model_dump(), resume_step=self.engine.step_count)
        self._saved_step = self.engine.step_count if ckpt else None
        # held-out prompts evaluated beside training (services/trainer/evaluate.py); on rank 0, which logs
        self.evaluator = (
            Evaluator(self.cfg, self.settings, self.engine.tokenizer, self.run_dir, self.tracker)
            if self.cfg.eval.interval
            else None
        )
        finished = lambda: self.done
        self.signals = RingSignals(self.runner.metrics, self.publisher.admission.capacity)
        self.tasks = [
            asyncio.create_task(self.signals.refresh_loop(self.redis, self.run_id, finished)),
            asyncio.create_task(self.publisher.publish_loop(finished, lambda: self.engine.policy_version)),
            asyncio.create_task(self._train_loop()),
            asyncio.create_task(self.fleet.catch_up_loop(finished)),
            asyncio.create_task(self.publisher.reassert_loop(finished)),
        ]
        if self.engine.group is not None:
            self.tasks.append(asyncio.create_task(self._heartbeat_loop()))

    async def stop(self) -> None:
        """SIGTERM (Ctrl-C under ``rlhf up``, a pod or container stop): finish the step in progress, checkpoint
        what was trained since the last checkpoint, then stop. Killed before it is done, the previous checkpoint
        stands (checkpoints are atomic).

        A run that ended (:meth:`_end`: a failed step, a stopping rule) writes no checkpoint: its last step may be
        half done (trained, not yet in the ledger); it leaves the other ranks of a group to torchrun, as a crash
        would, since they may be inside a collective that rank 0 left."""
        tasks = self._tasks()
        unsaved = self.engine is not None and bool(self.tasks) and not self.done and self.exit_code is None
        if unsaved and self.engine.step_count not in (0, self._saved_step):
            async with self._state_lock:  # waits for a step in progress; none starts after it
                for t in tasks:
                    t.cancel()
                log.info("stopping: checkpointing step %d", self.engine.step_count)
                try:
                    await self._checkpoint()
                except Exception:  # the previous checkpoint stands
                    log.exception("checkpoint on stop failed")
        for t in tasks:
            t.cancel()
        if self.engine is not None and self.engine.group is not None and self.exit_code is None:
            try:  # after the checkpoint, which the other ranks took part in
                await asyncio.to_thread(self.engine.stop_followers)
            except Exception:  # a dead rank: torchrun ends the group anyway
                log.exception("could not stop the other trainer ranks")
        if self.tracker is not None:
            self.tracker.close(self.exit_code)
        if self.redis is not None:
            await self.redis.aclose()

    def _tasks(self) -> list[asyncio.Task]:
        """The loops start() began, the weight push in flight and the evaluation in flight."""
        tasks = [*self.tasks]
        if self.fleet is not None:
            tasks.append(self.fleet.push_task)
        if self.evaluator is not None:
            tasks.append(self.evaluator.last)
        return [t for t in tasks if t is not None]

    def _end(self, code: int) -> None:
        """End the run now with exit ``code`` and no checkpoint: the trainer's tasks are cancelled (the one that calls
        this returns or raises), the runner stops the servers and :meth:`stop`, and main exits with ``code``."""
        self.exit_code = code
        for t in self._tasks():
            t.cancel()
        self.runner.request_stop()

    async def _heartbeat_loop(self) -> None:
        """A multi-process trainer's other ranks wait in a collective for rank 0's next command; while the ring
        waits for experience, a no-op now and then keeps them under the collective timeout."""
        interval = self.cfg.training.collective_timeout_s / 4
        while True:
            await asyncio.sleep(interval)
            await asyncio.to_thread(self.engine.heartbeat)

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
                records = await retrying("reading experience", self.experience.read, CONSUMER, want, block)
                split = drop_trained(records, self.ledger.trained_job_ids | {e.job_id for _, e in self._held})
                self.ledger.duplicates(split.duplicate_ids)
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
            if self.fleet.waiting is not None:  # the catch-up loop pushes again meanwhile; no new job is admitted
                await asyncio.sleep(0.5)
            elif self.publisher.behind:
                # slots freed by stale drops: no step may come to free them (a sync ring would wait). While no replica
                # serves the newest weights they stay closed: new jobs would only come back stale, in a loop.
                await self.publisher.write_admission()
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
        state = self.engine.state
        behind = state.steps_behind(torch.tensor(versions), state.step).tolist()
        bound = self.cfg.training.max_staleness
        stale = [r for r, b in zip(self._held, behind, strict=True) if b > bound]
        if not stale:
            return 0
        self._held = [r for r, b in zip(self._held, behind, strict=True) if b <= bound]
        self.ledger.consumed(stale, stale=True)  # a duplicate record of one is dropped too
        self.publisher.consumed(len(stale))
        self.stale_dropped += len(stale)
        say = log.debug if self.fleet.waiting else log.info  # while waiting, the waiting line says why; once
        say(
            "dropped %d record(s) staler than max_staleness %d before step %d (%s steps behind)",
            len(stale),
            bound,
            self.engine.step_count + 1,
            max(behind),
        )
        return len(stale)

    def _check_scoring(self, experiences: list[experience_pb2.Experience], failed_fraction: float) -> None:
        """Stop the run (exit ``runlog.EXIT_STOPPED_BY_RULE``, which supervisors should not restart) when more than
        ``reward.max_failed_fraction`` of the samples failed scoring for ``reward.failed_patience`` steps in a row:
        training on the few that scored would be training on a different reward, silently."""
        r = self.cfg.reward
        if failed_fraction <= r.max_failed_fraction:
            self._failed_steps = 0
            return
        self._failed_steps += 1
        detail = score_failures(experiences)
        log.warning(
            "%.0f%% of this step's samples failed scoring (%d/%d steps in a row): %s",
            100 * failed_fraction,
            self._failed_steps,
            r.failed_patience,
            detail,
        )
        if self._failed_steps >= r.failed_patience:
            self._stop_ring(
                f"more than {100 * r.max_failed_fraction:.0f}% of the samples failed scoring for "
                f"{r.failed_patience} steps in a row (reward.max_failed_fraction, reward.failed_patience): "
                f"{detail}"
            )

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
        self._mismatch_steps += 1
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
            log.warning(
                "%s; expected with top_p %g / top_k %d (the sampling log-probs are of the truncated "
                "distribution), so the run goes on",
                detail,
                a.top_p,
                a.top_k,
            )
            return
        meaning = (
            "these samples were not drawn from the weights their version names: most likely a rollout replica "
            "acknowledged a weight push but serves other weights (a load that failed silently; restart it), "
            "or the engine computes another distribution than the trainer (dtype, kernels, sampling "
            "parameters)"
        )
        log.warning("%s (%d/%d steps in a row)", detail, self._mismatch_steps, t.mismatch_patience)
        if self._mismatch_steps >= t.mismatch_patience:
            self._stop_ring(
                f"trainer-inference mismatch over training.max_mismatch_kl for {self._mismatch_steps} "
                f"steps in a row (training.mismatch_patience): {detail}; {meaning}"
            )

    async def _dead_letter(self, entry_id: str, exp: experience_pb2.Experience, reason: str) -> None:
        """Move an experience record the trainer cannot use to the dead letters (acknowledged there; its job's
        admission slot is released if this run issued it), so no restart meets it again."""
        reason = f"trainer: {reason}"
        payload = exp.SerializeToString()
        moved = await retrying(
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
                    except Exception as own:  # noqa: BLE001 - any error of its own marks the record
                        culprits.append((entry_id, exp, f"{type(own).__name__}: {own}"))
                if not culprits:
                    raise
                log.warning(
                    "step %d failed (%s: %s); retrying without %d record(s)",
                    self.engine.step_count + 1,
                    type(err).__name__,
                    err,
                    len(culprits),
                )
                for entry_id, exp, reason in culprits:
                    await self._dead_letter(entry_id, exp, f"the update step failed on this record: {reason}")
                bad = {entry_id for entry_id, _, _ in culprits}
                batch = [(entry_id, exp) for entry_id, exp in batch if entry_id not in bad]
        return None, batch

    async def _train_loop(self) -> None:
        t = self.cfg.training
        if self.evaluator is not None and self.cfg.eval.before_training and self.engine.step_count == 0:
            self.evaluator.schedule(0, None)  # the weights every replica starts from: no push until it is done
            await self.evaluator.wait()
        try:
            while self.engine.step_count < t.train_iters:
                t0 = time.perf_counter()
                batch = await self._next_batch()
                wait_s = time.perf_counter() - t0
                if self.signals is not None:
                    self.signals.observe_wait(wait_s)
                async with self._state_lock:
                    await self._train_step(batch, t0, wait_s)
        except asyncio.CancelledError:
            raise
        except runlog.StoppedByRule:
            return  # _stop_ring has said why and ended the run
        except Exception:
            log.exception("training failed")
            self._end(1)  # a broken trainer must not look healthy; experience stays unacked for the next start
            return
        if self.evaluator is not None:
            await self.evaluator.wait()  # the evaluation of the last step
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
            self.ledger.consumed(batch)
            self.publisher.consumed(len(batch))
            await self.publisher.write_admission()
            return
        if metrics is None:
            return  # every record was dead-lettered: read another batch
        self._check_scoring([e for _, e in batch], metrics["reward/failed_fraction"])
        self.ledger.consumed(batch)
        self.samples_trained += int(metrics["samples"])
        push = self.engine.step_count % t.weight_sync_interval == 0
        # Counted at once, admitted only once the weights they trained are out.
        self.publisher.consumed(len(batch), pushed_later=push)
        # The previous update must be out first: versions reach replicas in order, and the trained count that frees
        # admission only grows.
        await self.fleet.settle()
        if push:
            await self.fleet.push_step(jobs=len(batch))  # one process: overlaps the next step; a group: waits
        else:
            await self.publisher.write_admission()
        if self.engine.step_count >= t.train_iters:
            await self.fleet.settle()
        if self.engine.step_count % t.save_interval == 0 or self.engine.step_count >= t.train_iters:
            await self._checkpoint()
        elapsed = time.perf_counter() - t0
        stats = await retrying("queue stats", queue_stats, self.redis, self.run_id)
        if self.signals is not None:
            self.signals.update(stats)
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
        if self.evaluator is not None and self.evaluator.due(step):
            self.evaluator.schedule(step, self.fleet.push_task)  # beside training, after this step's push

    def _stop_ring(self, message: str) -> None:
        """Stop the run (exit ``runlog.EXIT_STOPPED_BY_RULE``: supervisors do not restart it) with ``message``: the
        one way every stopping rule ends a run (log line, ``stopped`` event, no checkpoint). Raises
        ``runlog.StoppedByRule``, so nothing after the rule (the step's bookkeeping, a push's publication) happens."""
        log.error("stopping the run: %s", message)
        runlog.append(self.run_dir / EVENTS, {"event": "stopped", "step": self.engine.step_count, "message": message})
        self._end(runlog.EXIT_STOPPED_BY_RULE)
        raise runlog.StoppedByRule(message)

    async def checkpoint(self) -> Path:
        """Save now (an admin call): waits for a step in progress, so the checkpoint holds whole steps only."""
        if self.engine is None:
            raise NotReady("the trainer is still starting; no state to checkpoint yet")
        async with self._state_lock:
            if self.exit_code is not None:  # its last step may be half done (see stop)
                raise NotReady(f"the run has ended (exit code {self.exit_code}); nothing more is checkpointed")
            return await self._checkpoint()

    async def _checkpoint(self) -> Path:
        """Save, then acknowledge the experience the saved steps consumed. Hold ``_state_lock``.

        The job ids consumed since the previous checkpoint close a window in the ledger (written before the
        checkpoint, so a checkpoint never covers jobs the ledger lacks); the ids it forgets leave the issued ids too
        (:mod:`services.trainer.ledger`)."""
        dropped = self.ledger.close_window(self.engine.step_count)
        extra = {
            **self.ledger.checkpoint_fields(),  # trained_job_ids, trained_job_windows
            "samples_trained": self.samples_trained,
            "data": self.publisher.cursor.state(),
            "admission_trained": self.publisher.jobs_trained,
            "run_id": self.run_id,
        }
        path = await asyncio.to_thread(save_checkpoint, self.ckpt_dir, self.engine, extra)
        self._saved_step = self.engine.step_count
        if self.ledger.unacked:
            unacked = list(self.ledger.unacked)
            await retrying("acknowledging experience", self.experience.ack, unacked)
            self.ledger.acked(len(unacked))
        if dropped:
            await retrying("forgetting trained job ids", self.publisher.prompts.forget_jobs, sorted(dropped))
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
            rows.append(
                {
                    "prompt": exp.prompt_text,
                    "response": s.response_text,
                    "reward": s.score if ok else None,
                    "policy_version": s.policy_version,
                }
            )
    return rows
