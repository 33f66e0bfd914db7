"""On-policy distillation's per-token advantages (rlhf.algo.distill_advantages) against a naive loop."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf.algo import distill_advantages


def _naive(student, teacher, mask, coef, task, reward_coef):
    n_rows, n_cols = student.shape
    adv, rkl = torch.zeros(n_rows, n_cols), torch.zeros(n_rows, n_cols)
    for b in range(n_rows):
        for t in range(n_cols):
            if mask[b, t]:
                rkl[b, t] = student[b, t] - teacher[b, t]
                extra = 0.0
                if task is not None:
                    extra = task[b] if task.dim() == 1 else task[b, t]
                adv[b, t] = coef * (teacher[b, t] - student[b, t]) + reward_coef * extra
    return adv, rkl


@pytest.mark.parametrize("task_shape", [None, "seq", "token"])
@pytest.mark.parametrize(("coef", "reward_coef"), [(1.0, 0.0), (0.5, 2.0), (2.0, 0.3)])
def test_advantages_match_a_loop(task_shape, coef, reward_coef):
    g = torch.Generator().manual_seed(3)
    student = -torch.rand(4, 6, generator=g) * 5
    teacher = -torch.rand(4, 6, generator=g) * 5
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[2] = False  # a row without a trained token
    task = {None: None, "seq": torch.randn(4, generator=g), "token": torch.randn(4, 6, generator=g)}[task_shape]
    adv, rkl = distill_advantages(student, teacher, mask, coef=coef, task_advantages=task, reward_coef=reward_coef)
    want_adv, want_rkl = _naive(student, teacher, mask, coef, task, reward_coef)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(rkl, want_rkl)
    assert not adv[2].any()


def test_reward_coef_zero_ignores_the_task_advantage_and_padding_may_hold_minus_inf():
    student = torch.tensor([[-1.0, -2.0, -math.inf]])
    teacher = torch.tensor([[-0.5, -4.0, -math.inf]])
    mask = torch.tensor([[True, True, False]])
    adv, rkl = distill_advantages(student, teacher, mask, task_advantages=torch.tensor([7.0]))
    assert adv.tolist() == [[0.5, -2.0, 0.0]] and rkl.tolist() == [[-0.5, 2.0, 0.0]]


def test_the_mean_reverse_kl_on_student_samples_estimates_kl_student_teacher():
    """On tokens sampled from the student, the mean of student - teacher log-prob is KL(student || teacher) (not the
    forward KL): the quantity logged as distill/reverse_kl."""
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(16, generator=g) * 2, -1)
    q = torch.log_softmax(torch.randn(16, generator=g) * 2, -1)
    tokens = torch.multinomial(p.exp(), 200_000, replacement=True, generator=g)
    _, rkl = distill_advantages(p[tokens][None], q[tokens][None], torch.ones(1, tokens.numel(), dtype=torch.bool))
    reverse = (p.exp() * (p - q)).sum().item()
    forward = (q.exp() * (q - p)).sum().item()
    assert rkl.mean().item() == pytest.approx(reverse, abs=0.02)
    assert abs(reverse - forward) > 0.1  # the two directions differ here, so the check tells them apart
