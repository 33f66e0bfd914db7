"""A replica that starts (or restarts) mid-run: load the newest weights before the first job.

Two sources, in this order of preference:

1. the trainer: it pushes the current version to any replica that serves an older one (its catch-up loop compares
   each replica's ``GetWeightsVersion`` with the run's published version every few seconds), over the same
   authenticated, verified weight-sync calls as every other push. The worker takes no job while the replica is
   behind the published version (:meth:`services.rollout.worker.RolloutWorker._behind`);
2. the run's newest complete checkpoint (``<RLHF_RUN_DIR>/checkpoints``, else the config's ``training.save``), loaded
   at start-up by :func:`load_latest_checkpoint` before the worker starts. It is what a trainer that is down resumes
   from, so when no push comes within ``RLHF_ROLLOUT_CATCH_UP_WAIT_S`` the worker takes jobs with it: their samples
   carry the checkpoint's version, on-policy for the resumed trainer, and a live trainer that has moved on drops them
   by its staleness bound (kept at consumption), so the bound holds either way.

The replica reports the version it loaded (``GetWeightsVersion``, ``/v1/weights/version``, every sample).
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
