"""What a training stage is handed: the trainer's passes through its models, the optimizer steps, minibatch orders
and the mismatch figure, as :class:`TrainerPasses`.

:class:`services.trainer.engine.TrainerEngine` is the one implementation; the stages (``ppo``, ``critic_free``) take
it as a constructor argument and use nothing of it that is not named here. This module imports no other part of the
trainer at run time, so the stages import it and the engine imports the stages, never the other way around.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from rlhf.config import ExperimentConfig
    from rlhf.distributed import Group
    from services.trainer.batch import RolloutBatch
    from services.trainer.state import TrainerState


class TrainerPasses(Protocol):
    cfg: ExperimentConfig
    state: TrainerState  # the step, the KL coefficient and its controller
    device: torch.device
    group: Group | None  # None: one process
    pad_id: int
    eos_id: int
    # critic.shared_backbone: the value head is on the actor and its loss joins the actor's backward
    shared_value: bool
    # PPO: the first minibatch's forward gives its rows' old log-probs and values (False: an old pass over every row)
    reuse_first_pass: bool
    # the reference model held by the trainer (algorithm.kl_penalty full), else None
    ref_model: torch.nn.Module | None

    @property
    def temperature(self) -> float:
        """The sampling temperature the log-probs are taken at unless a pass names another."""
        ...

    def logits_and_logprobs(
        self, qr: torch.Tensor, responses: torch.Tensor, context_length: int, temperature: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The actor's response logits and log-probs of the rows, in this process alone."""
        ...

    def actor_rows(
        self,
        qr: torch.Tensor,
        responses: torch.Tensor,
        context_length: int,
        temperature: float | None = None,
        entropy: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The actor's log-probs of the rows and, with ``entropy`` set, their entropies; split across a group."""
        ...

    def entropies(
        self, logits: torch.Tensor, entropy: bool | None, temperature: float | None = None
    ) -> torch.Tensor | None:
        """Per-token entropies of ``logits`` (None when ``entropy`` is None; True: with gradient)."""
        ...

    def critic_rows(self, qr: torch.Tensor, context_length: int) -> torch.Tensor:
        """The critic's values of the rows' response tokens; split across a group."""
        ...

    def reference_logits(self, qr: torch.Tensor, context_length: int) -> torch.Tensor:
        """The reference model's response logits (only with ``ref_model``)."""
        ...

    def behavior(self, b: RolloutBatch, old_logprobs: torch.Tensor) -> torch.Tensor | None:
        """The behaviour policy's log-probs for truncated importance sampling, or None when it is off."""
        ...

    def minibatches(self, n: int, size: int, shuffle: bool) -> Iterator[torch.Tensor]:
        """Row index tensors of ``size`` over ``n`` rows, in the trainer's seeded order when ``shuffle``."""
        ...

    def actor_epochs(
        self,
        epochs: Iterable[Iterable[torch.Tensor]],
        micro_size: int | None,
        micro_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        stats: dict[str, list[float]],
    ) -> None:
        """The actor's optimizer steps: one per minibatch, over its micro-batches' weighted losses."""
        ...

    def critic_step(self, losses: torch.Tensor | Iterable[torch.Tensor]) -> float:
        """One critic optimizer step over ``losses``; the gradient norm, NaN when skipped as not finite."""
        ...

    def mismatch(
        self, b: RolloutBatch, logprobs: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor | None = None
    ) -> dict[str, float]:
        """The ``mismatch/*`` metrics of ``logprobs`` against the batch's sampling log-probs."""
        ...
