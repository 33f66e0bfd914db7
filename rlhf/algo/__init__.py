"""RL math for RLHF as pure torch functions (this package imports torch only: no service, network or I/O code).

Shapes: ``B`` rows (samples), ``L`` response tokens, ``V`` vocabulary. Per-token tensors are (B, L), right-padded.
The conventions and numbers match Hugging Face TRL where the algorithms are the same (see tests/parity).
"""

from rlhf.algo.advantages import (
    GROUP_ESTIMATORS,
    discounted_returns,
    gae,
    group_advantages,
    token_advantages_from_sequence,
)
from rlhf.algo.critic_free import (
    LOSS_TYPES,
    CompletionMasks,
    CriticFreeSettings,
    CriticFreeTargets,
    completion_mask,
    critic_free_advantages,
    critic_free_masks,
    critic_free_metrics,
    critic_free_micro_loss,
    critic_free_targets,
    distill_advantages,
    episode_completion_mask,
    grpo_advantages,
    grpo_loss,
    leave_one_out,
    openrlhf_advantages,
    rloo_trl_advantages,
    rloo_trl_loss,
    top_entropy_mask,
)
from rlhf.algo.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLRewards,
    full_kl,
    kl_estimate,
    kl_penalized_rewards,
    make_kl_controller,
)
from rlhf.algo.logprobs import entropy_from_logits, logprobs_from_logits
from rlhf.algo.losses import (
    aggregate,
    dpo_loss,
    dpo_pairs,
    micro_weight,
    ppo_policy_loss,
    select_chosen_rejected,
    value_loss,
)
from rlhf.algo.masked import compact, expand, masked_mean, masked_sum, masked_var, masked_whiten
from rlhf.algo.mismatch import logprob_mismatch
from rlhf.algo.online_dpo import DpoPairs, online_dpo_micro_loss, online_dpo_pairs
from rlhf.algo.ppo import (
    PPORollout,
    first_true_indices,
    ppo_episode_rollout,
    ppo_rollout,
    rollout_metrics,
    sequence_lengths,
    truncate_at_stop,
)
from rlhf.algo.reward_norm import FixedMoments, RunningMoments, normalize_and_clip
from rlhf.algo.schedule import lr_at
from rlhf.algo.sft import best_of_group, sft_loss
from rlhf.algo.shaping import REWARD_BASELINES, penalize_missing_eos, subtract_reward_baseline
from rlhf.algo.tinker_losses import LOSSES as TINKER_LOSSES
from rlhf.algo.tinker_losses import tinker_loss

__all__ = [
    "penalize_missing_eos",
    "subtract_reward_baseline",
    "REWARD_BASELINES",
    "FixedMoments",
    "RunningMoments",
    "full_kl",
    "lr_at",
    "normalize_and_clip",
    "sft_loss",
    "best_of_group",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_TYPES",
    "AdaptiveKLController",
    "FixedKLController",
    "KLRewards",
    "PPORollout",
    "aggregate",
    "compact",
    "completion_mask",
    "episode_completion_mask",
    "expand",
    "ppo_episode_rollout",
    "CompletionMasks",
    "CriticFreeSettings",
    "CriticFreeTargets",
    "critic_free_advantages",
    "critic_free_masks",
    "critic_free_metrics",
    "critic_free_micro_loss",
    "critic_free_targets",
    "micro_weight",
    "DpoPairs",
    "online_dpo_micro_loss",
    "online_dpo_pairs",
    "distill_advantages",
    "discounted_returns",
    "dpo_loss",
    "dpo_pairs",
    "entropy_from_logits",
    "first_true_indices",
    "gae",
    "group_advantages",
    "grpo_advantages",
    "grpo_loss",
    "kl_estimate",
    "kl_penalized_rewards",
    "leave_one_out",
    "logprob_mismatch",
    "logprobs_from_logits",
    "make_kl_controller",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "openrlhf_advantages",
    "ppo_policy_loss",
    "ppo_rollout",
    "rloo_trl_advantages",
    "rloo_trl_loss",
    "rollout_metrics",
    "select_chosen_rejected",
    "sequence_lengths",
    "token_advantages_from_sequence",
    "top_entropy_mask",
    "truncate_at_stop",
    "value_loss",
    "TINKER_LOSSES",
    "tinker_loss",
]
