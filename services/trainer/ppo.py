"""PPO's update (``training.stage: ray_ppo``): :class:`PPOStage`, over the engine's ``TrainerPasses``.

GAE with a critic: the math of ``rlhf.algo.ppo_rollout`` (TRL's conventions; ``ppo_episode_rollout`` for multi-turn
episodes), then clipped policy and value losses over minibatches and epochs, optional entropy bonus. The old pass
(log-probs and values before the update) can double as the first minibatch's forward, and on a CPU the critic's side
runs beside the actor's on half the intra-op threads.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from rlhf import algo
from services.trainer import optim
from services.trainer.batch import RolloutBatch, has_episodes
from services.trainer.optim import append_stats

if TYPE_CHECKING:
    from services.trainer.passes import TrainerPasses

log = logging.getLogger("rlhf.trainer")


def response_tokens(b: RolloutBatch, pad_id: int, eos_id: int) -> int:
    """The response tokens PPO's losses would see in ``b``: the rollout's mask (``algo.ppo_rollout``: a row ends at
    its first stop token, and a row whose first token is the pad token has none), or an episode's loss mask."""
    if has_episodes(b):
        return int(b.loss_mask.sum().item())
    ell = algo.sequence_lengths(algo.truncate_at_stop(b.responses, eos_id, pad_id), pad_id)
    return int((ell + 1).clamp(min=0).sum().item())


