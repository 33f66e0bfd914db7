"""Transport between the services: Redis Streams queues (prompt jobs, experience), admission control, and the
weight-sync protocol (safetensors buckets over ``RolloutService.UpdateWeights``).

``import rlhf.transport`` does not import torch; the weight-sync names load :mod:`rlhf.transport.weightsync` on
first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlhf.transport.admission import Admission, AdmissionState, get_policy_version, publish_policy_version
from rlhf.transport.codec import MalformedRecord, decode_experience, decode_prompt_job, encode
from rlhf.transport.keys import ROLLOUT_GROUP, TRAINER_GROUP, RunKeys
from rlhf.transport.streams import (
    Deduped,
    ExperienceQueue,
    PromptQueue,
    PublishResult,
    QueueStats,
    connect,
    dead_letters,
    delete_run,
    drop_trained,
    queue_stats,
    trim_stream,
)

_WEIGHTSYNC = {
    "CorruptUpdate",
    "IncompatibleUpdate",
    "IncompleteUpdate",
    "PackedWeights",
    "StagedWeights",
    "StaleVersion",
    "UpdateInProgress",
    "UpdateTooLarge",
    "WeightReceiver",
    "WeightSyncError",
    "manifest_checksum",
    "manifest_of",
    "pack_weights",
    "push_weights",
    "push_weights_many",
    "receive_update",
    "weight_updates",
}


def __getattr__(name: str) -> Any:
    if name in _WEIGHTSYNC:
        return getattr(importlib.import_module("rlhf.transport.weightsync"), name)
    raise AttributeError(f"module 'rlhf.transport' has no attribute {name!r}")


__all__ = [
    "ROLLOUT_GROUP",
    "TRAINER_GROUP",
    "Admission",
    "AdmissionState",
    "Deduped",
    "ExperienceQueue",
    "MalformedRecord",
    "PromptQueue",
    "PublishResult",
    "QueueStats",
    "RunKeys",
    "connect",
    "dead_letters",
    "decode_experience",
    "decode_prompt_job",
    "delete_run",
    "drop_trained",
    "encode",
    "get_policy_version",
    "publish_policy_version",
    "queue_stats",
    "trim_stream",
    *sorted(_WEIGHTSYNC),
]
