"""The trainer's update step: the actor, the critic (PPO), their optimizers and forward passes, and the three
training stages.

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
samples the current weights made (:meth:`TrainerState.same_weights`), which the trainer's loop checks against
``training.max_mismatch_kl``.

Around it, each in its own module: records to tensors (``batch``), the models as loaded (``models``), the step
count, policy version and KL coefficient (``state``), rank 0's commands to a torchrun group (``group``) and the
weights as they leave the trainer (``export``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlhf import algo
from rlhf import distributed as dist
from rlhf.config import ExperimentConfig
from rlhf.models import causal_lm_logits, load_tokenizer, resolve_device, resolve_model_path, score_head_outputs
from rlhf.v1 import experience_pb2
from services.trainer import checkpoint, models, optim
from services.trainer.batch import RolloutBatch, collate, episode_stats, mismatch_by_replica, score_stats
from services.trainer.export import PolicyExport
from services.trainer.group import LOAD, NOOP, SAVE, STEP, STOP, Commands
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
            from rlhf.distill import check_teacher_tokenizer

            student = cfg.training.tokenizer_name_or_path or cfg.actor.load
            check_teacher_tokenizer(student, cfg.actor_rollout_ref.ref.load, self.tokenizer)
        self.actor = models.load_actor(cfg, actor_path, self.device, self.group)
        t = cfg.training
        # fused AdamW, TRL's default ("adamw_torch_fused"): 4-6x faster optimizer steps than the per-tensor loop (CPU)
        fused = self.device.type in ("cpu", "cuda")
        self.actor_optim = optim.actor_optim(cfg)
        self.actor_opt = optim.adamw(self.actor, self.actor_optim, fused)
        self.critic = None
        self.critic_opt = None
        self.critic_optim = optim.critic_optim(cfg)
        if self.stage == "ray_ppo":
            self.critic = models.load_critic(cfg, self.device, self.group, self.actor)
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
        from rlhf.transport.codec import check_token_ids  # here: the engine itself needs no Redis client (parity venv)

        check_token_ids(exp, self.vocab_size)

    def collate(self, experiences: list[experience_pb2.Experience]) -> RolloutBatch:
        """Rows for every sample whose score is OK, on this engine's device (:func:`batch.collate`)."""
        return collate(experiences, self.pad_id, self.device)

    # ------------------------------------------------------------------ forward helpers
    @property
    def temperature(self) -> float:
        return self.cfg.sample_temperature

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
        return self._optimizer_step("actor", self._actor_trained, self._actor_opts, losses, self.actor_optim.clip_grad)

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
    def _mismatch(self, b: RolloutBatch, logprobs: torch.Tensor, mask: torch.Tensor, rows=None) -> dict[str, float]:
        """``mismatch/*`` metrics (:func:`rlhf.algo.logprob_mismatch`): the rollout's sampling log-probs against
        ``logprobs``, the trainer's under the current weights at the sampling temperature, over the response tokens
        (``mask``) of ``rows`` (indices into the batch; default all) that the current weights sampled (the others
        differ by training, not by numerics) and that have sampling log-probs. ``kl`` and ``max_abs`` are left out
        when no token qualifies (nothing measured is not 0)."""
        rows = torch.arange(b.responses.shape[0]) if rows is None else rows.cpu()
        versions = b.policy_versions.cpu()[rows]
        dev = b.sampling_logprobs.device
        on_policy = self.state.same_weights(versions, self.state.step).to(dev) & b.has_sampling_logprobs[rows.to(dev)]
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
            metrics = self._rejection_sampling(batch)
        elif self.stage == "ray_ppo":
            metrics = self._ppo(batch)
        elif self.stage == "ray_online_dpo":
            metrics = self._online_dpo(batch)
        else:
            metrics = self._group(batch)
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

    # ------------------------------------------------------------------ the stages
    def _parallel_critic(self) -> bool:
        """Actor and critic are separate models with separate losses, so their passes can run side by side (as
        OpenRLHF and veRL run them on separate workers); the results are the same as one after the other. On a CPU
        the two sides split the intra-op threads (:meth:`_side_threads`), so it needs two of them."""
        if self.group is not None or self.shared_value:  # collectives could interleave; or one model, one backward
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
            actor_mbs = [
                list(self._minibatches(B, a.ppo_mini_batch_size, a.shuffle_minibatch)) for _ in range(a.ppo_epochs)
            ]
            critic_mbs = [
                list(self._minibatches(B, c.critic_mini_batch_size, a.shuffle_minibatch))
                for _ in range(0 if self.shared_value else c.critic_update_epochs)  # shared: the actor's minibatches
            ]
            # OpenRLHF's freezing_actor_steps: the critic learns values of a fixed policy before the actor moves
            frozen = self.state.step < a.freezing_actor_steps
            first_a = first_c = None  # the rows whose old pass is their first update's forward (see __init__)
            if self.reuse_first_pass and self.group is None and self.ref_model is None:
                if not frozen and actor_mbs:
                    first_a = next(optim.micro_batches(actor_mbs[0][0], a.micro_batch_size))
                first_c = next(optim.micro_batches(critic_mbs[0][0], c.micro_batch_size)) if critic_mbs else None
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
            episodes = _has_episodes(b)
            rollout = (
                functools.partial(algo.ppo_episode_rollout, b.responses, b.loss_mask, b.episode_done)
                if episodes
                else functools.partial(algo.ppo_rollout, b.responses, stop_token_id=self.eos_id)
            )
            r = rollout(
                old_logprobs,
                b.ref_logprobs,
                values,
                b.scores,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                kl_coef=self.state.kl_coef,
                kl_estimator=cfg.algorithm.kl_penalty,
                gamma=cfg.algorithm.gamma,
                lam=cfg.algorithm.lam,
                missing_eos_penalty=cfg.algorithm.missing_eos_penalty or None,
                whiten_rewards=cfg.algorithm.whiten_rewards,
                whiten_advantages=cfg.algorithm.whiten_advantages,
                score_position=cfg.algorithm.score_position,
                kl=full_kl,
                group=b.group,
                reward_baseline=cfg.algorithm.reward_baseline,
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
        self.state.update_kl(mean_kl, B)
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
        these weights by the old pass (:meth:`_old_logprobs`). With ``critic.shared_backbone`` each micro-batch's
        loss also holds its value loss (TRL's ``pg_loss + vf_coef * vf_loss``), from the value head on the same
        backbone."""
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
            _append(
                stats,
                {
                    "loss/policy": pg_loss.item(),
                    "policy/entropy": entropy.item(),
                    **{f"policy/{k}": v.item() for k, v in pg_stats.items()},
                },
            )
            if self.shared_value:
                return weight * loss + self._value_micro_loss(b, r, mu, mb, stats)
            return weight * loss

        self._actor_epochs(minibatches, a.micro_batch_size, micro_loss, stats)
        return stats

    def _critic_updates(self, b: RolloutBatch, r, minibatches: list[list[torch.Tensor]], held=None):
        """The critic's epochs: each minibatch is one optimizer step over the weighted value losses of its
        micro-batches (``critic.micro_batch_size``), gradients accumulating. ``held``: the first micro-batch's values,
        already computed (with their graph) at these weights by the old pass (:meth:`_old_values`)."""
        c = self.cfg.critic
        stats: dict[str, list[float]] = {}
        held = [held] if held is not None else []

        def micro_loss(mu: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
            return self._value_micro_loss(b, r, mu, mb, stats, held.pop() if held else None)

        for epoch in minibatches:
            for mb in epoch:
                losses = (micro_loss(mu, mb) for mu in optim.micro_batches(mb, c.micro_batch_size))
                self._optimizer_step("critic", self.critic, self.critic_opt, losses, self.critic_optim.clip_grad)
        return stats

    def _value_micro_loss(self, b: RolloutBatch, r, mu, mb, stats, vpred: torch.Tensor | None = None) -> torch.Tensor:
        """``vf_coef`` x the clipped value loss of micro-batch ``mu`` of minibatch ``mb``, weighted by its share of
        the minibatch's value tokens (the loss is a token mean over value_mask). ``vpred``: its values, when held."""
        c = self.cfg.critic
        if vpred is None:
            vpred = self._critic_rows(b.query_responses[mu], b.context_length)
        vpred = vpred.masked_fill(r.padding_mask_p1[mu], 0.0)
        vf_loss, vf_stats = algo.value_loss(
            vpred, r.values[mu], r.returns[mu], r.value_mask[mu], cliprange_value=c.cliprange_value
        )
        _append(
            stats,
            {
                "loss/value": vf_loss.item(),
                "val/clipfrac": vf_stats["clipfrac"].item(),
                "val/vpred": vf_stats["vpred"].item(),
            },
        )
        return optim.micro_weight("tokens", r.value_mask[mu], r.value_mask[mb]) * c.vf_coef * vf_loss

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
        beta = self.state.kl_coef
        if _has_episodes(b):
            responses, mask, contains_eos = algo.episode_completion_mask(
                b.responses, b.loss_mask, b.episodes, b.episode_done, self.eos_id, self.pad_id
            )
            every_token = mask  # an episode's tokens to compare with the sampler's: the model's own
            if alg.mask_truncated_completions:
                mask = mask & contains_eos[:, None]
        else:
            responses, mask, contains_eos = algo.completion_mask(
                b.responses, self.eos_id, self.pad_id, alg.mask_truncated_completions
            )
            every_token = None
        scores = algo.penalize_missing_eos(b.scores, contains_eos, alg.missing_eos_penalty)
        zero = torch.zeros((), device=responses.device)
        ref = torch.where(mask, b.ref_logprobs, zero)
        with torch.no_grad():
            old_logprobs, _ = self._actor_rows(b.query_responses, responses, C)
        # over every response token, also of the completions mask_truncated_completions keeps out of the loss
        if every_token is None:
            every_token = algo.completion_mask(b.responses, self.eos_id, self.pad_id)[1]
        mismatch = self._mismatch(b, old_logprobs, every_token)
        old_logprobs = torch.where(mask, old_logprobs, zero)
        advantages, kl = algo.critic_free_advantages(
            estimator,
            scores,
            b.group,
            old_logprobs,
            ref,
            mask,
            rloo_convention=alg.rloo_convention,
            kl_estimator=alg.kl_penalty,
            beta=beta,
            scale_rewards=alg.scale_rewards,
            whiten=alg.whiten_advantages,
            gamma=alg.gamma,
        )
        distill = alg.distill
        if distill.coef > 0:  # the reference log-probs are the teacher's (config: kl_coef 0, ref.load the teacher)
            advantages, reverse_kl = algo.distill_advantages(
                old_logprobs,
                ref,
                mask,
                coef=distill.coef,
                task_advantages=advantages,
                reward_coef=distill.reward_coef,
            )
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
                    new_logprobs,
                    old_seq[mb],
                    advantages[mb],
                    mask[mb],
                    epsilon=a.clip_ratio,
                    epsilon_high=a.clip_ratio_high,
                    tis_cap=a.tis_cap,
                    behavior_sequence_logprobs=None if behavior is None else behavior_seq[mb],
                )
            else:
                pg_loss, pg_stats = algo.grpo_loss(
                    new_logprobs,
                    old_logprobs[mb],
                    advantages[mb],
                    mask[mb],
                    loss_type=alg.loss_type,
                    epsilon=a.clip_ratio,
                    epsilon_high=a.clip_ratio_high,
                    importance_sampling_level=alg.importance_sampling_level,
                    ref_logprobs=ref[mb],
                    beta=beta if kl_in_loss else 0.0,
                    kl_estimator=alg.kl_penalty,
                    use_bias_correction_kl=alg.use_bias_correction_kl,
                    entropy_mask=entropy_mask,
                    max_completion_length=cfg.max_new_tokens,
                    num_items=num_items,
                    dual_clip=a.dual_clip,
                    behavior_logprobs=None if behavior is None else behavior[mb],
                    tis_cap=a.tis_cap,
                )
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
        if distill.coef > 0:  # the estimator of KL(student || teacher) per sampled token, before this step's update
            metrics["distill/reverse_kl"] = algo.masked_mean(reverse_kl, mask).item()
        metrics.update(mismatch)
        return metrics

    def _rejection_sampling(self, b: RolloutBatch) -> dict[str, float]:
        """Rejection-sampling fine-tuning (seed 002; Llama 2 alternates it with PPO): the best-scored sample of each
        prompt's group (``min_score``: if good enough), trained on by SFT: the mean negative log-likelihood of its
        response tokens (an episode's own tokens), at temperature 1, in the actor's minibatches and micro-batches."""
        a, rs, C = self.cfg.actor, self.cfg.algorithm.rejection_sampling, b.context_length
        if _has_episodes(b):
            responses, mask, _ = algo.episode_completion_mask(
                b.responses, b.loss_mask, b.episodes, b.episode_done, self.eos_id, self.pad_id
            )
        else:
            responses, mask, _ = algo.completion_mask(b.responses, self.eos_id, self.pad_id)
        keep = algo.best_of_group(b.scores, b.group, rs.min_score)
        metrics = {"rft/kept": float(len(keep)), "rft/groups": float(len(torch.unique(b.group)))}
        if not len(keep):
            log.info("step %d: rejection sampling kept no sample (min_score %s)", self.state.step + 1, rs.min_score)
            return metrics
        metrics["rft/kept_score_mean"] = b.scores[keep].mean().item()
        stats: dict[str, list[float]] = {}

        def micro_loss(mu: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
            rows, whole = keep[mu], keep[mb]
            logprobs, _ = self._actor_rows(b.query_responses[rows], responses[rows], C, temperature=1.0)
            loss = -algo.masked_mean(logprobs, mask[rows])
            _append(stats, {"loss/sft": loss.item()})
            return optim.micro_weight("tokens", mask[rows], mask[whole]) * loss

        epochs = (self._minibatches(len(keep), a.ppo_mini_batch_size, a.shuffle_minibatch) for _ in range(rs.epochs))
        self._actor_epochs(epochs, a.micro_batch_size, micro_loss, stats)
        metrics.update({k: sum(v) / len(v) for k, v in stats.items()})
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
        if _has_episodes(b):
            responses, mask, contains_eos = algo.episode_completion_mask(
                b.responses[idx], b.loss_mask[idx], b.episodes[idx], b.episode_done[idx], self.eos_id, self.pad_id
            )
        else:
            responses = algo.truncate_at_stop(b.responses[idx], self.eos_id, self.pad_id)
            mask = responses != self.pad_id
            contains_eos = (responses == self.eos_id).any(1)
        scores = algo.penalize_missing_eos(b.scores[idx], contains_eos, cfg.algorithm.missing_eos_penalty)
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
                sums[:n],
                sums[n:],
                ref_sums[chosen[pairs]],
                ref_sums[rejected[pairs]],
                beta=cfg.algorithm.dpo_beta,
                loss_type=cfg.algorithm.dpo_loss_type,
            )
            total = optim.micro_weight("rows", pairs, whole) * loss
            entropy = algo.masked_mean(entropies, mask[rows])
            if a.entropy_coeff:  # the seeds' entropy bonus, a token mean over both answers of the minibatch's pairs
                whole_rows = torch.cat([chosen[whole], rejected[whole]])
                total = total - a.entropy_coeff * optim.micro_weight("tokens", mask[rows], mask[whole_rows]) * entropy
            kl = algo.masked_sum(logprobs.detach() - ref_logprobs[rows], mask[rows], dim=1).mean()
            _append(
                stats,
                {
                    "loss/dpo": loss.item(),
                    "policy/entropy": entropy.item(),
                    "objective/kl": kl.item(),
                    **{k: v.item() for k, v in dpo_stats.items()},
                },
            )
            return total

        # ppo_mini_batch_size and micro_batch_size count samples: a pair is two
        pairs_per_step = max(1, a.ppo_mini_batch_size // 2)
        micro_pairs = None if a.micro_batch_size is None else max(1, a.micro_batch_size // 2)
        dev = b.responses.device
        epochs = (
            (mb.to(dev) for mb in self._minibatches(P, pairs_per_step, a.shuffle_minibatch))
            for _ in range(a.ppo_epochs)
        )
        self._actor_epochs(epochs, micro_pairs, micro_loss, stats)
        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        metrics["objective/scores_margin"] = (scores[chosen] - scores[rejected]).mean().item()
        if measured:
            rows = torch.cat([r for r, _ in measured])
            metrics.update(self._mismatch(b, torch.cat([lp for _, lp in measured]), mask[rows], idx[rows]))
        return metrics

    # ------------------------------------------------------------------ weights
    def policy_state_dict(self, on_device: bool = False) -> dict[str, torch.Tensor]:
        """The actor's weights in the checkpoint layout, as weight sync ships them (:meth:`PolicyExport.state_dict`)."""
        return self.export.state_dict(on_device)

    def policy_stream(self, version: int, bucket_bytes: int | None = None) -> StreamedWeights:
        """Rank 0 of a group: the policy streamed bucket by bucket (:meth:`PolicyExport.stream`)."""
        return self.export.stream(version, bucket_bytes)


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


class _Done:
    """An already computed result with a future's ``result()``: the sequential path of :meth:`TrainerEngine._ppo`."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _has_episodes(b: RolloutBatch) -> bool:
    """Whether a batch holds multi-turn episodes: then the stages train on each row's loss mask (the model's own
    tokens) instead of "every token through the first EOS", which would cut an episode after its first turn."""
    return b.episodes is not None and bool(b.episodes.any())


def _append(acc: dict[str, list[float]], values: dict[str, float]) -> None:
    for k, v in values.items():
        acc.setdefault(k, []).append(float(v))
