"""A replica that starts (or restarts) mid-run: load the newest weights before the first job.

:func:`load_latest_checkpoint` loads the run's newest complete checkpoint at start-up, before the worker starts;
the trainer's catch-up push is preferred, and the worker waits up to ``RLHF_ROLLOUT_CATCH_UP_WAIT_S`` for it
(:meth:`services.rollout.worker.RolloutWorker._behind`). Design: docs/weight-sync.md#replicas-that-start-late.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from rlhf.checkpoints import PolicyCheckpoint, checkpoint_root, latest_policy, load_policy

if TYPE_CHECKING:  # pragma: no cover
    from rlhf.config import ExperimentConfig
    from rlhf.serving import ServiceSettings
    from services.rollout.engine import EngineBase

log = logging.getLogger("rlhf.rollout")

# save_pretrained writes a tied output embedding once, under the input embedding's name
TIED_NAMES = {"lm_head.weight": "model.embed_tokens.weight"}


async def load_latest_checkpoint(
    engine: EngineBase, cfg: ExperimentConfig, settings: ServiceSettings
) -> PolicyCheckpoint | None:
    """Swap in the policy of the run's newest complete checkpoint when it is newer than what the engine serves
    (the engine must be started); returns it, or None when there is none newer."""
    root = checkpoint_root(settings.run_dir, cfg.training.save)
    policy = await asyncio.to_thread(latest_policy, root)
    if policy is None or policy.version <= engine.weights_version:
        return None
    expected = engine.weight_manifest()
    tied = {n: src for n, src in TIED_NAMES.items() if n in expected} if engine.ties_word_embeddings else None
    tensors = await asyncio.to_thread(load_policy, policy, tied)
    # the same swap as a push: checked against the model, staged while nothing serves yet, versioned
    await engine.swap_weights(tensors, policy.version, policy.checksum, policy.version - 1)
    log.info(
        "rollout: loaded checkpoint %s (step %d) as weights version %d", policy.path.parent, policy.step, policy.version
    )
    return policy