class PPOStage:
    """The PPO stage: :meth:`update` on a batch. The models, optimizers and their passes are ``passes``'s (the
    trainer engine's); this class holds no state of its own."""

    def __init__(self, passes: TrainerPasses):
        self.passes = passes

    def _parallel_critic(self) -> bool:
        """Actor and critic are separate models with separate losses, so their passes can run side by side (as
        OpenRLHF and veRL run them on separate workers); the results are the same as one after the other. On a CPU
        the two sides split the intra-op threads (:meth:`_side_threads`), so it needs two of them."""
        p = self.passes
        if p.group is not None or p.shared_value:  # collectives could interleave; or one model, one backward
            return False
        return p.device.type != "cpu" or torch.get_num_threads() >= 2

    def _side_threads(self) -> tuple[int, int] | None:
        """Intra-op threads of the actor's and the critic's side when they run side by side on a CPU (None: leave
        them as they are). Half each: one OpenMP team per model on these matmuls scales worse than two teams of
        half the size side by side (measured by bench.critic_threads, docs/benchmarks.md). The results agree within
        float32 rounding (bit for bit on the tiny test model; on the small one ~1e-7 on some CPUs, where a kernel's
        result depends on its thread count)."""
        p = self.passes
        n = torch.get_num_threads()
        if p.device.type != "cpu" or n < 2:
            return None
        return n - n // 2, n // 2

    def update(self, b: RolloutBatch) -> dict[str, float]:
        p = self.passes
        if response_tokens(b, p.pad_id, p.eos_id) == 0:
            # Nothing to whiten or train on (TRL and veRL raise on whitening an empty mask): the update is skipped,
            # the step still counts, so the records are consumed rather than met again after a restart.
            log.warning("step %d: update skipped: no response token in the batch", p.state.step + 1)
            return {"update/skipped_no_response_tokens": 1.0}
        cfg, a, c, context_length = p.cfg, p.cfg.actor, p.cfg.critic, b.context_length
        batch_size = b.responses.shape[0]
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
                list(p.minibatches(batch_size, a.ppo_mini_batch_size, a.shuffle_minibatch)) for _ in range(a.ppo_epochs)
            ]
            critic_mbs = [
                list(p.minibatches(batch_size, c.critic_mini_batch_size, a.shuffle_minibatch))
                for _ in range(0 if p.shared_value else c.critic_update_epochs)  # shared: the actor's minibatches
            ]
            # OpenRLHF's freezing_actor_steps: the critic learns values of a fixed policy before the actor moves
            frozen = p.state.step < a.freezing_actor_steps
            first_a = first_c = None  # the rows whose old pass is their first update's forward (TrainerEngine.__init__)
            if p.reuse_first_pass and p.group is None and p.ref_model is None:
                if not frozen and actor_mbs:
                    first_a = next(optim.micro_batches(actor_mbs[0][0], a.micro_batch_size))
                first_c = next(optim.micro_batches(critic_mbs[0][0], c.micro_batch_size)) if critic_mbs else None
            values_f = run(self._old_values, b.query_responses, context_length, first_c)
            full_kl = None
            held_logits = None
            if p.ref_model is not None:  # kl_penalty full: one process only (refused in a group)
                with torch.no_grad():
                    old_logits, old_logprobs = p.logits_and_logprobs(b.query_responses, b.responses, context_length)
                    ref_logits = p.reference_logits(b.query_responses, context_length)
                    full_kl = algo.full_kl(old_logits, ref_logits, p.temperature)
                    del old_logits
            else:
                old_logprobs, held_logits = self._old_logprobs(b, context_length, first_a)
            values, held_values = values_f.result()
            episodes = has_episodes(b)
            rollout = (
                functools.partial(algo.ppo_episode_rollout, b.responses, b.loss_mask, b.episode_done)
                if episodes
                else functools.partial(algo.ppo_rollout, b.responses, stop_token_id=p.eos_id)
            )
            r = rollout(
                old_logprobs,
                b.ref_logprobs,
                values,
                b.scores,
                pad_token_id=p.pad_id,
                eos_token_id=p.eos_id,
                kl_coef=p.state.kl_coef,
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
            metrics.update(p.mismatch(b, old_logprobs, r.response_mask))
            critic_f = run(self._critic_updates, b, r, critic_mbs, held_values)
            stats = {} if frozen else self._actor_updates(b, r, actor_mbs, held_logits)
            stats.update(critic_f.result())
        finally:
            if pool:
                pool.shutdown(wait=True)
            torch.set_num_threads(before)
        mean_kl = algo.masked_mean(r.kl, r.response_mask, dim=1).mean().item()
        p.state.update_kl(mean_kl, batch_size)
        metrics.update({k: sum(v) / len(v) for k, v in stats.items()})
        metrics["objective/advantages_mean"] = algo.masked_mean(r.advantages, r.response_mask).item()
        metrics["policy/frozen"] = float(frozen)
        metrics["update/skipped_no_response_tokens"] = 0.0
        return metrics

    def _old_values(self, qr: torch.Tensor, context_length: int, first: torch.Tensor | None):
        """The critic's values of every row before the update, and (``first``: the critic's first minibatch) those
        rows' values with their graph, which that minibatch's update uses as its forward pass."""
        p = self.passes
        if first is None:
            with torch.no_grad():  # grad mode is per thread: set here, where it runs
                return p.critic_rows(qr, context_length), None
        with torch.enable_grad():
            held = p.critic_rows(qr[first], context_length)
        return _with_rest(qr.shape[0], first, held.detach(), lambda rows: p.critic_rows(qr[rows], context_length)), held

    def _old_logprobs(self, b: RolloutBatch, context_length: int, first: torch.Tensor | None):
        """The actor's log-probs of every row before the update, and (``first``: the actor's first micro-batch) those
        rows' logits with their graph, which that micro-batch's loss uses as its forward pass."""
        p = self.passes
        if first is None:
            with torch.no_grad():
                return p.actor_rows(b.query_responses, b.responses, context_length)[0], None
        with torch.enable_grad():
            held, lp = p.logits_and_logprobs(b.query_responses[first], b.responses[first], context_length)
        rest = lambda rows: p.actor_rows(b.query_responses[rows], b.responses[rows], context_length)[0]
        return _with_rest(b.responses.shape[0], first, lp.detach(), rest), held

    def _actor_updates(self, b: RolloutBatch, r, minibatches: list[list[torch.Tensor]], held=None):
        """The actor's PPO epochs. ``held``: the first micro-batch's logits, already computed (with their graph) at
        these weights by the old pass (:meth:`_old_logprobs`). With ``critic.shared_backbone`` each micro-batch's
        loss also holds its value loss (TRL's ``pg_loss + vf_coef * vf_loss``), from the value head on the same
        backbone."""
        p = self.passes
        a, context_length = p.cfg.actor, b.context_length
        stats: dict[str, list[float]] = {}
        behavior = p.behavior(b, r.logprobs)
        held = [held] if held is not None else []

        def micro_loss(mu: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
            # TRL's token mean over the minibatch = sum over micro-batches of (micro token mean x token share)
            weight = optim.micro_weight("tokens", r.response_mask[mu], r.response_mask[mb])
            if held:
                logits = held.pop()
                new_logprobs = algo.logprobs_from_logits(logits, r.responses[mu], p.temperature)
                entropies = p.entropies(logits, True)
            else:
                new_logprobs, entropies = p.actor_rows(
                    b.query_responses[mu], r.responses[mu], context_length, entropy=True
                )
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
            policy_loss = pg_loss.item()
            append_stats(
                stats,
                {
                    "loss/policy": policy_loss,
                    # MindSpeed-LLM's logged actor loss (seed 000 compares it with TRL's): whitened advantages make
                    # the signed mean near 0, the mean magnitude over micro-batches is what tracks the updates
                    "loss/policy_abs": abs(policy_loss),
                    "policy/entropy": entropy.item(),
                    **{f"policy/{k}": v.item() for k, v in pg_stats.items()},
                },
            )
            if p.shared_value:
                return weight * loss + self._value_micro_loss(b, r, mu, mb, stats)
            return weight * loss

        p.actor_epochs(minibatches, a.micro_batch_size, micro_loss, stats)
        return stats

    def _critic_updates(self, b: RolloutBatch, r, minibatches: list[list[torch.Tensor]], held=None):
        """The critic's epochs: each minibatch is one optimizer step over the weighted value losses of its
        micro-batches (``critic.micro_batch_size``), gradients accumulating. ``held``: the first micro-batch's values,
        already computed (with their graph) at these weights by the old pass (:meth:`_old_values`)."""
        p = self.passes
        c = p.cfg.critic
        stats: dict[str, list[float]] = {}
        held = [held] if held is not None else []

        def micro_loss(mu: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
            return self._value_micro_loss(b, r, mu, mb, stats, held.pop() if held else None)

        for epoch in minibatches:
            for mb in epoch:
                losses = (micro_loss(mu, mb) for mu in optim.micro_batches(mb, c.micro_batch_size))
                p.critic_step(losses)
        return stats

    def _value_micro_loss(self, b: RolloutBatch, r, mu, mb, stats, vpred: torch.Tensor | None = None) -> torch.Tensor:
        """``vf_coef`` x the clipped value loss of micro-batch ``mu`` of minibatch ``mb``, weighted by its share of
        the minibatch's value tokens (the loss is a token mean over value_mask). ``vpred``: its values, when held."""
        p = self.passes
        c = p.cfg.critic
        if vpred is None:
            vpred = p.critic_rows(b.query_responses[mu], b.context_length)
        vpred = vpred.masked_fill(r.padding_mask_p1[mu], 0.0)
        vf_loss, vf_stats = algo.value_loss(
            vpred, r.values[mu], r.returns[mu], r.value_mask[mu], cliprange_value=c.cliprange_value
        )
        append_stats(
            stats,
            {
                "loss/value": vf_loss.item(),
                "val/clipfrac": vf_stats["clipfrac"].item(),
                "val/vpred": vf_stats["vpred"].item(),
            },
        )
        return optim.micro_weight("tokens", r.value_mask[mu], r.value_mask[mb]) * c.vf_coef * vf_loss


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
    """An already computed result with a future's ``result()``: the sequential path of :meth:`PPOStage.update`."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value
