"""The trainer's state and its update step: the actor, the critic (PPO), the optimizers and the KL controller.

``TrainerEngine.step(experiences)`` turns experience records (from the Redis experience stream) into one policy
update with the algorithm named by ``training.stage``:

* ``ray_ppo``: GAE with a critic; the math of ``rlhf.algo.ppo_rollout`` (TRL's conventions), clipped policy and value
  losses over minibatches and epochs, optional entropy bonus.
* ``ray_grpo`` / ``ray_rloo`` / ``ray_reinforce_plus_plus``: critic-free, advantages from the ``n`` samples of each
  prompt (one experience record holds one prompt's group).
* ``ray_online_dpo``: two samples per prompt, chosen/rejected by score, sigmoid or IPO loss.

Old log-probs are recomputed with the current actor (as MindSpeed-LLM does); the rollout engine's sampling log-probs
are the behaviour policy, and with ``tis_cap`` set each token is weighted by the truncated importance ratio, which
corrects samples made by an older policy version (asynchronous training) and engine mismatch.

Each stage also measures that mismatch where it has the current weights' log-probs of the batch anyway (PPO's and
the critic-free stages' old pass, online DPO's first minibatch): ``mismatch/kl`` and ``mismatch/max_abs`` over the
samples the current weights made (:meth:`TrainerEngine.same_weights`), which the trainer's loop checks against
``training.max_mismatch_kl``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlhf import algo
from rlhf import distributed as dist
from rlhf.config import ExperimentConfig
from rlhf.models import (
    causal_lm_logits,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
    resolve_device,
    resolve_model_path,
    score_head_outputs,
)
from rlhf.v1 import common_pb2, experience_pb2
from services.trainer import checkpoint, optim

if TYPE_CHECKING:
    from rlhf.transport.weights.format import StreamedWeights

log = logging.getLogger("rlhf.trainer")


class NoUsableSamples(ValueError):
    """Every sample of a batch failed scoring (or is empty): the scorers' fault, not the records'."""


_SCORER_NAME = re.compile(r"scorer '([^']+)'")


def score_stats(experiences: list[experience_pb2.Experience]) -> dict[str, float]:
    """``reward/failed_fraction`` (samples whose score failed) and ``reward/<scorer>`` (each scorer's mean component
    over the samples scored OK) of a batch."""
    total = failed = 0
    sums: dict[str, list[float]] = {}
    for exp in experiences:
        for s in exp.samples:
            total += 1
            if s.score_status != common_pb2.ITEM_STATUS_OK:
                failed += 1
                continue
            for name, v in s.score_components.items():
                sums.setdefault(name, []).append(v)
    out = {"reward/failed_fraction": failed / total if total else 0.0}
    for name, vs in sums.items():
        key = f"reward/{name}" if name not in ("mean", "std", "failed_fraction") else f"reward/scorer_{name}"
        out[key] = sum(vs) / len(vs)
    return out


def score_failures(experiences: list[experience_pb2.Experience]) -> str:
    """Which scorers failed on a batch's samples, most often first, with one error of each: for a message."""
    by_scorer: dict[str, list[str]] = {}
    for exp in experiences:
        for s in exp.samples:
            if s.score_status != common_pb2.ITEM_STATUS_OK:
                m = _SCORER_NAME.search(s.score_error)
                by_scorer.setdefault(m.group(1) if m else "?", []).append(s.score_error or "no error text")
    ranked = sorted(by_scorer.items(), key=lambda kv: -len(kv[1]))
    return "; ".join(f"scorer {name!r} failed {len(errs)} time(s), e.g. {errs[0]}" for name, errs in ranked[:3])


def _mismatch_by_replica(
    experiences: list[experience_pb2.Experience], rows: tuple[torch.Tensor, ...] | None
) -> dict[str, tuple[float, int, list[int]]]:
    """Replica id -> (mean k3, tokens, versions) of a step's mismatch (``TrainerEngine._mismatch_rows``): which
    replica made the samples that disagree with the trainer, for a message that names it."""
    if rows is None:
        return {}
    acc: dict[str, list] = {}
    for g, v, kl_sum, n in zip(*(t.tolist() for t in rows), strict=True):
        if n:
            a = acc.setdefault(experiences[g].replica_id or "?", [0.0, 0, set()])
            a[0] += kl_sum
            a[1] += int(n)
            a[2].add(v)
    return {r: (s / n, n, sorted(vs)) for r, (s, n, vs) in acc.items()}


@dataclass
class RolloutBatch:
    """Experience records collated into padded tensors. B rows = samples; C prompt width; L response width."""

    query_responses: torch.Tensor  # (B, C + L) left-padded prompt, right-padded response
    responses: torch.Tensor  # (B, L)
    sampling_logprobs: torch.Tensor  # (B, L) 0 on padding
    ref_logprobs: torch.Tensor  # (B, L)
    scores: torch.Tensor  # (B,)
    group: torch.Tensor  # (B,) index of the experience record (prompt) of each row
    policy_versions: torch.Tensor  # (B,)
    has_sampling_logprobs: torch.Tensor  # (B,) bool: the engine reported sampling log-probs for this row
    context_length: int


