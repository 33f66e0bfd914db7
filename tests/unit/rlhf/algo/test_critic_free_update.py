"""One critic-free update assembled (``rlhf.algo.critic_free``): the masks, the targets, and micro-batch losses whose
weighted sum is the minibatch's loss, for every aggregation."""

from __future__ import annotations

import pytest
import torch

from rlhf.algo import (
    CriticFreeSettings,
    critic_free_masks,
    critic_free_metrics,
    critic_free_micro_loss,
    critic_free_targets,
)

EOS, PAD = 2, 0


def _batch(seed: int = 0, rows: int = 8, length: int = 6):
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(3, 9, (rows, length), generator=g)
    for i in range(rows):
        end = i % length  # row i ends in EOS at column i % L, except the odd rows, which are truncated
        if i % 2 == 0:
            responses[i, end] = EOS
            responses[i, end + 1 :] = PAD
    old = -torch.rand(rows, length, generator=g)
    ref = -torch.rand(rows, length, generator=g)
    scores = torch.randn(rows, generator=g)
    group = torch.arange(rows) // 4
    return responses, old, ref, scores, group


def test_truncated_completions_leave_the_loss_mask_not_every_token():
    responses = _batch()[0]
    kept = critic_free_masks(responses, EOS, PAD)
    dropped = critic_free_masks(responses, EOS, PAD, mask_truncated=True)
    assert torch.equal(kept.mask, kept.every_token) and torch.equal(dropped.every_token, kept.every_token)
    assert torch.equal(dropped.contains_eos, torch.arange(8) % 2 == 0)
    assert not dropped.mask[1::2].any() and torch.equal(dropped.mask[0::2], kept.mask[0::2])


def test_distillation_adds_its_reverse_kl_to_the_targets_and_metrics():
    responses, old, ref, scores, group = _batch()
    masks = critic_free_masks(responses, EOS, PAD)
    plain = critic_free_targets(CriticFreeSettings("grpo"), scores, group, old, ref, masks)
    distil = critic_free_targets(CriticFreeSettings("grpo", distill_coef=1.0), scores, group, old, ref, masks)
    assert plain.reverse_kl is None and "distill/reverse_kl" not in critic_free_metrics(plain)
    assert distil.advantages.shape == old.shape and "distill/reverse_kl" in critic_free_metrics(distil)
    assert torch.equal(plain.old_logprobs, torch.where(masks.mask, old, 0.0))


@pytest.mark.parametrize(
    "settings",
    [
        CriticFreeSettings("grpo", loss_type="grpo", beta=0.1, entropy_coeff=0.01),
        CriticFreeSettings("grpo", loss_type="bnpo", entropy_coeff=0.01),
        CriticFreeSettings("dr_grpo", loss_type="dr_grpo", max_completion_length=6),
        CriticFreeSettings("grpo", loss_type="dapo", tis_cap=2.0),
        CriticFreeSettings("rloo", beta=0.05, tis_cap=2.0, entropy_coeff=0.01),
        CriticFreeSettings("reinforce_plus_plus", loss_type="bnpo", whiten=True),
    ],
    ids=["grpo", "bnpo", "dr_grpo", "dapo", "rloo_trl", "reinforce_plus_plus"],
)
def test_micro_batch_losses_add_up_to_the_minibatch_loss(settings):
    responses, old, ref, scores, group = _batch(seed=1)
    masks = critic_free_masks(responses, EOS, PAD)
    t = critic_free_targets(settings, scores, group, old, ref, masks)
    g = torch.Generator().manual_seed(2)
    new = t.old_logprobs + 0.1 * torch.randn(old.shape, generator=g)
    entropies = torch.rand(old.shape, generator=g)
    behavior = t.old_logprobs + 0.05 * torch.randn(old.shape, generator=g) if settings.tis_cap else None
    whole = torch.tensor([6, 1, 4, 3, 0, 7])  # one minibatch of 6 rows, as a shuffled order gives it

    def loss(rows):
        value, _ = critic_free_micro_loss(
            settings, t, rows, whole, new[rows], entropies[rows], minibatches=2, behavior_logprobs=behavior
        )
        return value

    parts = [loss(whole[:2]), loss(whole[2:5]), loss(whole[5:])]
    torch.testing.assert_close(sum(parts), loss(whole), rtol=1e-6, atol=1e-7)
