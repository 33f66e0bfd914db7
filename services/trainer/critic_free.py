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
from services.trainer import optim
from services.trainer.batch import RolloutBatch, has_episodes
from services.trainer.optim import append_stats

if TYPE_CHECKING:
    from services.trainer.passes import TrainerPasses

log = logging.getLogger("rlhf.trainer")


class CriticFreeStages:
    """The critic-free stages: :meth:`update` on a batch (online DPO under ``ray_online_dpo``, else the GRPO family)
    and :meth:`rejection_sampling`. The models, optimizers and their passes are ``passes``'s (the trainer engine's);
    this class holds no state of its own."""

    def __init__(self, passes: TrainerPasses):
        self.passes = passes

    def update(self, b: RolloutBatch) -> dict[str, float]:
        if self.passes.cfg.training.stage == "ray_online_dpo":
            return self._online_dpo(b)
        return self._group(b)

    def _group(self, b: RolloutBatch) -> dict[str, float]:
        """GRPO / RLOO / REINFORCE++: advantages from each prompt's group of samples, no critic.

        The math, masks and advantages included, is ``rlhf.algo.critic_free`` (TRL's GRPOTrainer / RLOOTrainer,
        OpenRLHF's REINFORCE++); here only the model passes: the on-policy old log-probs and the minibatch updates
        over epochs (TRL's ``num_iterations``).
        """
        p = self.passes
        cfg, a, alg, context_length = p.cfg, p.cfg.actor, p.cfg.algorithm, b.context_length
        estimator = cfg.critic_free_estimator
        trl_rloo = estimator == "rloo" and alg.rloo_convention == "trl"
        kl_in_loss = estimator in ("grpo", "dr_grpo")
        beta = p.state.kl_coef
        if has_episodes(b):
            responses, mask, contains_eos = algo.episode_completion_mask(
                b.responses, b.loss_mask, b.episodes, b.episode_done, p.eos_id, p.pad_id
            )
            every_token = mask  # an episode's tokens to compare with the sampler's: the model's own
            if alg.mask_truncated_completions:
                mask = mask & contains_eos[:, None]
        else:
            responses, mask, contains_eos = algo.completion_mask(
                b.responses, p.eos_id, p.pad_id, alg.mask_truncated_completions
            )
            every_token = None
        scores = algo.penalize_missing_eos(b.scores, contains_eos, alg.missing_eos_penalty)
        zero = torch.zeros((), device=responses.device)
        ref = torch.where(mask, b.ref_logprobs, zero)
        with torch.no_grad():
            old_logprobs, _ = p.actor_rows(b.query_responses, responses, context_length)
        # over every response token, also of the completions mask_truncated_completions keeps out of the loss
        if every_token is None:
            every_token = algo.completion_mask(b.responses, p.eos_id, p.pad_id)[1]
        mismatch = p.mismatch(b, old_logprobs, every_token)
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
        behavior = p.behavior(b, old_logprobs)
        if trl_rloo:
            old_seq = algo.masked_sum(old_logprobs, mask, dim=1)
            behavior_seq = None if behavior is None else algo.masked_sum(behavior, mask, dim=1)
        batch_size = responses.shape[0]
        n_minibatches = math.ceil(batch_size / a.ppo_mini_batch_size)
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
            new_logprobs, entropies = p.actor_rows(
                b.query_responses[mb], responses[mb], context_length, entropy=bool(a.entropy_coeff)
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
            append_stats(
                stats,
                {
                    "loss/policy": pg_loss.item(),
                    "policy/entropy": algo.masked_mean(entropies.detach(), mask[mb]).item(),
                    **{f"policy/{k}": v.item() for k, v in pg_stats.items() if k != "policy_loss"},
                },
            )
            return loss

        epochs = (p.minibatches(batch_size, a.ppo_mini_batch_size, a.shuffle_minibatch) for _ in range(a.ppo_epochs))
        p.actor_epochs(epochs, a.micro_batch_size, micro_loss, stats)
        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        metrics["objective/kl"] = algo.masked_sum(kl, mask, dim=1).mean().item()
        metrics["objective/scores"] = scores.mean().item()
        metrics["objective/advantages_mean"] = advantages.float().mean().item()
        if distill.coef > 0:  # the estimator of KL(student || teacher) per sampled token, before this step's update
            metrics["distill/reverse_kl"] = algo.masked_mean(reverse_kl, mask).item()
        metrics.update(mismatch)
        return metrics

    def rejection_sampling(self, b: RolloutBatch) -> dict[str, float]:
        """Rejection-sampling fine-tuning (seed 002; Llama 2 alternates it with PPO): the best-scored sample of each
        prompt's group (``min_score``: if good enough), trained on by SFT: the mean negative log-likelihood of its
        response tokens (an episode's own tokens), at temperature 1, in the actor's minibatches and micro-batches."""
        p = self.passes
        a, rs, context_length = p.cfg.actor, p.cfg.algorithm.rejection_sampling, b.context_length
        if has_episodes(b):
            responses, mask, _ = algo.episode_completion_mask(
                b.responses, b.loss_mask, b.episodes, b.episode_done, p.eos_id, p.pad_id
            )
        else:
            responses, mask, _ = algo.completion_mask(b.responses, p.eos_id, p.pad_id)
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
            return optim.micro_weight("tokens", mask[rows], mask[whole]) * loss

        epochs = (p.minibatches(len(keep), a.ppo_mini_batch_size, a.shuffle_minibatch) for _ in range(rs.epochs))
        p.actor_epochs(epochs, a.micro_batch_size, micro_loss, stats)
        metrics.update({k: sum(v) / len(v) for k, v in stats.items()})
        return metrics

    def _online_dpo(self, b: RolloutBatch) -> dict[str, float]:
        """Pairs within each prompt's group: the first two OK samples; chosen has the higher score (ties: first).

        As TRL's OnlineDPOTrainer: log-probs of the raw logits (no division by the sampling temperature), summed over
        each completion through its EOS.
        """
        p = self.passes
        cfg, context_length = p.cfg, b.context_length
        firsts, seconds = algo.dpo_pairs(b.group)
        if not firsts:
            raise ValueError("online DPO needs two scored samples per prompt; none in this batch")
        n_pairs = len(firsts)
        idx = torch.tensor(firsts + seconds, device=b.responses.device)  # block layout [p0..pB-1, p0..pB-1]
        if has_episodes(b):
            responses, mask, contains_eos = algo.episode_completion_mask(
                b.responses[idx], b.loss_mask[idx], b.episodes[idx], b.episode_done[idx], p.eos_id, p.pad_id
            )
        else:
            responses = algo.truncate_at_stop(b.responses[idx], p.eos_id, p.pad_id)
            mask = responses != p.pad_id
            contains_eos = (responses == p.eos_id).any(1)
        scores = algo.penalize_missing_eos(b.scores[idx], contains_eos, cfg.algorithm.missing_eos_penalty)
        chosen, rejected = algo.select_chosen_rejected(scores, n_pairs)
        ref_logprobs = b.ref_logprobs[idx]
        ref_sums = algo.masked_sum(ref_logprobs, mask, dim=1)
        temperature = cfg.logprob_temperature  # 1.0: TRL's online DPO never divides by the sampling temperature
        a = cfg.actor
        stats: dict[str, list[float]] = {}
        # No separate old pass here: the first minibatch's forwards run before any optimizer step, so its rows'
        # mismatch costs nothing. Comparable with the sampling log-probs only at the sampling temperature (1.0).
        first: list[torch.Tensor] = []
        measured: list[tuple[torch.Tensor, torch.Tensor]] = []

        def micro_loss(pairs: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
            # rows of these pairs' chosen and rejected answers; the DPO loss is a mean over pairs
            rows = torch.cat([chosen[pairs], rejected[pairs]])
            logprobs, entropies = p.actor_rows(
                b.query_responses[idx[rows]],
                responses[rows],
                context_length,
                temperature=temperature,
                entropy=bool(a.entropy_coeff),
            )
            if not first:
                first.append(whole)
            if whole is first[0] and p.temperature == temperature:
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
            append_stats(
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
            (mb.to(dev) for mb in p.minibatches(n_pairs, pairs_per_step, a.shuffle_minibatch))
            for _ in range(a.ppo_epochs)
        )
        p.actor_epochs(epochs, micro_pairs, micro_loss, stats)
        metrics = {k: sum(v) / len(v) for k, v in stats.items()}
        metrics["objective/scores_margin"] = (scores[chosen] - scores[rejected]).mean().item()
        if measured:
            rows = torch.cat([r for r, _ in measured])
            metrics.update(p.mismatch(b, torch.cat([lp for _, lp in measured]), mask[rows], idx[rows]))
        return metrics
