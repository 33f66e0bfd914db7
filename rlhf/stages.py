"""The training stages (``training.stage``) and what each one has: :class:`Stage` and its :class:`StageTraits`.

The config rules, the trainer and the publisher ask a stage what it has (a critic, pairs of samples, group
advantages, how many samples per prompt) instead of comparing its name; a new stage is one more row here. A
``Stage`` is a ``str``: it compares equal to its YAML value and formats as it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class Stage(StrEnum):
    PPO = "ray_ppo"
    ONLINE_DPO = "ray_online_dpo"
    GRPO = "ray_grpo"
    RLOO = "ray_rloo"
    REINFORCE_PLUS_PLUS = "ray_reinforce_plus_plus"

    @property
    def traits(self) -> StageTraits:
        return STAGE_TRAITS[self]


@dataclass(frozen=True)
class StageTraits:
    # algorithm.adv_estimator values the stage accepts -> the estimator it then runs ("gae", the field's default,
    # means the stage's own; None: the stage has no advantages)
    estimators: Mapping[str, str | None]
    critic: bool = False  # trains a value model beside the actor (GAE advantages)
    group_advantages: bool = False  # advantages from each prompt's group of samples, no critic (critic-free)
    pairs: bool = False  # two samples per prompt, chosen and rejected by score (a preference loss)
    samples_per_prompt: int | None = None  # what the trainer asks rollout for; None: actor_rollout.n_samples_per_prompt
    # what divides the logits for the trainer's and the reference's log-probs: None the sampling temperature (TRL's
    # PPO, GRPO, RLOO), 1.0 the raw logits (TRL's OnlineDPOTrainer)
    logprob_temperature: float | None = None


STAGE_TRAITS: dict[Stage, StageTraits] = {
    Stage.PPO: StageTraits(estimators={"gae": "gae"}, critic=True),
    Stage.ONLINE_DPO: StageTraits(estimators={"gae": None}, pairs=True, samples_per_prompt=2, logprob_temperature=1.0),
    Stage.GRPO: StageTraits(
        estimators={"gae": "grpo", "grpo": "grpo", "group_norm": "grpo", "dr_grpo": "dr_grpo"}, group_advantages=True
    ),
    Stage.RLOO: StageTraits(estimators={"gae": "rloo", "rloo": "rloo"}, group_advantages=True),
    Stage.REINFORCE_PLUS_PLUS: StageTraits(
        estimators={
            "gae": "reinforce_plus_plus",
            "reinforce_plus_plus": "reinforce_plus_plus",
            "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
        },
        group_advantages=True,
    ),
}
# the critic-free stages, in the order of Stage (error messages list them)
CRITIC_FREE = tuple(s for s in Stage if s.traits.group_advantages)
