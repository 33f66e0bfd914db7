"""The trainer's update step: the actor, the critic (PPO), their optimizers and forward passes, and the training stages.

``TrainerEngine.step(experiences)`` turns experience records into one policy update with the algorithm named by
``training.stage`` (``ray_ppo``, ``ray_grpo`` / ``ray_rloo`` / ``ray_reinforce_plus_plus``, ``ray_online_dpo``),
and measures the trainer-inference mismatch (``mismatch/*``) where it has the current weights' log-probs anyway.
It holds its stage (``ppo``, ``critic_free``), built with the engine as a ``passes.TrainerPasses``; around this
class: ``batch``, ``models``, ``state``, ``group`` and ``export``.

Design: docs/training.md#algorithms; where each method lives: docs/code-tour.md#where-a-method-lives.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlhf import algo
from rlhf import distributed as dist
from rlhf.config import ExperimentConfig
from rlhf.distill import check_teacher_tokenizer
from rlhf.models import causal_lm_logits, load_tokenizer, resolve_device, resolve_model_path, score_head_outputs
from rlhf.v1 import experience_pb2
from services.trainer import checkpoint, models, optim
from services.trainer.batch import RolloutBatch, collate, episode_stats, mismatch_by_replica, score_stats
from services.trainer.critic_free import CriticFreeStages
from services.trainer.export import PolicyExport
from services.trainer.group import LOAD, NOOP, SAVE, STEP, STOP, Commands
from services.trainer.optim import append_stats
from services.trainer.ppo import PPOStage
from services.trainer.state import TrainerState

if TYPE_CHECKING:
    from rlhf.transport.weights.pack import StreamedWeights

log = logging.getLogger("rlhf.trainer")


class TrainerEngine:
    def __init__(self, cfg: ExperimentConfig, device: str | None = None):
        self.cfg = cfg
        self.stage = cfg.training.stage
        self.device = resolve_device(device or cfg.training.device)
        # None at world size 1: no process group, and every method below runs its single-process code unchanged.
        self.group = dist.init_from_env(self.device, cfg.training.collective_timeout_s)
        if self.group is not None:
            models.refuse_in_group(cfg)
        torch.manual_seed(cfg.training.seed)
        actor_path = resolve_model_path(cfg.actor.load)
        self.tokenizer = load_tokenizer(cfg.training.tokenizer_name_or_path or actor_path)
        self.pad_id, self.eos_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        if cfg.algorithm.distill.coef > 0:  # the teacher scores these token ids: refuse one that reads them otherwise
            student = cfg.training.tokenizer_name_or_path or cfg.actor.load
            check_teacher_tokenizer(student, cfg.actor_rollout_ref.ref.load, self.tokenizer)
        self.actor = models.load_actor(cfg, actor_path, self.device, self.group)
        t = cfg.training
        # fused AdamW, TRL's default ("adamw_torch_fused"): faster than the per-tensor loop (docs/training.md,
        # "Precision, packing and devices")
        fused = self.device.type in ("cpu", "cuda")
        self.actor_optim = optim.actor_optim(cfg)
        self.actor_opt = optim.adamw(self.actor, self.actor_optim, fused)
        self.critic = None
        self.critic_opt = None
        self.critic_optim = optim.critic_optim(cfg)
        self.critic_device = self.device
        if self.stage.traits.critic:
            self.critic_device = models.critic_device(cfg, self.device, self.group)
            self.critic = models.load_critic(cfg, self.critic_device, self.group, self.actor)
            self.critic_opt = optim.adamw(self.critic, self.critic_optim, fused)
        # critic.shared_backbone: the value head is on the actor, and its loss joins the actor's backward, which
        # steps both (models.ValueHeadOnActor); the gradient norm and its clip cover both
        self.shared_value = self.critic is not None and cfg.critic.shared_backbone
        if self.shared_value:
            self._actor_trained = torch.nn.ModuleList([self.actor, self.critic])
            self._actor_opts = optim.Joint(self.actor_opt, self.critic_opt)
        else:
            self._actor_trained, self._actor_opts = self.actor, self.actor_opt
        self.ref_model = models.load_reference(cfg, self.device) if cfg.algorithm.kl_penalty == "full" else None
        # reward normalisation: running statistics of every score seen (checkpointed with the optimizers)
        self.reward_moments = algo.RunningMoments() if cfg.algorithm.normalize_reward else None
        # or fixed statistics (algorithm.reward_norm_stats: given, or the reward model's config.json); exclusive
        self.reward_stats = models.fixed_reward_stats(cfg)
        self.ptx = models.PtxData(cfg, self.tokenizer) if cfg.actor.ptx_coef > 0 else None
        self.state = TrainerState.from_config(cfg)  # step, policy version, version segments, KL coefficient
        self.generator = torch.Generator().manual_seed(t.seed)
        # PPO: the first minibatch of the first epoch trains at the weights the old log-probs and values are taken
        # at, so its forward pass (with gradient) gives those rows' old values and the old pass covers only the
        # other rows: half an actor and half a critic forward less per step with 2 minibatches (the same values
        # within float32 rounding; TRL likewise takes old log-probs from a pass it already ran, the generation's).
        # False: the old pass over every row (tests and bench.pipeline compare the two).
        self.reuse_first_pass = True
        # Optimizer steps skipped for a non-finite loss or gradient, this step and in all (the critic's thread too).
        self._skipped_lock = threading.Lock()
        self.skipped_updates = 0
        self._skipped_this_step = 0
        # The last step's trainer-inference mismatch by the replica that made the samples: replica id -> (mean k3,
        # tokens, versions), for the trainer's message when the mismatch check stops a run. _mismatch_rows: the
        # stage's per-row part of it (batch rows' records, versions, k3 sums, tokens), or None.
        self.mismatch_by_replica: dict[str, tuple[float, int, list[int]]] = {}
        self._mismatch_rows: tuple[torch.Tensor, ...] | None = None
        self.commands = Commands(self.device)  # a group's: rank 0 leads, the other ranks follow
        self.export = PolicyExport(cfg, self.actor, self.group, self.commands)
        # The stages: each is handed this engine as its TrainerPasses. Rejection sampling can interleave with any
        # stage, so the critic-free one is always there; PPO's only with a critic (ray_ppo).
        self.critic_free = CriticFreeStages(self)
        self.ppo = PPOStage(self) if self.stage.traits.critic else None

    # ------------------------------------------------------------------ the state, read
    # Assignable for tests that stage a trainer's history; the trainer itself moves them only through TrainerState.
    @property
    def step_count(self) -> int:
        return self.state.step

    @property
    def policy_version(self) -> int:
        return self.state.policy_version

    @property
    def version_segments(self) -> list[tuple[int, int]]:
        return self.state.version_segments

    def steps_behind(self, versions: torch.Tensor, step: int) -> torch.Tensor:
        return self.state.steps_behind(versions, step)

    def same_weights(self, versions: torch.Tensor, step: int) -> torch.Tensor:
        return self.state.same_weights(versions, step)

    # ------------------------------------------------------------------ records
    @property
    def vocab_size(self) -> int:
        """Token ids a record may carry: rows of the input embedding that the output head also scores."""
        rows = self.actor.get_input_embeddings().num_embeddings
        head = self.actor.get_output_embeddings()
        return min(rows, head.out_features) if head is not None else rows

    def check_record(self, exp: experience_pb2.Experience) -> None:
        """Raise MalformedRecord when ``exp`` cannot be trained on by this model (token ids outside the vocabulary).
        The stream checked everything that needs no model; this is what only the trainer can check."""
        from rlhf.transport.codec import check_token_ids  # noqa: PLC0415 - rlhf.transport needs Redis; the engine (parity venv) does not

        check_token_ids(exp, self.vocab_size)

    def collate(self, experiences: list[experience_pb2.Experience]) -> RolloutBatch:
        """Rows for every sample whose score is OK, on this engine's device (:func:`batch.collate`)."""
        return collate(experiences, self.pad_id, self.device)

    # ------------------------------------------------------------------ forward helpers
    @property
    def temperature(self) -> float:
        return self.cfg.sample_temperature

    def _autocast(self, bf16: bool | None = None, device: torch.device | None = None):
        """bf16 compute over the fp32 weights when the role's ``bf16`` is on (``bf16``; default the actor's, on
        ``device``, default the actor's). Autocast state is per thread, so each forward enters it where it runs (the
        critic's passes run on their own thread)."""
        if not (self.cfg.actor.bf16 if bf16 is None else bf16):
            return contextlib.nullcontext()
        return torch.autocast((device or self.device).type, dtype=torch.bfloat16)

    def logits_and_logprobs(
        self, qr: torch.Tensor, responses: torch.Tensor, context_length: int, temperature: float | None = None
    ):
        """Response logits and log-probs at ``temperature`` (default the sampling temperature; online DPO uses 1)."""
        with self._autocast():
            logits = causal_lm_logits(self.actor, qr, self.pad_id, self.cfg.training.padding_free)[
                :, context_length - 1 : -1
            ]
        temperature = self.temperature if temperature is None else temperature
        return logits, algo.logprobs_from_logits(logits, responses, temperature)

    def actor_rows(
        self, qr, responses, context_length: int, temperature: float | None = None, entropy: bool | None = None
    ):
        """Log-probs of the rows and, with ``entropy`` set (True: with gradient), their per-token entropies. In a
        group each rank runs the actor on its share of the rows and the results are gathered (distributed.py)."""
        if self.group is None:
            logits, logprobs = self.logits_and_logprobs(qr, responses, context_length, temperature)
            return logprobs, self.entropies(logits, entropy, temperature)
        n, rows = qr.shape[0], dist.local_rows(qr.shape[0], self.group)
        logits, logprobs = self.logits_and_logprobs(qr[rows], responses[rows], context_length, temperature)
        entropies = self.entropies(logits, entropy, temperature)
        logprobs = dist.gather_rows(logprobs, n, self.group)
        return logprobs, None if entropies is None else dist.gather_rows(entropies, n, self.group)

    def entropies(self, logits: torch.Tensor, entropy: bool | None, temperature: float | None = None):
        if entropy is None:
            return None
        with torch.set_grad_enabled(entropy and torch.is_grad_enabled()):
            return algo.entropy_from_logits(logits, self.temperature if temperature is None else temperature)

    def critic_rows(self, qr: torch.Tensor, context_length: int) -> torch.Tensor:
        if self.group is None:
            return self._values(qr, context_length)
        n = qr.shape[0]
        return dist.gather_rows(self._values(qr[dist.local_rows(n, self.group)], context_length), n, self.group)

    def _values(self, qr: torch.Tensor, context_length: int) -> torch.Tensor:
        # resource_pool.critic [1]: the critic runs on its own device; its values (and their gradient) come back to
        # the actor's, where the losses are taken
        with self._autocast(self.cfg.critic.bf16, self.critic_device):
            values = score_head_outputs(
                self.critic, qr.to(self.critic_device), self.pad_id, self.cfg.training.padding_free
            )[:, context_length - 1 : -1]
        return values.float().to(self.device)

    def reference_logits(self, qr: torch.Tensor, context_length: int) -> torch.Tensor:
        with self._autocast(self.cfg.actor_rollout_ref.ref.bf16):
            return causal_lm_logits(self.ref_model, qr, self.pad_id)[:, context_length - 1 : -1]

    def behavior(self, b: RolloutBatch, old_logprobs: torch.Tensor) -> torch.Tensor | None:
        """Sampling log-probs for truncated importance sampling; rows without them count as on-policy."""
        if not self.cfg.actor.tis_cap:
            return None
        return torch.where(b.has_sampling_logprobs[:, None], b.sampling_logprobs, old_logprobs)

    def minibatches(self, n: int, size: int, shuffle: bool):
        order = torch.randperm(n, generator=self.generator) if shuffle else torch.arange(n)
        for start in range(0, n, size):
            yield order[start : start + size]

    def actor_epochs(self, epochs, micro_size: int | None, micro_loss, stats: dict[str, list[float]]) -> None:
        """The actor's minibatch loop, one for every stage: each minibatch of each epoch is one optimizer step over
        the weighted losses of its micro-batches (``micro_loss(micro_rows, minibatch_rows)``), gradients
        accumulating. ``epochs`` yields each epoch's minibatches (row index tensors), drawn lazily in that order."""
        for epoch in epochs:
            for mb in epoch:
                losses = (micro_loss(mu, mb) for mu in optim.micro_batches(mb, micro_size))
                append_stats(stats, {"policy/grad_norm": self._actor_step(losses)})

    def _actor_step(self, losses) -> float:
        """One actor optimizer step over ``losses``: one loss tensor, or an iterable of weighted micro-batch losses
        whose gradients accumulate (each is built and freed in turn), plus the PPO-ptx SFT term when configured."""
        losses = [losses] if isinstance(losses, torch.Tensor) else losses
        if self.ptx is not None:
            losses = itertools.chain(losses, [self._ptx_loss()])
        return self._optimizer_step("actor", self._actor_trained, self._actor_opts, losses, self.actor_optim.clip_grad)

    def critic_step(self, losses) -> float:
        """One critic optimizer step over ``losses`` (:meth:`_optimizer_step`), at the critic's own clip."""
        return self._optimizer_step("critic", self.critic, self.critic_opt, losses, self.critic_optim.clip_grad)

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
            norm = optim.clip(model, self.cfg.training.clip_grad if clip_grad is None else clip_grad)
            if math.isfinite(norm):
                opt.step()
                return norm
        opt.zero_grad(set_to_none=True)
        with self._skipped_lock:
            self.skipped_updates += 1
            self._skipped_this_step += 1
        log.warning("step %d: %s update skipped: non-finite loss or gradient", self.state.step + 1, role)
        return float("nan")

    # ------------------------------------------------------------------ the update
    def mismatch(self, b: RolloutBatch, logprobs: torch.Tensor, mask: torch.Tensor, rows=None) -> dict[str, float]:
        """``mismatch/*`` metrics (:func:`rlhf.algo.logprob_mismatch`): the rollout's sampling log-probs against
        ``logprobs``, the trainer's under the current weights at the sampling temperature, over the response tokens
        (``mask``) of ``rows`` (indices into the batch; default all) that the current weights sampled (the others
        differ by training, not by numerics; per token, from the records' version spans) and that have sampling
        log-probs. ``kl`` and ``max_abs`` are left out when no token qualifies (nothing measured is not 0)."""
        rows = torch.arange(b.responses.shape[0]) if rows is None else rows.cpu()
        versions = b.policy_versions.cpu()[rows]
        dev = b.sampling_logprobs.device
        # per token: a partial rollout's tokens sampled by the current weights count, its older ones do not
        token_versions = b.token_versions.cpu()[rows] if b.token_versions is not None else versions[:, None]
        same = self.state.same_weights(token_versions, self.state.step).to(dev)
        mask = mask.bool() & same.expand_as(mask)
        m = algo.logprob_mismatch(
            logprobs.detach(), b.sampling_logprobs[rows.to(dev)], mask, b.has_sampling_logprobs[rows.to(dev)]
        )
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
            self.logits_and_logprobs(batch.query_responses, batch.responses, batch.context_length)

    def step(self, experiences: list[experience_pb2.Experience]) -> dict[str, float]:
        t0 = time.perf_counter()
        batch = self.collate(experiences)  # in a group: before anything is sent, so a bad batch stops nowhere else
        raw_scores = batch.scores
        alg = self.cfg.algorithm
        if self.reward_moments is not None:  # rank 0's running statistics; the group gets the normalised scores
            self.reward_moments.update(raw_scores)
        norm = self.reward_moments if self.reward_moments is not None else self.reward_stats
        if norm is not None or alg.reward_clip_range is not None:
            batch.scores = algo.normalize_and_clip(raw_scores, norm, alg.reward_clip_range)
        if self.group is not None:
            with self.commands.lead(STEP, batch=batch):
                metrics = self._update(batch)
        else:
            metrics = self._update(batch)
        staleness = self.state.steps_behind(batch.policy_versions, self.state.step - 1)
        metrics.update(score_stats(experiences))
        metrics.update(episode_stats(experiences))
        metrics.update(
            {
                "step": self.state.step,
                "policy_version": self.state.policy_version,
                "samples": int(batch.responses.shape[0]),
                "reward/mean": raw_scores.mean().item(),
                "reward/std": raw_scores.std().item() if raw_scores.numel() > 1 else 0.0,
                "lr/actor": self._lr,
                "response_length/mean": (batch.responses != self.pad_id).sum(1).float().mean().item(),
                "staleness/mean": staleness.mean().item(),
                "staleness/max": staleness.max().item(),
                "kl_coef": self.state.kl_coef,
                "nonfinite/skipped_updates": float(self._skipped_this_step),
                "time/step_s": time.perf_counter() - t0,
            }
        )
        if batch.scores is not raw_scores:
            metrics["reward/normalized_mean"] = batch.scores.mean().item()
        self.mismatch_by_replica = mismatch_by_replica(experiences, self._mismatch_rows)
        if self._ptx_losses:
            metrics["loss/ptx"] = sum(self._ptx_losses) / len(self._ptx_losses)
        return metrics

    def _update(self, batch: RolloutBatch) -> dict[str, float]:
        """One update on ``batch``: on rank 0, and in a group on every other rank alike (:meth:`follow`)."""
        self._skipped_this_step = 0
        self._ptx_losses: list[float] = []
        self._mismatch_rows = None
        total = self.cfg.training.train_iters
        self._lr = optim.set_lr(self.actor_opt, self.actor_optim, self.state.step, total)
        if self.critic_opt is not None:
            optim.set_lr(self.critic_opt, self.critic_optim, self.state.step, total)
        rs = self.cfg.algorithm.rejection_sampling
        if rs.interval and self.state.step % rs.interval == 0:
            metrics = self.critic_free.rejection_sampling(batch)
        elif self.ppo is not None:
            metrics = self.ppo.update(batch)
        else:
            metrics = self.critic_free.update(batch)
        self.state.advance()
        return metrics

    # ------------------------------------------------------------------ the group: rank 0 leads, the others follow
    def follow(self) -> None:
        """Ranks other than 0: take part in what rank 0 does (steps, weight gathers, checkpoints), collective for
        collective, until it calls :meth:`stop_followers`."""
        if self.group is None or self.group.is_driver:
            raise RuntimeError("follow() is for ranks other than 0 of a trainer group")

        def gather() -> None:
            for _ in self.export.gather(keep=False):
                pass

        self.commands.follow(
            step=self._update,
            gather=gather,
            save=lambda path: checkpoint.write_sharded(path, self),
            load=lambda path: checkpoint.restore(path, self),
        )

    def save_group(self, path: Path) -> None:
        """Rank 0 (checkpoint.save_checkpoint): every rank writes its part of the checkpoint into ``path``."""
        with self.commands.lead(SAVE, path=path):
            checkpoint.write_sharded(path, self)

    def load_group(self, path: Path) -> None:
        """Rank 0 (checkpoint.load_checkpoint): every rank restores its part of the checkpoint at ``path``."""
        with self.commands.lead(LOAD, path=path):
            checkpoint.restore(path, self)

    def heartbeat(self) -> None:
        """Rank 0, idle: a no-op command, so followers waiting for the next one do not reach the collective
        timeout while the ring waits for experience."""
        if self.group is not None:
            with self.commands.lead(NOOP):
                pass

    def stop_followers(self) -> None:
        if self.group is not None and self.group.is_driver:
            with self.commands.lead(STOP):
                pass

    # ------------------------------------------------------------------ weights
    def policy_state_dict(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The actor's weights in the checkpoint layout, as weight sync ships them (:meth:`PolicyExport.state_dict`)."""
        return self.export.state_dict(on_device)

    def policy_stream(self, version: int, bucket_bytes: int | None = None) -> StreamedWeights:
        """Rank 0 of a group: the policy streamed bucket by bucket (:meth:`PolicyExport.stream`)."""
        return self.export.stream(version, bucket_bytes)
