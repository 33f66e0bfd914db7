"""The critic-free stages: :class:`CriticFreeStages`, over the engine's ``TrainerPasses``.

* ``ray_grpo`` / ``ray_rloo`` / ``ray_reinforce_plus_plus``: advantages from the ``n`` samples of each prompt (one
  experience record holds one prompt's group), the math of ``rlhf.algo.critic_free``;
* rejection sampling: supervised steps on the best-scored sample of each prompt;
* ``ray_online_dpo``: two samples per prompt, chosen/rejected by score, sigmoid or IPO loss.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from rlhf import algo
from services.trainer.batch import RolloutBatch, has_episodes
from services.trainer.optim import append_stats

if TYPE_CHECKING:
    from rlhf.config import ExperimentConfig
    from services.trainer.passes import TrainerPasses

log = logging.getLogger("rlhf.trainer")


class CriticFreeStages:
    """The critic-free stages: :meth:`update` on a batch (online DPO under ``ray_online_dpo``, else the GRPO family)
    and :meth:`rejection_sampling`. The models, optimizers and their passes are ``passes``'s (the trainer engine's);
    this class holds no state of its own."""

    def __init__(self, passes: TrainerPasses):
        self.passes = passes

    def update(self, b: RolloutBatch) -> dict[str, float]:
        if self.passes.cfg.training.stage.traits.pairs:
            return self._online_dpo(b)
        return self._group(b)

    def _group(self, b: RolloutBatch) -> dict[str, float]:
        """GRPO / RLOO / REINFORCE++: advantages from each prompt's group of samples, no critic.

        The math, masks and advantages included, is ``rlhf.algo.critic_free`` (TRL's GRPOTrainer / RLOOTrainer,
        OpenRLHF's REINFORCE++); here only the model passes: the on-policy old log-probs and the minibatch updates
        over epochs (TRL's ``num_iterations``).
        """
        p = self.passes
        a, context_length = p.cfg.actor, b.context_length
        s = critic_free_settings(p.cfg, p.state.kl_coef)
        masks = self._masks(b, p.cfg.algorithm.mask_truncated_completions)
        with torch.no_grad():
            old_logprobs, _ = p.actor_rows(b.query_responses, masks.responses, context_length)
        # over every response token, also of the completions mask_truncated_completions keeps out of the loss
        mismatch = p.mismatch(b, old_logprobs, masks.every_token)
        t = algo.critic_free_targets(s, b.scores, b.group, old_logprobs, b.ref_logprobs, masks)
        behavior = p.behavior(b, t.old_logprobs)
        batch_size = masks.responses.shape[0]
        minibatches = math.ceil(batch_size / a.ppo_mini_batch_size)
        stats: dict[str, list[float]] = {}

        def micro_loss(mb: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
            # entropies carry a gradient only with the bonus (a loss term only then)
            logprobs, entropies = p.actor_rows(
                b.query_responses[mb], masks.responses[mb], context_length, entropy=bool(a.entropy_coeff)
            )
            loss, values = algo.critic_free_micro_loss(
                s, t, mb, whole, logprobs, entropies, minibatches=minibatches, behavior_logprobs=behavior
            )
            append_stats(stats, {k: v.item() for k, v in values.items()})
            return loss

        epochs = (p.minibatches(batch_size, a.ppo_mini_batch_size, a.shuffle_minibatch) for _ in range(a.ppo_epochs))
        p.actor_epochs(epochs, a.micro_batch_size, micro_loss, stats)
        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        metrics.update({k: v.item() for k, v in algo.critic_free_metrics(t).items()})
        metrics.update(mismatch)
        return metrics

    def _masks(self, b: RolloutBatch, mask_truncated: bool = False) -> algo.CompletionMasks:
        """The batch's completions as the losses see them: episode rows by their loss masks (the model's own
        tokens), the others through their first EOS."""
        p = self.passes
        if has_episodes(b):
            return algo.critic_free_masks(
                b.responses,
                p.eos_id,
                p.pad_id,
                mask_truncated=mask_truncated,
                loss_mask=b.loss_mask,
                episodes=b.episodes,
                ended=b.episode_done,
            )
        return algo.critic_free_masks(b.responses, p.eos_id, p.pad_id, mask_truncated=mask_truncated)

    def rejection_sampling(self, b: RolloutBatch) -> dict[str, float]:
        """Rejection-sampling fine-tuning (seed 002; Llama 2 alternates it with PPO): the best-scored sample of each
        prompt's group (``min_score``: if good enough), trained on by SFT: the mean negative log-likelihood of its
        response tokens (an episode's own tokens), at temperature 1, in the actor's minibatches and micro-batches."""
        p = self.passes
        a, rs, context_length = p.cfg.actor, p.cfg.algorithm.rejection_sampling, b.context_length
        masks = self._masks(b)
        responses, mask = masks.responses, masks.mask
        keep = algo.best_of_group(b.scores, b.group, rs.min_score)
        metrics = {"rft/kept": float(len(keep)), "rft/groups": float(len(torch.unique(b.group)))}
        if not len(keep):
            log.info("step %d: rejection sampling kept no sample (min_score %s)", p.state.step + 1, rs.min_score)
            return metrics
        metrics["rft/kept_score_mean"] = b.scores[keep].mean().item()
        stats: dict[str, list[float]] = {}

        def micro_loss(mu: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
            rows, whole = keep[mu], keep[mb]
            logprobs, _ = p.actor_rows(b.query_responses[rows], responses[rows], context_length, temperature=1.0)
            loss = -algo.masked_mean(logprobs, mask[rows])
            append_stats(stats, {"loss/sft": loss.item()})
            return algo.micro_weight("tokens", mask[rows], mask[whole]) * loss

        epochs = (p.minibatches(len(keep), a.ppo_mini_batch_size, a.shuffle_minibatch) for _ in range(rs.epochs))
        p.actor_epochs(epochs, a.micro_batch_size, micro_loss, stats)
        metrics.update({k: sum(v) / len(v) for k, v in stats.items()})
        return metrics

    def _online_dpo(self, b: RolloutBatch) -> dict[str, float]:
        """Pairs within each prompt's group: the first two OK samples; chosen has the higher score (ties: first).

        As TRL's OnlineDPOTrainer: log-probs of the raw logits (no division by the sampling temperature), summed over
        each completion through its EOS. The pairs and the loss are ``rlhf.algo.online_dpo``; here the passes.
        """
        p = self.passes
        cfg, a, alg, context_length = p.cfg, p.cfg.actor, p.cfg.algorithm, b.context_length
        firsts, seconds = algo.dpo_pairs(b.group)
        if not firsts:
            raise ValueError("online DPO needs two scored samples per prompt; none in this batch")
        idx = torch.tensor(firsts + seconds, device=b.responses.device)  # block layout [p0..pB-1, p0..pB-1]
        d = self._pairs(b, idx)
        temperature = cfg.logprob_temperature  # 1.0: TRL's online DPO never divides by the sampling temperature
        stats: dict[str, list[float]] = {}
        # No separate old pass here: the first minibatch's forwards run before any optimizer step, so its rows'
        # mismatch costs nothing. Comparable with the sampling log-probs only at the sampling temperature (1.0).
        first: list[torch.Tensor] = []
        measured: list[tuple[torch.Tensor, torch.Tensor]] = []

        def micro_loss(pairs: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
            rows = d.rows(pairs)  # these pairs' chosen and rejected answers
            logprobs, entropies = p.actor_rows(
                b.query_responses[idx[rows]],
                d.responses[rows],
                context_length,
                temperature=temperature,
                entropy=bool(a.entropy_coeff),
            )
            if not first:
                first.append(whole)
            if whole is first[0] and p.temperature == temperature:
                measured.append((rows, logprobs.detach()))
            loss, values = algo.online_dpo_micro_loss(
                d,
                pairs,
                whole,
                logprobs,
                entropies,
                beta=alg.dpo_beta,
                loss_type=alg.dpo_loss_type,
                entropy_coeff=a.entropy_coeff,
            )
            append_stats(stats, {k: v.item() for k, v in values.items()})
            return loss

        # ppo_mini_batch_size and micro_batch_size count samples: a pair is two
        pairs_per_step = max(1, a.ppo_mini_batch_size // 2)
        micro_pairs = None if a.micro_batch_size is None else max(1, a.micro_batch_size // 2)
        dev = b.responses.device
        epochs = (
            (mb.to(dev) for mb in p.minibatches(len(firsts), pairs_per_step, a.shuffle_minibatch))
            for _ in range(a.ppo_epochs)
        )
        p.actor_epochs(epochs, micro_pairs, micro_loss, stats)
        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        metrics["objective/scores_margin"] = (d.scores[d.chosen] - d.scores[d.rejected]).mean().item()
        if measured:
            rows = torch.cat([r for r, _ in measured])
            metrics.update(p.mismatch(b, torch.cat([lp for _, lp in measured]), d.mask[rows], idx[rows]))
        return metrics

    def _pairs(self, b: RolloutBatch, idx: torch.Tensor) -> algo.DpoPairs:
        """The batch's rows ``idx`` (two per prompt, block layout) as online DPO's pairs."""
        p = self.passes
        episodes = {}
        if has_episodes(b):
            episodes = {"loss_mask": b.loss_mask[idx], "episodes": b.episodes[idx], "ended": b.episode_done[idx]}
        return algo.online_dpo_pairs(
            b.responses[idx],
            b.scores[idx],
            b.ref_logprobs[idx],
            p.eos_id,
            p.pad_id,
            missing_eos_penalty=p.cfg.algorithm.missing_eos_penalty,
            **episodes,
        )


def critic_free_settings(cfg: ExperimentConfig, kl_coef: float) -> algo.CriticFreeSettings:
    """The config's critic-free fields as ``rlhf.algo``'s plain settings; ``kl_coef``: the KL coefficient now (the
    trainer state's, which a controller may move)."""
    a, alg = cfg.actor, cfg.algorithm
    return algo.CriticFreeSettings(
        estimator=cfg.critic_free_estimator,
        beta=kl_coef,
        kl_estimator=alg.kl_penalty,
        rloo_convention=alg.rloo_convention,
        scale_rewards=alg.scale_rewards,
        whiten=alg.whiten_advantages,
        gamma=alg.gamma,
        missing_eos_penalty=alg.missing_eos_penalty,
        distill_coef=alg.distill.coef,
        distill_reward_coef=alg.distill.reward_coef,
        loss_type=alg.loss_type,
        epsilon=a.clip_ratio,
        epsilon_high=a.clip_ratio_high,
        importance_sampling_level=alg.importance_sampling_level,
        use_bias_correction_kl=alg.use_bias_correction_kl,
        top_entropy_quantile=alg.top_entropy_quantile,
        entropy_coeff=a.entropy_coeff,
        max_completion_length=cfg.max_new_tokens,
        dual_clip=a.dual_clip,
        tis_cap=a.tis_cap,
    )
