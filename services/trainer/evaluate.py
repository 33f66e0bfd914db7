"""Evaluation during training (the ``eval`` section): held-out prompts sent straight to the rollout replicas'
``Generate`` and scored by the reward service's ``Score``, reported as ``eval/*`` rows of ``metrics.jsonl``.

An asyncio task beside training, never under the trainer's state lock; each evaluation first waits for the push of
the step it evaluates and for the evaluation before it. The samples are no prompt jobs. ``rlhf eval``
(:mod:`services.eval_run`) runs one evaluation with this same class (:meth:`Evaluator.run`).
Design: docs/training.md (the ``eval`` section and ``rlhf eval``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import grpc

from rlhf import runlog
from rlhf.config import ExperimentConfig
from rlhf.data import load_eval_prompts, record_prompt_ids
from rlhf.evaluation import eval_metrics
from rlhf.serving.runner import open_channel
from rlhf.serving.settings import ServiceSettings
from rlhf.tracking import Tracker
from rlhf.v1 import common_pb2, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from services.trainer.fleet import expand_targets, tls_names

log = logging.getLogger("rlhf.trainer.eval")


class Evaluator:
    def __init__(self, cfg: ExperimentConfig, settings: ServiceSettings, tokenizer, run_dir: Path, tracker: Tracker):
        e = cfg.eval
        if not settings.reward_addr:
            raise ValueError("eval.interval is set but the trainer has no RLHF_REWARD_ADDR to score eval samples with")
        if not settings.rollout_addrs:
            raise ValueError("eval.interval is set but the trainer has no RLHF_ROLLOUT_ADDRS to generate with")
        self.cfg, self.settings, self.tracker, self.tokenizer = cfg, settings, tracker, tokenizer
        self.metrics_path = Path(run_dir) / "metrics.jsonl"
        a = cfg.actor
        self.records = load_eval_prompts(cfg)
        self.prompt_ids = [
            record_prompt_ids(tokenizer, r, a.max_prompt_length, a.apply_chat_template) for r in self.records
        ]
        self.prompt_texts = [
            r.prompt or tokenizer.decode(ids, skip_special_tokens=True)
            for r, ids in zip(self.records, self.prompt_ids, strict=True)
        ]
        defaults = cfg.sampling_defaults()
        self.params = common_pb2.SamplingParams(
            n=e.n,
            temperature=e.temperature,
            top_p=defaults["top_p"] if e.temperature else 1.0,
            top_k=defaults["top_k"] if e.temperature else 0,
            max_tokens=e.max_new_tokens or cfg.max_new_tokens,
            stop=list(defaults["stop"]),
            seed=cfg.training.seed,
        )
        self._last: asyncio.Task | None = None
        self._names: dict[str, str] = {}
        self.on_progress: Callable[[str], None] | None = None  # told each phase of an evaluation (rlhf eval prints)
        if e.interval:
            log.info(
                "evaluating %d held-out prompts of %s every %d steps and at the end",
                len(self.records),
                e.path,
                e.interval,
            )

    def due(self, step: int) -> bool:
        return step % self.cfg.eval.interval == 0 or step >= self.cfg.training.train_iters

    def schedule(self, step: int, push: asyncio.Task | None) -> asyncio.Task:
        """Start the evaluation of ``step`` beside training, after ``push`` (that step's weights) and the previous
        evaluation; returns its task."""
        self._last = asyncio.create_task(self._after(step, push, self._last))
        return self._last

    @property
    def last(self) -> asyncio.Task | None:
        """The latest evaluation started (it waits for the ones before it)."""
        return self._last

    async def wait(self) -> None:
        """The evaluations started so far, finished (the end of training)."""
        if self._last is not None:
            await self._last

    async def _after(self, step: int, push: asyncio.Task | None, previous: asyncio.Task | None) -> None:
        for t in (push, previous):
            if t is not None:
                try:
                    await asyncio.shield(t)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the push's failure is the training loop's to report
                    pass
        await self.run(step)

    async def run(self, step: int, *, reraise: bool = False) -> dict[str, float]:
        """One evaluation, reported as ``step``: a ``metrics.jsonl`` row, the tracker, a log line; returns its
        metrics. One that cannot run is reported as ``eval/failed_fraction`` 1 (training goes on), or, with
        ``reraise``, raised with nothing written (``rlhf eval`` exits with the error)."""
        t0 = time.perf_counter()
        try:
            metrics = await self.evaluate()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # an evaluation that cannot run is reported, training goes on
            if reraise:
                raise
            log.error("evaluation at step %d failed: %s", step, err)
            metrics = {"eval/failed_fraction": 1.0, "eval/prompts": float(len(self.records))}
        metrics["eval/time_s"] = time.perf_counter() - t0
        runlog.append(self.metrics_path, {"step": step, **metrics})
        self.tracker.log_eval(metrics, step)
        log.info(
            "eval step %d: reward %.4f pass@%d %.3f length %.1f failed %.0f%%",
            step,
            metrics.get("eval/reward_mean", math.nan),
            self.cfg.eval.n,
            metrics.get(f"eval/pass@{self.cfg.eval.n}", math.nan),
            metrics.get("eval/response_length_mean", math.nan),
            100 * metrics["eval/failed_fraction"],
        )
        return metrics

    def _progress(self, msg: str) -> None:
        if self.on_progress is not None:
            self.on_progress(msg)

    async def evaluate(self) -> dict[str, float]:
        """Generate and score every held-out prompt once; the ``eval/*`` metrics."""
        addrs = await asyncio.to_thread(expand_targets, self.settings.rollout_addrs)
        # a TLS ring: each replica is verified against its service's name, not its pod address (as the pushes are)
        self._names = await asyncio.to_thread(tls_names, self.settings.rollout_addrs)
        shares = [list(range(len(self.records)))[i :: len(addrs)] for i in range(len(addrs))]
        shares = [(addr, idx) for addr, idx in zip(addrs, shares, strict=True) if idx]
        timeout = self.cfg.eval.timeout_s
        self._progress(
            f"generating {len(self.records)} prompts x {self.cfg.eval.n} samples on {len(shares)} rollout replica(s)"
        )
        results = await asyncio.gather(*(self._generate(addr, idx, timeout) for addr, idx in shares))
        completions: dict[int, list] = {}
        versions = []
        for (_, idx), resp in zip(shares, results, strict=True):
            if len(resp.results) != len(idx):
                raise RuntimeError(f"Generate answered {len(resp.results)} results for {len(idx)} prompts")
            versions.append(resp.policy_version)
            for i, res in zip(idx, resp.results, strict=True):
                completions[i] = list(res.completions)
        order = sorted(completions)
        items = []
        for i in order:
            rec = self.records[i]
            for c in completions[i]:
                items.append(
                    reward_pb2.ScoreItem(
                        prompt=self.prompt_texts[i],
                        response=c.text or self.tokenizer.decode(c.token_ids, skip_special_tokens=True),
                        label=rec.label,
                        prompt_ids=self.prompt_ids[i],
                        response_ids=c.token_ids,
                        finished=c.finish_reason == common_pb2.FINISH_REASON_STOP,
                    )
                )
        self._progress(f"scoring {len(items)} samples with the reward service at {self.settings.reward_addr}")
        async with open_channel(self.settings.reward_addr, self.settings) as ch:
            scores = await reward_pb2_grpc.RewardServiceStub(ch).Score(
                reward_pb2.ScoreRequest(items=items), timeout=timeout
            )
        if len(scores.results) != len(items):
            raise RuntimeError(f"Score answered {len(scores.results)} results for {len(items)} samples")
        it = iter(scores.results)
        rewards, lengths = [], []
        for i in order:
            row = [next(it) for _ in completions[i]]
            rewards.append([s.score if s.status == common_pb2.ITEM_STATUS_OK else None for s in row])
            lengths.append([len(c.token_ids) for c in completions[i]])
        metrics = eval_metrics(rewards, lengths, self.cfg.eval.pass_threshold)
        metrics["eval/policy_version"] = float(min(versions))
        return metrics

    async def _generate(self, addr: str, idx: list[int], timeout: float) -> rollout_pb2.GenerateResponse:
        req = rollout_pb2.GenerateRequest(
            prompts=[common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=self.prompt_ids[i])) for i in idx],
            params=self.params,
            request_id=f"eval-{uuid.uuid4().hex[:12]}",
        )
        async with open_channel(addr, self.settings, server_name=self._names.get(addr)) as ch:
            try:
                return await rollout_pb2_grpc.RolloutServiceStub(ch).Generate(req, timeout=timeout)
            except grpc.aio.AioRpcError as err:
                raise RuntimeError(f"Generate on {addr}: {err.code().name}: {err.details()}") from None
