"""Online DPO assembled (``rlhf.algo.online_dpo``): the pairs of a batch, and micro-batch losses whose weighted sum is
the minibatch's loss."""

from __future__ import annotations

import pytest
import torch

from rlhf.algo import online_dpo_micro_loss, online_dpo_pairs

EOS, PAD = 2, 0


def _pairs(penalty: float = 0.0):
    responses = torch.tensor(
        [
            [5, 6, EOS, PAD],  # pair 0, first answer
            [5, 6, 7, 8],  # pair 1, first: no EOS (truncated)
            [7, EOS, PAD, PAD],  # pair 0, second answer
            [8, EOS, PAD, PAD],  # pair 1, second
        ]
    )
    scores = torch.tensor([1.0, 2.0, 1.0, 1.5])
    ref = -torch.rand(4, 4, generator=torch.Generator().manual_seed(0))
    return online_dpo_pairs(responses, scores, ref, EOS, PAD, missing_eos_penalty=penalty)


def test_chosen_is_the_higher_score_first_on_a_tie_and_a_missing_eos_costs():
    d = _pairs()
    assert d.chosen.tolist() == [0, 1] and d.rejected.tolist() == [2, 3]  # a tie chooses the first answer
    assert d.mask[0].tolist() == [True, True, True, False] and d.mask[1].all()
    penalised = _pairs(penalty=1.0)  # pair 1's first answer has no EOS: 2.0 - 1.0 < 1.5
    assert penalised.chosen.tolist() == [0, 3] and penalised.rejected.tolist() == [2, 1]
    assert torch.equal(d.rows(torch.tensor([1])), torch.tensor([1, 3]))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_micro_batch_losses_add_up_to_the_minibatch_loss(loss_type):
    d = _pairs()
    g = torch.Generator().manual_seed(1)
    logprobs = d.ref_logprobs + 0.2 * torch.randn(d.ref_logprobs.shape, generator=g)
    entropies = torch.rand(d.ref_logprobs.shape, generator=g)
    whole = torch.tensor([1, 0])

    def loss(pairs):
        rows = d.rows(pairs)
        value, _ = online_dpo_micro_loss(
            d, pairs, whole, logprobs[rows], entropies[rows], beta=0.1, loss_type=loss_type, entropy_coeff=0.01
        )
        return value

    torch.testing.assert_close(loss(whole[:1]) + loss(whole[1:]), loss(whole), rtol=1e-6, atol=1e-7)