class TrainerEngine:
    def __init__(self, cfg: ExperimentConfig, device: str | None = None):
        self.cfg = cfg
        self.stage = cfg.training.stage
        self.device = resolve_device(device or cfg.training.device)
        # None at world size 1: no process group, and every method below runs its single-process code unchanged.
        self.group = dist.init_from_env(self.device, cfg.training.collective_timeout_s)
        if self.group is not None:
            _refuse_in_group(cfg)
        torch.manual_seed(cfg.training.seed)
        actor_path = resolve_model_path(cfg.actor.load)
        self.tokenizer = load_tokenizer(cfg.training.tokenizer_name_or_path or actor_path)
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        # Parameters and AdamW state stay fp32 even with bf16 (master weights): at the configs' lr 5e-7 an update is
        # far below a bf16 weight's resolution, so pure-bf16 weights would hardly move. bf16 is the compute dtype
        # (autocast in every forward) and the dtype pushed to rollout; checkpoints keep fp32.
        self.actor = load_causal_lm(actor_path, self.device, "float32")
        self.actor.train()
        _disable_dropout(self.actor)
        if cfg.actor.lora_r:  # only the adapters train; rollout and checkpoints get the merged weights
            from rlhf.lora import wrap_lora

            a = cfg.actor
            self.actor = wrap_lora(self.actor, a.lora_r, a.lora_alpha, a.lora_target_modules)
        self._prepare(self.actor)
        t = cfg.training
        # fused AdamW, TRL's default ("adamw_torch_fused"): 4-6x faster optimizer steps than the per-tensor loop (CPU)
        fused = self.device.type in ("cpu", "cuda")
        self.actor_optim = optim.actor_optim(cfg)
        self.actor_opt = _adamw(self.actor, self.actor_optim, fused)
        self.critic = None
        self.critic_opt = None
        self.critic_optim = optim.critic_optim(cfg)
        if self.stage == "ray_ppo":
            critic_src = cfg.critic.load or _first_model_scorer(cfg) or "tiny:reward"
            self.critic = load_sequence_classifier(resolve_model_path(critic_src), self.device)
            self.critic.train()
            _disable_dropout(self.critic)
            self._prepare(self.critic)
            self.critic_opt = _adamw(self.critic, self.critic_optim, fused)
        # kl_penalty full (TRL): the whole-vocabulary KL needs the reference's logits, which the reference service
        # does not send (it returns the sampled tokens' log-probs), so the trainer holds a frozen reference copy
        self.ref_model = None
        if cfg.algorithm.kl_penalty == "full":
            ref_src = cfg.actor_rollout_ref.ref.load or cfg.actor.load
            self.ref_model = load_causal_lm(resolve_model_path(ref_src), self.device, "float32").eval()
            self.ref_model.requires_grad_(False)
        # reward normalisation: running statistics of every score seen (checkpointed with the optimizers)
        self.reward_moments = algo.RunningMoments() if cfg.algorithm.normalize_reward else None
        self.ptx = _PtxData(cfg, self.tokenizer) if cfg.actor.ptx_coef > 0 else None
        k = cfg.algorithm.kl_ctrl
        self.kl_ctrl = algo.make_kl_controller(k.type, k.kl_coef, k.target_kl, k.horizon)
        self.generator = torch.Generator().manual_seed(t.seed)
        # PPO: the first minibatch of the first epoch trains at the weights the old log-probs and values are taken
        # at, so its forward pass (with gradient) gives those rows' old values and the old pass covers only the
        # other rows: half an actor and half a critic forward less per step with 2 minibatches (the same values
        # within float32 rounding; TRL likewise takes old log-probs from a pass it already ran, the generation's).
        # False: the old pass over every row (tests and bench.pipeline compare the two).
        self.reuse_first_pass = True
        self.step_count = 0
        self.policy_version = 0
        # (first version, step count it was published at) of each stretch of versions that followed training steps
        # one for one. A restart publishes its restored weights under a new version without a step, so staleness is
        # counted in steps through these, not as a difference of versions.
        self.version_segments: list[tuple[int, int]] = [(0, 0)]
        # Optimizer steps skipped for a non-finite loss or gradient, this step and in all (the critic's thread too).
        self._skipped_lock = threading.Lock()
        self.skipped_updates = 0
        self._skipped_this_step = 0
        # The last step's trainer-inference mismatch by the replica that made the samples: replica id -> (mean k3,
        # tokens, versions), for the trainer's message when the mismatch check stops a run. _mismatch_rows: the
        # stage's per-row part of it (batch rows' records, versions, k3 sums, tokens), or None.
        self.mismatch_by_replica: dict[str, tuple[float, int, list[int]]] = {}
        self._mismatch_rows: tuple[torch.Tensor, ...] | None = None
        # Rank 0's commands to the group (step, gather, heartbeat) go one at a time, each with its collectives.
        self._command_lock = threading.Lock()

    def _prepare(self, model: torch.nn.Module) -> None:
        """Activation checkpointing if asked, then FSDP2 sharding in a group (before its optimizer is built, so the
        AdamW state is sharded too)."""
        if self.cfg.training.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.group is not None:
            dist.shard(model, self.cfg.training.bf16, self.device)

    @property
    def vocab_size(self) -> int:
        """Token ids a record may carry: rows of the input embedding that the output head also scores."""
        rows = self.actor.get_input_embeddings().num_embeddings
        head = self.actor.get_output_embeddings()
        return min(rows, head.out_features) if head is not None else rows

    def check_record(self, exp: experience_pb2.Experience) -> None:
        """Raise MalformedRecord when ``exp`` cannot be trained on by this model (token ids outside the vocabulary).
        The stream checked everything that needs no model; this is what only the trainer can check."""
        from rlhf.transport.codec import check_token_ids  # here: the engine itself needs no Redis client (parity venv)

        check_token_ids(exp, self.vocab_size)

    # ------------------------------------------------------------------ collation
    def collate(self, experiences: list[experience_pb2.Experience]) -> RolloutBatch:
        """Rows for every sample whose score is OK; samples with a failed score are dropped (never scored 0)."""
        rows = []
        for g, exp in enumerate(experiences):
            for s in exp.samples:
                if s.score_status != common_pb2.ITEM_STATUS_OK or len(s.response_ids) == 0:
                    continue
                rows.append((g, list(exp.prompt_ids), s))
        if not rows:
            errors = sorted({s.score_error for exp in experiences for s in exp.samples if s.score_error})
            raise NoUsableSamples(
                "no usable sample in this batch (all scores failed or responses empty)"
                + (f"; score errors: {'; '.join(errors[:3])}" if errors else "")
            )
        C = max(len(p) for _, p, _ in rows)
        L = max(len(s.response_ids) for _, _, s in rows)
        B = len(rows)
        qr = torch.full((B, C + L), self.pad_id, dtype=torch.long)
        samp = torch.zeros(B, L)
        has_samp = torch.zeros(B, dtype=torch.bool)
        ref = torch.zeros(B, L)
        for i, (_, prompt, s) in enumerate(rows):
            n = len(s.response_ids)
            qr[i, C - len(prompt) : C] = torch.tensor(prompt)
            qr[i, C : C + n] = torch.tensor(list(s.response_ids))
            if len(s.sampling_logprobs) == n:
                samp[i, :n] = torch.tensor(list(s.sampling_logprobs))
                has_samp[i] = True
            if len(s.ref_logprobs) != n:
                raise ValueError(
                    f"job {experiences[rows[i][0]].job_id}: ref_logprobs has {len(s.ref_logprobs)} "
                    f"entries for {n} response tokens"
                )
            ref[i, :n] = torch.tensor(list(s.ref_logprobs))
        return RolloutBatch(
            query_responses=qr.to(self.device),
            responses=qr[:, C:].to(self.device),
            sampling_logprobs=samp.to(self.device),
            ref_logprobs=ref.to(self.device),
            scores=torch.tensor([s.score for _, _, s in rows], device=self.device),
            group=torch.tensor([g for g, _, _ in rows], device=self.device),
            policy_versions=torch.tensor([s.policy_version for _, _, s in rows]),
            has_sampling_logprobs=has_samp.to(self.device),
            context_length=C,
        )

    # ------------------------------------------------------------------ forward helpers
    @property
    def temperature(self) -> float:
        return self.cfg.actor.temperature if self.cfg.actor.do_sample else 1.0

    def _autocast(self):
        """bf16 compute over the fp32 weights when ``training.bf16`` is on. Autocast state is per thread, so each
        forward enters it where it runs (the critic's passes run on their own thread)."""
        if not self.cfg.training.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _logits_and_logprobs(self, qr: torch.Tensor, responses: torch.Tensor, C: int, temperature: float | None = None):
        """Response logits and log-probs at ``temperature`` (default the sampling temperature; online DPO uses 1)."""
        with self._autocast():
            logits = causal_lm_logits(self.actor, qr, self.pad_id, self.cfg.training.padding_free)[:, C - 1 : -1]
        T = self.temperature if temperature is None else temperature
        return logits, algo.logprobs_from_logits(logits, responses, T)

    def _actor_rows(self, qr, responses, C: int, temperature: float | None = None, entropy: bool | None = None):
        """Log-probs of the rows and, with ``entropy`` set (True: with gradient), their per-token entropies. In a
        group each rank runs the actor on its share of the rows and the results are gathered (distributed.py)."""
        if self.group is None:
            logits, logprobs = self._logits_and_logprobs(qr, responses, C, temperature)
            return logprobs, self._entropies(logits, entropy, temperature)
        n, rows = qr.shape[0], dist.local_rows(qr.shape[0], self.group)
        logits, logprobs = self._logits_and_logprobs(qr[rows], responses[rows], C, temperature)
        entropies = self._entropies(logits, entropy, temperature)
        logprobs = dist.gather_rows(logprobs, n, self.group)
        return logprobs, None if entropies is None else dist.gather_rows(entropies, n, self.group)

    def _entropies(self, logits: torch.Tensor, entropy: bool | None, temperature: float | None = None):
        if entropy is None:
            return None
        with torch.set_grad_enabled(entropy and torch.is_grad_enabled()):
            return algo.entropy_from_logits(logits, self.temperature if temperature is None else temperature)

    def _critic_rows(self, qr: torch.Tensor, C: int) -> torch.Tensor:
        if self.group is None:
            return self._values(qr, C)
        n = qr.shape[0]
        return dist.gather_rows(self._values(qr[dist.local_rows(n, self.group)], C), n, self.group)

    def _values(self, qr: torch.Tensor, C: int) -> torch.Tensor:
        with self._autocast():
            values = score_head_outputs(self.critic, qr, self.pad_id, self.cfg.training.padding_free)[:, C - 1 : -1]
        return values.float()

    def _behavior(self, b: RolloutBatch, old_logprobs: torch.Tensor) -> torch.Tensor | None:
        """Sampling log-probs for truncated importance sampling; rows without them count as on-policy."""
        if not self.cfg.actor.tis_cap:
            return None
        return torch.where(b.has_sampling_logprobs[:, None], b.sampling_logprobs, old_logprobs)

    def _minibatches(self, n: int, size: int, shuffle: bool):
        order = torch.randperm(n, generator=self.generator) if shuffle else torch.arange(n)
        for start in range(0, n, size):
            yield order[start : start + size]

    def _actor_epochs(self, epochs, micro_size: int | None, micro_loss, stats: dict[str, list[float]]) -> None:
        """The actor's minibatch loop, one for every stage: each minibatch of each epoch is one optimizer step over
        the weighted losses of its micro-batches (``micro_loss(micro_rows, minibatch_rows)``), gradients
        accumulating. ``epochs`` yields each epoch's minibatches (row index tensors), drawn lazily in that order."""
        for epoch in epochs:
            for mb in epoch:
                losses = (micro_loss(mu, mb) for mu in optim.micro_batches(mb, micro_size))
                _append(stats, {"policy/grad_norm": self._actor_step(losses)})

    def _actor_step(self, losses) -> float:
        """One actor optimizer step over ``losses``: one loss tensor, or an iterable of weighted micro-batch losses
        whose gradients accumulate (each is built and freed in turn), plus the PPO-ptx SFT term when configured."""
        losses = [losses] if isinstance(losses, torch.Tensor) else losses
        if self.ptx is not None:
            losses = itertools.chain(losses, [self._ptx_loss()])
        return self._optimizer_step("actor", self.actor, self.actor_opt, losses, self.actor_optim.clip_grad)

    def _ptx_loss(self) -> torch.Tensor:
        """``ptx_coef`` x the SFT loss on the next rows of data.pretrain_data (as many rows as one actor minibatch)."""
        ids = self.ptx.next_batch(self.cfg.actor.ppo_mini_batch_size).to(self.device)
        with self._autocast():
            logits = causal_lm_logits(self.actor, ids, self.pad_id)
        loss = algo.sft_loss(logits.float(), ids, ids != self.pad_id)
        self._ptx_losses.append(loss.item())
        return self.cfg.actor.ptx_coef * loss

    def _optimizer_step(self, role: str, model: torch.nn.Module, opt: torch.optim.Optimizer, losses, clip_grad=None):
        """Backward every loss of ``losses`` (a tensor or an iterable of micro-batch losses, gradients accumulating)
        and step, unless a loss or the gradient is NaN/inf: then the step is skipped (weights and optimizer state
        untouched), logged and counted, and the gradient norm comes back as NaN. One bad minibatch must not turn
        every weight into NaN."""
        opt.zero_grad(set_to_none=True)
        finite = True
        for loss in [losses] if isinstance(losses, torch.Tensor) else losses:
            if not torch.isfinite(loss.detach()).all():  # a whole (micro-)batch's loss: every rank decides alike
                finite = False
                break
            (loss * dist.backward_scale(self.group) if self.group is not None else loss).backward()
        if finite:
            norm = _clip(model, self.cfg.training.clip_grad if clip_grad is None else clip_grad)
            if math.isfinite(norm):
                opt.step()
                return norm
        opt.zero_grad(set_to_none=True)
        with self._skipped_lock:
            self.skipped_updates += 1
            self._skipped_this_step += 1
        log.warning("step %d: %s update skipped: non-finite loss or gradient", self.step_count + 1, role)
        return float("nan")

    # ------------------------------------------------------------------ the update
    def steps_behind(self, versions: torch.Tensor, step: int) -> torch.Tensor:
        """Training steps between the weights that generated samples of ``versions`` and the weights at ``step``.
        Samples from weights a crash discarded (trained past the restored checkpoint) count as 0."""
        starts = torch.tensor([v for v, _ in self.version_segments])
        seg = (torch.searchsorted(starts, versions, right=True) - 1).clamp(min=0)
        steps_at = torch.tensor([st for _, st in self.version_segments])[seg] + (versions - starts[seg])
        return (step - steps_at).clamp(min=0).float()

    def same_weights(self, versions: torch.Tensor, step: int) -> torch.Tensor:
        """(B,) bool: samples of ``versions`` generated by the weights at ``step`` exactly. Unlike
        :meth:`steps_behind` (which counts them as 0 behind), samples of weights a crash discarded (versions past the
        step the next segment restarted at) are not: those weights are gone, whatever step their version maps to."""
        starts = torch.tensor([v for v, _ in self.version_segments])
        steps = torch.tensor([st for _, st in self.version_segments])
        versions = versions.cpu()
        seg = (torch.searchsorted(starts, versions, right=True) - 1).clamp(min=0)
        steps_at = steps[seg] + (versions - starts[seg])
        ends = torch.cat([steps[1:], torch.tensor([torch.iinfo(steps.dtype).max])])  # a segment's last live step
        return (steps_at == step) & (steps_at <= ends[seg])

    def _mismatch(self, b: RolloutBatch, logprobs: torch.Tensor, mask: torch.Tensor, rows=None) -> dict[str, float]:
        """``mismatch/*`` metrics (:func:`rlhf.algo.logprob_mismatch`): the rollout's sampling log-probs against
        ``logprobs``, the trainer's under the current weights at the sampling temperature, over the response tokens
        (``mask``) of ``rows`` (indices into the batch; default all) that the current weights sampled (the others
        differ by training, not by numerics) and that have sampling log-probs. ``kl`` and ``max_abs`` are left out
        when no token qualifies (nothing measured is not 0)."""
        rows = torch.arange(b.responses.shape[0]) if rows is None else rows.cpu()
        versions = b.policy_versions.cpu()[rows]
        dev = b.sampling_logprobs.device
        on_policy = self.same_weights(versions, self.step_count).to(dev) & b.has_sampling_logprobs[rows.to(dev)]
        m = algo.logprob_mismatch(logprobs.detach(), b.sampling_logprobs[rows.to(dev)], mask, on_policy)
        self._mismatch_rows = (b.group.cpu()[rows], versions, m["row_kl_sum"].cpu(), m["row_tokens"].cpu())
        out = {"mismatch/tokens": m["tokens"].item()}
        if out["mismatch/tokens"]:
            out.update({"mismatch/kl": m["kl"].item(), "mismatch/max_abs": m["max_abs"].item()})
        return out

    def probe(self, experiences: list[experience_pb2.Experience]) -> None:
        """Collate ``experiences`` and run the actor's forward pass on them, changing nothing: raises what a step on
        them would raise because of the records themselves (the trainer uses it to find a record that fails a
        step, to dead-letter it). In a group only the collation: a forward on rank 0 alone would wait for the
        other ranks' shards forever."""
        batch = self.collate(experiences)
        if self.group is not None:
            return
        with torch.no_grad():
            self._logits_and_logprobs(batch.query_responses, batch.responses, batch.context_length)

    def step(self, experiences: list[experience_pb2.Experience]) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.collate(experiences)  # in a group: before anything is sent, so a bad batch stops nowhere else
        raw_scores = batch.scores
        alg = self.cfg.algorithm
        if self.reward_moments is not None:  # rank 0's running statistics; the group gets the normalised scores
            self.reward_moments.update(raw_scores)
        if self.reward_moments is not None or alg.reward_clip_range is not None:
            batch.scores = algo.normalize_and_clip(raw_scores, self.reward_moments, alg.reward_clip_range)
        if self.group is not None:
            with self._command_lock:
                dist.broadcast_ints([_STEP], 1, self.device)
                self._send_batch(batch)
                metrics = self._update(batch)
        else:
            metrics = self._update(batch)
        staleness = self.steps_behind(batch.policy_versions, self.step_count - 1)
        metrics.update(score_stats(experiences))
        metrics.update(
            {
                "step": self.step_count,
                "policy_version": self.policy_version,
                "samples": int(batch.responses.shape[0]),
                "reward/mean": raw_scores.mean().item(),
                "reward/std": raw_scores.std().item() if raw_scores.numel() > 1 else 0.0,
                "lr/actor": self._lr,
                "response_length/mean": (batch.responses != self.pad_id).sum(1).float().mean().item(),
                "staleness/mean": staleness.mean().item(),
                "staleness/max": staleness.max().item(),
                "kl_coef": self.kl_ctrl.value,
                "nonfinite/skipped_updates": float(self._skipped_this_step),
                "time/step_s": time.perf_counter() - t0,
            }
        )
        if batch.scores is not raw_scores:
            metrics["reward/normalized_mean"] = batch.scores.mean().item()
        self.mismatch_by_replica = _mismatch_by_replica(experiences, self._mismatch_rows)
        if self._ptx_losses:
            metrics["loss/ptx"] = sum(self._ptx_losses) / len(self._ptx_losses)
        return metrics

    def _update(self, batch: RolloutBatch) -> dict[str, float]:
        """One update on ``batch``: on rank 0, and in a group on every other rank alike (:meth:`follow`)."""
        self._skipped_this_step = 0
        self._ptx_losses: list[float] = []
        self._mismatch_rows = None
        total = self.cfg.training.train_iters
        self._lr = optim.set_lr(self.actor_opt, self.actor_optim, self.step_count, total)
        if self.critic_opt is not None:
            optim.set_lr(self.critic_opt, self.critic_optim, self.step_count, total)
        if self.stage == "ray_ppo":
            metrics = self._ppo(batch)
        elif self.stage == "ray_online_dpo":
            metrics = self._online_dpo(batch)
        else:
            metrics = self._group(batch)
        self.step_count += 1
        self.policy_version += 1
        return metrics

    # ------------------------------------------------------------------ the group: rank 0 leads, the others follow
    def _send_batch(self, b: RolloutBatch) -> None:
        dist.broadcast_ints([b.context_length], 1, self.device)
        dist.broadcast_tensors(_batch_tensors(b), len(_BATCH_FIELDS), self.device)

    def _receive_batch(self) -> RolloutBatch:
        (C,) = dist.broadcast_ints(None, 1, self.device)
        t = dict(zip(_BATCH_FIELDS, dist.broadcast_tensors(None, len(_BATCH_FIELDS), self.device), strict=True))
        return RolloutBatch(responses=t["query_responses"][:, C:], context_length=C, **t)

    def follow(self) -> None:
        """Ranks other than 0: take part in what rank 0 does (steps, weight gathers), collective for collective,
        until it calls :meth:`stop_followers`. Commands and batches arrive as tensors (no pickle)."""
        if self.group is None or self.group.is_driver:
            raise RuntimeError("follow() is for ranks other than 0 of a trainer group")
        while True:
            (cmd,) = dist.broadcast_ints(None, 1, self.device)
            if cmd == _STOP:
                return
            if cmd == _STEP:
                self._update(self._receive_batch())
            elif cmd == _GATHER:
                for _ in self._gathered_policy(keep=False):
                    pass
            elif cmd in (_SAVE, _LOAD):
                path = Path(dist.broadcast_text(None, self.device))
                (checkpoint.write_sharded if cmd == _SAVE else checkpoint.restore)(path, self)
            elif cmd != _NOOP:
                raise RuntimeError(f"trainer group: unknown command {cmd} from rank 0")

    def save_group(self, path: Path) -> None:
        """Rank 0 (checkpoint.save_checkpoint): every rank writes its part of the checkpoint into ``path``."""
        with self._command_lock:
            dist.broadcast_ints([_SAVE], 1, self.device)
            dist.broadcast_text(str(path), self.device)
            checkpoint.write_sharded(path, self)

    def load_group(self, path: Path) -> None:
        """Rank 0 (checkpoint.load_checkpoint): every rank restores its part of the checkpoint at ``path``."""
        with self._command_lock:
            dist.broadcast_ints([_LOAD], 1, self.device)
            dist.broadcast_text(str(path), self.device)
            checkpoint.restore(path, self)

    def heartbeat(self) -> None:
        """Rank 0, idle: a no-op command, so followers waiting for the next one do not reach the collective
        timeout while the ring waits for experience."""
        if self.group is not None:
            with self._command_lock:
                dist.broadcast_ints([_NOOP], 1, self.device)

    def stop_followers(self) -> None:
        if self.group is not None and self.group.is_driver:
            with self._command_lock:
                dist.broadcast_ints([_STOP], 1, self.device)

    def _parallel_critic(self) -> bool:
        """Actor and critic are separate models with separate losses, so their passes can run side by side (as
        OpenRLHF and veRL run them on separate workers); the results are the same as one after the other. On a CPU
        the two sides split the intra-op threads (:meth:`_side_threads`), so it needs two of them."""
        if self.group is not None:  # two threads' collectives could interleave differently on each rank
            return False
        return self.device.type != "cpu" or torch.get_num_threads() >= 2

    def _side_threads(self) -> tuple[int, int] | None:
        """Intra-op threads of the actor's and the critic's side when they run side by side on a CPU (None: leave
        them as they are). Half each: one OpenMP team per model on these matmuls scales worse than two teams of
        half the size side by side (small model, 2 cores: actor and critic on one thread each, side by side, took
        0.58-0.68x the time of both on two threads one after the other; bench.critic_threads). The results agree within
        float32 rounding (bit for bit on the tiny test model; on the small one ~1e-7 on some CPUs, where a kernel's
        result depends on its thread count)."""
        n = torch.get_num_threads()
        if self.device.type != "cpu" or n < 2:
            return None
        return n - n // 2, n // 2

    def _ppo(self, b: RolloutBatch) -> dict[str, float]:
        cfg, a, c, C = self.cfg, self.cfg.actor, self.cfg.critic, b.context_length
        B = b.responses.shape[0]
        pool, split = None, None
        if self._parallel_critic():
            split = self._side_threads()
            init = {} if split is None else {"initializer": torch.set_num_threads, "initargs": (split[1],)}
            pool = ThreadPoolExecutor(1, thread_name_prefix="critic", **init)
        before = torch.get_num_threads()
        if split is not None:
            torch.set_num_threads(split[0])  # this thread's intra-op threads (per thread in torch), restored below
        try:
            run = pool.submit if pool else lambda fn, *args: _Done(fn(*args))
            # Minibatch orders are drawn first, actor's first, so the shared generator gives the same orders
            # whether the critic runs alongside or after the actor and whether the first pass is reused.
            actor_mbs = [list(self._minibatches(B, a.ppo_mini_batch_size, a.shuffle_minibatch))
                         for _ in range(a.ppo_epochs)]  # fmt: skip
            critic_mbs = [list(self._minibatches(B, c.critic_mini_batch_size, a.shuffle_minibatch))
                          for _ in range(c.critic_update_epochs)]  # fmt: skip
            # OpenRLHF's freezing_actor_steps: the critic learns values of a fixed policy before the actor moves
            frozen = self.step_count < a.freezing_actor_steps
            first_a = first_c = None  # the rows whose old pass is their first update's forward (see __init__)
            if self.reuse_first_pass and self.group is None and self.ref_model is None:
                if not frozen and actor_mbs:
                    first_a = next(optim.micro_batches(actor_mbs[0][0], a.micro_batch_size))
                first_c = critic_mbs[0][0] if critic_mbs else None
            values_f = run(self._old_values, b.query_responses, C, first_c)
            full_kl = None
            held_logits = None
            if self.ref_model is not None:  # kl_penalty full: one process only (refused in a group)
                with torch.no_grad():
                    old_logits, old_logprobs = self._logits_and_logprobs(b.query_responses, b.responses, C)
                    with self._autocast():
                        ref_logits = causal_lm_logits(self.ref_model, b.query_responses, self.pad_id)[:, C - 1 : -1]
                    full_kl = algo.full_kl(old_logits, ref_logits, self.temperature)
                    del old_logits
            else:
                old_logprobs, held_logits = self._old_logprobs(b, C, first_a)
            values, held_values = values_f.result()
            r = algo.ppo_rollout(
                b.responses,
                old_logprobs,
                b.ref_logprobs,
                values,
                b.scores,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                stop_token_id=self.eos_id,
                kl_coef=self.kl_ctrl.value,
                kl_estimator=cfg.algorithm.kl_penalty,
                gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam,
                missing_eos_penalty=cfg.algorithm.missing_eos_penalty or None,
                whiten_rewards=cfg.algorithm.whiten_rewards,
                whiten_advantages=cfg.algorithm.whiten_advantages,
                score_position=cfg.algorithm.score_position,
                kl=full_kl,
            )
            metrics = algo.rollout_metrics(r)
            metrics.update(self._mismatch(b, old_logprobs, r.response_mask))
            critic_f = run(self._critic_updates, b, r, critic_mbs, held_values)
            stats = {} if frozen else self._actor_updates(b, r, actor_mbs, held_logits)
            stats.update(critic_f.result())
        finally:
            if pool:
                pool.shutdown(wait=True)
            torch.set_num_threads(before)
        mean_kl = algo.masked_mean(r.kl, r.response_mask, dim=1).mean().item()
        self.kl_ctrl.update(mean_kl, B)
        metrics.update({k: sum(v) / len(v) for k, v in stats.items()})
        metrics["objective/advantages_mean"] = algo.masked_mean(r.advantages, r.response_mask).item()
        metrics["policy/frozen"] = float(frozen)
        return metrics

    def _old_values(self, qr: torch.Tensor, C: int, first: torch.Tensor | None):
        """The critic's values of every row before the update, and (``first``: the critic's first minibatch) those
        rows' values with their graph, which that minibatch's update uses as its forward pass."""
        if first is None:
            with torch.no_grad():  # grad mode is per thread: set here, where it runs
                return self._critic_rows(qr, C), None
        with torch.enable_grad():
            held = self._critic_rows(qr[first], C)
        return _with_rest(qr.shape[0], first, held.detach(), lambda rows: self._critic_rows(qr[rows], C)), held

    def _old_logprobs(self, b: RolloutBatch, C: int, first: torch.Tensor | None):
        """The actor's log-probs of every row before the update, and (``first``: the actor's first micro-batch) those
        rows' logits with their graph, which that micro-batch's loss uses as its forward pass."""
        if first is None:
            with torch.no_grad():
                return self._actor_rows(b.query_responses, b.responses, C)[0], None
        with torch.enable_grad():
            held, lp = self._logits_and_logprobs(b.query_responses[first], b.responses[first], C)
        rest = lambda rows: self._actor_rows(b.query_responses[rows], b.responses[rows], C)[0]  # noqa: E731
        return _with_rest(b.responses.shape[0], first, lp.detach(), rest), held

    def _actor_updates(self, b: RolloutBatch, r, minibatches: list[list[torch.Tensor]], held=None):
        """The actor's PPO epochs. ``held``: the first micro-batch's logits, already computed (with their graph) at
        these weights by the old pass (:meth:`_old_logprobs`)."""
        a, C = self.cfg.actor, b.context_length
        stats: dict[str, list[float]] = {}
        behavior = self._behavior(b, r.logprobs)
        held = [held] if held is not None else []

        def micro_loss(mu: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
            # TRL's token mean over the minibatch = sum over micro-batches of (micro token mean x token share)
            weight = optim.micro_weight("tokens", r.response_mask[mu], r.response_mask[mb])
            if held:
                logits = held.pop()
                new_logprobs = algo.logprobs_from_logits(logits, r.responses[mu], self.temperature)
                entropies = self._entropies(logits, True)
            else:
                new_logprobs, entropies = self._actor_rows(b.query_responses[mu], r.responses[mu], C, entropy=True)
            mask = r.response_mask[mu]
            pg_loss, pg_stats = algo.ppo_policy_loss(
                new_logprobs,
                r.logprobs[mu],
                r.advantages[mu],
                mask,
                clip_ratio=a.clip_ratio,
                clip_ratio_high=a.clip_ratio_high,
                dual_clip=a.dual_clip,
                behavior_logprobs=None if behavior is None else behavior[mu],
                tis_cap=a.tis_cap,
            )
            entropy = algo.masked_mean(entropies, mask)
            loss = pg_loss - a.entropy_coeff * entropy if a.entropy_coeff else pg_loss
            _append(stats, {"loss/policy": pg_loss.item(), "policy/entropy": entropy.item(),
                            **{f"policy/{k}": v.item() for k, v in pg_stats.items()}})  # fmt: skip
            return weight * loss

        self._actor_epochs(minibatches, a.micro_batch_size, micro_loss, stats)
        return stats

    def _critic_updates(self, b: RolloutBatch, r, minibatches: list[list[torch.Tensor]], held=None):
        """The critic's epochs. ``held``: the first minibatch's values, already computed (with their graph) at these
        weights by the old pass (:meth:`_old_values`)."""
        c, C = self.cfg.critic, b.context_length
        stats: dict[str, list[float]] = {}
        held = [held] if held is not None else []
        for epoch in minibatches:
            for mb in epoch:
                vpred = held.pop() if held else self._critic_rows(b.query_responses[mb], C)
                vpred = vpred.masked_fill(r.padding_mask_p1[mb], 0.0)
                vf_loss, vf_stats = algo.value_loss(
                    vpred, r.values[mb], r.returns[mb], r.value_mask[mb], cliprange_value=c.cliprange_value
                )
                self._optimizer_step("critic", self.critic, self.critic_opt, c.vf_coef * vf_loss)
                _append(
                    stats,
                    {
                        "loss/value": vf_loss.item(),
                        "val/clipfrac": vf_stats["clipfrac"].item(),
                        "val/vpred": vf_stats["vpred"].item(),
                    },
                )
        return stats

    def _group(self, b: RolloutBatch) -> dict[str, float]:
        """GRPO / RLOO / REINFORCE++: advantages from each prompt's group of samples, no critic.

        The math, masks and advantages included, is ``rlhf.algo.critic_free`` (TRL's GRPOTrainer / RLOOTrainer,
        OpenRLHF's REINFORCE++); here only the model passes: the on-policy old log-probs and the minibatch updates
        over epochs (TRL's ``num_iterations``).
        """
        cfg, a, alg, C = self.cfg, self.cfg.actor, self.cfg.algorithm, b.context_length
        estimator = cfg.critic_free_estimator
        trl_rloo = estimator == "rloo" and alg.rloo_convention == "trl"
        kl_in_loss = estimator in ("grpo", "dr_grpo")
        beta = self.kl_ctrl.value
        responses, mask, contains_eos = algo.completion_mask(
            b.responses, self.eos_id, self.pad_id, alg.mask_truncated_completions
        )
        scores = b.scores - alg.missing_eos_penalty * (~contains_eos).float()
        zero = torch.zeros((), device=responses.device)
        ref = torch.where(mask, b.ref_logprobs, zero)
        with torch.no_grad():
            old_logprobs, _ = self._actor_rows(b.query_responses, responses, C)
        # over every response token, also of the completions mask_truncated_completions keeps out of the loss
        mismatch = self._mismatch(b, old_logprobs, algo.completion_mask(b.responses, self.eos_id, self.pad_id)[1])
        old_logprobs = torch.where(mask, old_logprobs, zero)
        advantages, kl = algo.critic_free_advantages(
            estimator, scores, b.group, old_logprobs, ref, mask, rloo_convention=alg.rloo_convention,
            kl_estimator=alg.kl_penalty, beta=beta, scale_rewards=alg.scale_rewards, whiten=alg.whiten_advantages,
            gamma=alg.gamma,
        )  # fmt: skip
        behavior = self._behavior(b, old_logprobs)
        if trl_rloo:
            old_seq = algo.masked_sum(old_logprobs, mask, dim=1)
            behavior_seq = None if behavior is None else algo.masked_sum(behavior, mask, dim=1)
        B = responses.shape[0]
        n_minibatches = math.ceil(B / a.ppo_mini_batch_size)
        num_items = mask.sum() / n_minibatches  # DAPO: the rollout batch's tokens per minibatch (TRL)
        stats: dict[str, list[float]] = {}
        # how each loss_type averages, so that micro-batch losses add up to the minibatch's (TRL's accumulation)
        kind = (
            "rows"
            if trl_rloo or alg.loss_type in ("grpo", "dr_grpo")
            else "sum"
            if alg.loss_type == "dapo"
            else "tokens"
        )

        def micro_loss(mb: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
            # entropies carry a gradient only with the bonus (a loss term only then)
            new_logprobs, entropies = self._actor_rows(
                b.query_responses[mb], responses[mb], C, entropy=bool(a.entropy_coeff)
            )
            entropy_mask = None
            if alg.top_entropy_quantile < 1.0:  # the quantile of each forward pass, as TRL's
                entropy_mask = algo.top_entropy_mask(entropies, mask[mb], alg.top_entropy_quantile)
            if trl_rloo:
                pg_loss, pg_stats = algo.rloo_trl_loss(
                    new_logprobs, old_seq[mb], advantages[mb], mask[mb], epsilon=a.clip_ratio,
                    epsilon_high=a.clip_ratio_high, tis_cap=a.tis_cap,
                    behavior_sequence_logprobs=None if behavior is None else behavior_seq[mb],
                )  # fmt: skip
            else:
                pg_loss, pg_stats = algo.grpo_loss(
                    new_logprobs, old_logprobs[mb], advantages[mb], mask[mb], loss_type=alg.loss_type,
                    epsilon=a.clip_ratio, epsilon_high=a.clip_ratio_high,
                    importance_sampling_level=alg.importance_sampling_level, ref_logprobs=ref[mb],
                    beta=beta if kl_in_loss else 0.0, kl_estimator=alg.kl_penalty,
                    use_bias_correction_kl=alg.use_bias_correction_kl, entropy_mask=entropy_mask,
                    max_completion_length=cfg.max_new_tokens, num_items=num_items, dual_clip=a.dual_clip,
                    behavior_logprobs=None if behavior is None else behavior[mb], tis_cap=a.tis_cap,
                )  # fmt: skip
            kept = mask[mb] if entropy_mask is None else entropy_mask
            weight = optim.micro_weight(kind, mask[mb], mask[whole])
            loss = weight * pg_loss
            if a.entropy_coeff:
                loss = loss - a.entropy_coeff * optim.micro_weight("tokens", kept, mask[whole]) * algo.masked_mean(
                    entropies, kept
                )
            _append(
                stats,
                {
                    "loss/policy": pg_loss.item(),
                    "policy/entropy": algo.masked_mean(entropies.detach(), mask[mb]).item(),
                    **{f"policy/{k}": v.item() for k, v in pg_stats.items() if k != "policy_loss"},
                },
            )
            return loss

        epochs = (self._minibatches(B, a.ppo_mini_batch_size, a.shuffle_minibatch) for _ in range(a.ppo_epochs))
        self._actor_epochs(epochs, a.micro_batch_size, micro_loss, stats)
        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        metrics["objective/kl"] = algo.masked_sum(kl, mask, dim=1).mean().item()
        metrics["objective/scores"] = scores.mean().item()
        metrics["objective/advantages_mean"] = advantages.float().mean().item()
        metrics.update(mismatch)
        return metrics

    def _online_dpo(self, b: RolloutBatch) -> dict[str, float]:
        """Pairs within each prompt's group: the first two OK samples; chosen has the higher score (ties: first).

        As TRL's OnlineDPOTrainer: log-probs of the raw logits (no division by the sampling temperature), summed over
        each completion through its EOS.
        """
        cfg, C = self.cfg, b.context_length
        firsts, seconds = algo.dpo_pairs(b.group)
        if not firsts:
            raise ValueError("online DPO needs two scored samples per prompt; none in this batch")
        P = len(firsts)
        idx = torch.tensor(firsts + seconds, device=b.responses.device)  # block layout [p0..pB-1, p0..pB-1]
        responses = algo.truncate_at_stop(b.responses[idx], self.eos_id, self.pad_id)
        mask = responses != self.pad_id
        contains_eos = (responses == self.eos_id).any(1)
        scores = b.scores[idx] - cfg.algorithm.missing_eos_penalty * (~contains_eos).float()
        chosen, rejected = algo.select_chosen_rejected(scores, P)
        ref_logprobs = b.ref_logprobs[idx]
        ref_sums = algo.masked_sum(ref_logprobs, mask, dim=1)
        T = cfg.logprob_temperature  # 1.0: TRL's online DPO never divides by the sampling temperature
        a = cfg.actor
        stats: dict[str, list[float]] = {}
        # No separate old pass here: the first minibatch's forwards run before any optimizer step, so its rows'
        # mismatch costs nothing. Comparable with the sampling log-probs only at the sampling temperature (1.0).
        first: list[torch.Tensor] = []
        measured: list[tuple[torch.Tensor, torch.Tensor]] = []

        def micro_loss(pairs: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
            # rows of these pairs' chosen and rejected answers; the DPO loss is a mean over pairs
            rows = torch.cat([chosen[pairs], rejected[pairs]])
            logprobs, entropies = self._actor_rows(
                b.query_responses[idx[rows]], responses[rows], C, temperature=T, entropy=bool(a.entropy_coeff)
            )
            if not first:
                first.append(whole)
            if whole is first[0] and self.temperature == T:
                measured.append((rows, logprobs.detach()))
            sums = algo.masked_sum(logprobs, mask[rows], dim=1)
            n = len(pairs)
            loss, dpo_stats = algo.dpo_loss(
                sums[:n], sums[n:], ref_sums[chosen[pairs]], ref_sums[rejected[pairs]],
                beta=cfg.algorithm.dpo_beta, loss_type=cfg.algorithm.dpo_loss_type,
            )  # fmt: skip
            total = optim.micro_weight("rows", pairs, whole) * loss
            entropy = algo.masked_mean(entropies, mask[rows])
            if a.entropy_coeff:  # the seeds' entropy bonus, a token mean over both answers of the minibatch's pairs
                whole_rows = torch.cat([chosen[whole], rejected[whole]])
                total = total - a.entropy_coeff * optim.micro_weight("tokens", mask[rows], mask[whole_rows]) * entropy
            kl = algo.masked_sum(logprobs.detach() - ref_logprobs[rows], mask[rows], dim=1).mean()
            _append(stats, {"loss/dpo": loss.item(), "policy/entropy": entropy.item(), "objective/kl": kl.item(),
                            **{k: v.item() for k, v in dpo_stats.items()}})  # fmt: skip
            return total

        # ppo_mini_batch_size and micro_batch_size count samples: a pair is two
        pairs_per_step = max(1, a.ppo_mini_batch_size // 2)
        micro_pairs = None if a.micro_batch_size is None else max(1, a.micro_batch_size // 2)
        dev = b.responses.device
        epochs = ((mb.to(dev) for mb in self._minibatches(P, pairs_per_step, a.shuffle_minibatch))
                  for _ in range(a.ppo_epochs))  # fmt: skip
        self._actor_epochs(epochs, micro_pairs, micro_loss, stats)
        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        metrics["objective/scores_margin"] = (scores[chosen] - scores[rejected]).mean().item()
        if measured:
            rows = torch.cat([r for r, _ in measured])
            metrics.update(self._mismatch(b, torch.cat([lp for _, lp in measured]), mask[rows], idx[rows]))
        return metrics

    # ------------------------------------------------------------------ weights
    def policy_state_dict(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The actor's weights in the checkpoint layout (:mod:`rlhf.layout`: Hugging Face names and shapes as
        ``save_pretrained`` writes them, a tie's alias left out, fused tensors split back), contiguous, on the CPU:
        what weight sync ships (it refuses non-finite tensors). With ``training.bf16`` the fp32 master weights are
        cast to bf16 here, and only here: rollout serves bf16 and the transfer is half the bytes. On the CPU in fp32
        these are the training weights' own memory, which the next step changes: copy them before it (the
        trainer's push: copy_weights).

        ``on_device`` (one process only; a group gathers to the CPU one tensor at a time) leaves them on the
        training device, for a caller that copies them into host buffers itself: copy_weights then moves each
        tensor once, device to bucket, instead of to pageable host memory and again into the bucket."""
        if self.group is not None:
            with self._command_lock:
                dist.broadcast_ints([_GATHER], 1, self.device)
                return dict(self._gathered_policy(keep=True))
        if self.cfg.actor.lora_r:
            from rlhf.lora import merged_state_dict

            weights = merged_state_dict(self.actor)
        else:
            weights = self.actor.state_dict()
        out = {}
        for k, v in self.policy_layout.items(weights):
            out[k] = self._push_tensor(v, on_device)
        return out

    @functools.cached_property
    def policy_layout(self):
        """Which live tensor of the actor becomes which checkpoint tensor (worked out once, on meta tensors)."""
        from rlhf.layout import CheckpointLayout

        live = self.actor.state_dict()
        if self.cfg.actor.lora_r:  # the merged weights carry the base model's names
            live = {k.replace(".base_layer.", "."): v for k, v in live.items() if ".lora_" not in k}
        return CheckpointLayout(self.actor, live)

    def _push_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.bfloat16 if self.cfg.training.bf16 and dtype.is_floating_point else dtype

    def _push_tensor(self, v: torch.Tensor, on_device: bool = False) -> torch.Tensor:
        v = v.detach().to(self._push_dtype(v.detach().dtype))
        return (v if on_device else v.to("cpu")).contiguous()

    def policy_stream(self, version: int, bucket_bytes: int | None = None) -> StreamedWeights:
        """Rank 0 of a group: the policy (as :meth:`policy_state_dict` gives it) as streamed weights, for a push that
        gathers it bucket by bucket and never holds the whole model (``push_weights_streamed``). The plan comes
        from the shards' metadata (a DTensor's shape is the global one); each of the stream's two passes is one
        gather command to the group. The weights must not change between the passes: the caller holds off steps,
        so in a group training waits for the push."""
        # Imported here: rlhf.transport brings Redis, which the engine (and the TRL parity environment) does not need.
        from rlhf.transport.weights.format import DEFAULT_BUCKET_BYTES, StreamedWeights

        if self.group is None or not self.group.is_driver:
            raise RuntimeError("policy_stream() is for rank 0 of a trainer group; at world size 1 pack the state dict")
        bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        specs = self.policy_layout.specs(self._push_dtype)
        return StreamedWeights(specs, self._policy_pass, version, version - 1, bucket_bytes=bucket_bytes)

    def _policy_pass(self):
        """One gather of the whole policy, tensor by tensor: the command goes to the followers, which gather every
        parameter with rank 0. Closed early (a push that stopped), rank 0 still gathers the rest, or the followers
        would wait in a collective that never comes. The command lock is held for the pass, in the thread that runs
        it, so no other command can come between its gathers."""
        with self._command_lock:
            dist.broadcast_ints([_GATHER], 1, self.device)
            gathered = self._gathered_policy(keep=True)
            try:
                for item in gathered:  # not ``yield from``: that would close ``gathered`` undrained on close()
                    yield item
                    del item  # the tensor goes before the next gather, not after it
            finally:
                for _ in gathered:
                    pass

    def _gathered_policy(self, keep: bool):
        """(name, full tensor) of the sharded actor in the checkpoint layout, gathered one parameter at a time on
        every rank (the gather is a collective); ranks that do not ``keep`` drop each tensor at once, so their extra
        memory is one tensor. A tie's alias is gathered like any parameter (every rank runs the same collectives)
        and yields nothing."""
        layout = self.policy_layout if keep else None
        for k, v in self.actor.state_dict().items():
            v = dist.full_value(v.detach())
            if not keep:
                yield k, None
                continue
            parts = layout.convert(k, v)
            del v  # the gathered full-precision tensor goes before its cast copies are yielded
            while parts:
                name, part = parts.pop(0)
                out = self._push_tensor(part)
                del part
                yield name, out


def _refuse_in_group(cfg: ExperimentConfig) -> None:
    """Options built for one trainer process only: refused in a torchrun group rather than silently wrong (each
    would run the same extra pass on every rank, or hold an unsharded model beside the sharded ones)."""
    one_process = {
        "actor_rollout.lora_r": cfg.actor.lora_r,
        "algorithm.kl_penalty: full": cfg.algorithm.kl_penalty == "full",
        "actor_rollout.ptx_coef": cfg.actor.ptx_coef > 0,
        "critic.save": cfg.critic.save is not None,
    }
    used = [k for k, v in one_process.items() if v]
    if used:
        raise ValueError(f"{', '.join(used)}: built for a one-process trainer; run without torchrun (or "
                         "--trainer-procs 1), or turn these off")  # fmt: skip


_NOOP, _STEP, _GATHER, _STOP, _SAVE, _LOAD = 0, 1, 2, 3, 4, 5
_BATCH_FIELDS = (
    "query_responses", "sampling_logprobs", "ref_logprobs", "scores", "group", "policy_versions",
    "has_sampling_logprobs",
)  # fmt: skip


def _with_rest(n: int, first: torch.Tensor, held: torch.Tensor, forward) -> torch.Tensor:
    """(n, ...) rows: ``held`` at the rows ``first``, ``forward(rows)`` without gradient at the others."""
    out = held.new_empty((n, *held.shape[1:]))
    out[first] = held
    mask = torch.ones(n, dtype=torch.bool)
    mask[first] = False
    rest = mask.nonzero().squeeze(1)
    if len(rest):
        with torch.no_grad():
            out[rest] = forward(rest)
    return out


def _batch_tensors(b: RolloutBatch) -> list[torch.Tensor]:
    return [getattr(b, name) for name in _BATCH_FIELDS]


def _adamw(model: torch.nn.Module, role: optim.RoleOptim, fused: bool) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only
    return torch.optim.AdamW(params, lr=role.lr, betas=role.betas, weight_decay=role.weight_decay, fused=fused)


class _PtxData:
    """PPO-ptx texts (data.pretrain_data), tokenized once, served in a fixed cycling order: a batch is a (rows, T)
    tensor right-padded with the pad id."""

    def __init__(self, cfg: ExperimentConfig, tokenizer):
        from rlhf.data import load_texts

        self.pad_id = tokenizer.pad_token_id
        limit = cfg.training.seq_length
        self.rows = [tokenizer(t, add_special_tokens=True)["input_ids"][:limit] for t in load_texts(cfg.data)]
        self.rows = [r for r in self.rows if len(r) >= 2]
        if not self.rows:
            raise ValueError(f"data.pretrain_data {cfg.data.pretrain_data}: no text of two tokens or more")
        self.offset = 0

    def next_batch(self, n: int) -> torch.Tensor:
        picked = [self.rows[(self.offset + i) % len(self.rows)] for i in range(n)]
        self.offset = (self.offset + n) % len(self.rows)
        out = torch.full((n, max(len(r) for r in picked)), self.pad_id, dtype=torch.long)
        for i, r in enumerate(picked):
            out[i, : len(r)] = torch.tensor(r)
        return out


def _first_model_scorer(cfg: ExperimentConfig) -> str | None:
    return next((s.load for s in cfg.reward.scorers if s.type == "model"), None)


def _disable_dropout(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def _clip(model: torch.nn.Module, max_norm: float) -> float:
    if max_norm and max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    else:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if grads and hasattr(grads[0], "full_tensor"):  # sharded (FSDP2): the norm over every rank's shards
            norm = torch.nn.utils.get_total_norm(grads)
        else:
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    value = float(dist.full_value(norm))
    return value if math.isfinite(value) else float("nan")


class _Done:
    """An already computed result with a future's ``result()``: the sequential path of :meth:`TrainerEngine._ppo`."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _append(acc: dict[str, list[float]], values: dict[str, float]) -> None:
    for k, v in values.items():
        acc.setdefault(k, []).append(float(v))
