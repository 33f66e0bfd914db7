"""Episodes (multi-turn) in the algorithms: only the model's own tokens are actions.

Checked against a naive per-token loop over each row's model tokens, and against today's single-turn path (a one-turn
episode must give exactly its numbers).
"""

from __future__ import annotations

import pytest
import torch

from rlhf import algo

PAD, EOS = 0, 1


def test_compact_and_expand_are_inverse_on_the_mask():
    torch.manual_seed(0)
    x = torch.randn(5, 9)
    mask = torch.rand(5, 9) > 0.4
    mask[0] = False  # an empty row
    c = algo.compact(x, mask, fill=-7.0)
    for row in range(5):
        n = int(mask[row].sum())
        assert torch.equal(c[row, :n], x[row][mask[row]])
        assert (c[row, n:] == -7.0).all()
    back = algo.expand(c, mask)
    assert torch.equal(back, torch.where(mask, x, torch.zeros_like(x)))


def _naive_episode(lp, ref, values, score, model_pos, *, kl_coef, gamma, lam, n_cols):
    """GAE over the model tokens of one row, position by position: the KL penalty on each model token, the score on
    the last one (OpenRLHF's position), the next state of a model token is the next model token. As the single-turn
    path does (TRL), the values reach one column past the last action, where the recursion ends."""
    span = model_pos + ([model_pos[-1] + 1] if model_pos[-1] + 1 < n_cols else [])
    n = len(span)
    rewards = [-kl_coef * (lp[p] - ref[p]) for p in model_pos] + [0.0] * (n - len(model_pos))
    rewards[len(model_pos) - 1] += score
    vals = [values[p] for p in span]
    adv = [0.0] * n
    last = 0.0
    for t in reversed(range(n)):
        nxt = vals[t + 1] if t + 1 < n else 0.0
        delta = rewards[t] + gamma * nxt - vals[t]
        last = delta + gamma * lam * last
        adv[t] = last
    a_full, r_full = [0.0] * n_cols, [0.0] * n_cols
    for t, p in enumerate(span):
        a_full[p] = adv[t] if p in model_pos else 0.0
        r_full[p] = adv[t] + vals[t]
    return a_full, r_full


def test_gae_runs_over_the_model_tokens_only():
    """Two episodes whose model turns are split by environment tokens, against the naive loop."""
    torch.manual_seed(1)
    n_cols = 12
    # row 0: model 0-3 (EOS at 3), tool 4-6, model 7-9 (EOS at 9), pad; row 1: model 0-2, env 3-4, model 5-6, env 7-8,
    # model 9-11 (ends at the last column: no column after it)
    masks = [[1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1]]
    loss_mask = torch.tensor(masks, dtype=torch.bool)
    responses = torch.randint(2, 50, (2, n_cols))
    responses[0, 3] = responses[0, 9] = EOS
    responses[0, 10:] = PAD
    lp, ref, values = torch.randn(2, n_cols) * 0.3, torch.randn(2, n_cols) * 0.3, torch.randn(2, n_cols)
    scores = torch.tensor([1.0, -0.5])
    kw = dict(kl_coef=0.1, gamma=0.9, lam=0.8)
    r = algo.ppo_episode_rollout(
        responses,
        loss_mask,
        torch.tensor([True, True]),
        lp,
        ref,
        values,
        scores,
        pad_token_id=PAD,
        eos_token_id=EOS,
        kl_estimator="k1",
        score_position="last_token",
        whiten_advantages=False,
        **kw,
    )
    for row in range(2):
        pos = [i for i, m in enumerate(masks[row]) if m]
        adv, ret = _naive_episode(
            lp[row].tolist(), ref[row].tolist(), values[row].tolist(), scores[row].item(), pos, n_cols=n_cols, **kw
        )
        assert r.advantages[row].tolist() == pytest.approx(adv, abs=1e-6)
        assert r.returns[row][loss_mask[row]].tolist() == pytest.approx([ret[p] for p in pos], abs=1e-6)
    assert torch.equal(r.response_mask, loss_mask)
    assert (r.kl[~loss_mask] == 0).all() and (r.logprobs[~loss_mask] == 0).all()
    assert torch.equal(r.responses, responses)  # never cut at the first turn's EOS


@pytest.mark.parametrize("score_position", ["trl", "last_token"])
@pytest.mark.parametrize("whiten", [True, False])
def test_a_one_turn_episode_is_the_single_turn_path(score_position, whiten):
    torch.manual_seed(2)
    n_rows, n_cols = 6, 10
    lengths = [10, 7, 4, 9, 1, 6]
    responses = torch.randint(2, 50, (n_rows, n_cols))
    for i, n in enumerate(lengths):
        responses[i, n - 1] = EOS if i != 3 else 5  # row 3 was cut by max_tokens: no EOS
        responses[i, n:] = PAD
    loss_mask = responses != PAD
    lp, ref, values = torch.randn(n_rows, n_cols) * 0.2, torch.randn(n_rows, n_cols) * 0.2, torch.randn(n_rows, n_cols)
    scores = torch.randn(n_rows)
    kw = dict(
        pad_token_id=PAD,
        eos_token_id=EOS,
        kl_coef=0.05,
        gamma=1.0,
        lam=0.95,
        missing_eos_penalty=1.0,
        whiten_rewards=whiten,
        whiten_advantages=whiten,
        score_position=score_position,
    )
    single = algo.ppo_rollout(responses, lp, ref, values, scores, stop_token_id=EOS, **kw)
    ended = (responses == EOS).any(1)
    episode = algo.ppo_episode_rollout(responses, loss_mask, ended, lp, ref, values, scores, **kw)
    for name in ("logprobs", "ref_logprobs", "values", "scores", "kl", "rewards", "advantages", "returns"):
        assert torch.equal(getattr(single, name), getattr(episode, name)), name
    assert torch.equal(single.response_mask, episode.response_mask)
    assert torch.equal(single.value_mask, episode.value_mask)
    assert torch.equal(single.sequence_lengths, episode.sequence_lengths)


def test_episode_rows_keep_their_turns_and_single_rows_are_cut_at_eos():
    responses = torch.tensor([[5, EOS, 6, 7, EOS, PAD], [5, EOS, 6, 7, EOS, PAD]])
    loss_mask = torch.tensor([[1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    episodes = torch.tensor([True, False])
    ended = torch.tensor([False, False])
    resp, mask, eos = algo.episode_completion_mask(responses, loss_mask, episodes, ended, EOS, PAD)
    assert resp[0].tolist() == responses[0].tolist()
    assert resp[1].tolist() == [5, EOS, PAD, PAD, PAD, PAD]
    assert mask.tolist() == [[1, 1, 0, 1, 1, 0], [1, 1, 0, 0, 0, 0]]
    assert eos.tolist() == [False, True]  # the episode was not ended by its environment (max_turns)
    _, cut, _ = algo.episode_completion_mask(responses, loss_mask, episodes, ended, EOS, PAD, mask_truncated=True)
    assert not cut[0].any() and cut[1].tolist() == mask[1].tolist()
