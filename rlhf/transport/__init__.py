"""Transport between the services: Redis Streams queues (prompt jobs, experience), admission control, and the
weight-sync protocol (safetensors buckets behind a verified header: over the replica's TCP data plane, opened and
committed by gRPC ``OpenWeightsTransfer`` / ``CommitWeights``, or streamed over ``RolloutService.UpdateWeights``).

``import rlhf.transport`` does not import torch; the weight-sync names load from :mod:`rlhf.transport.weights` on
first use. How a replica and the trainer use the queues: docs/code-tour.md#1-a-prompt-job-to-its-training-step;
their guarantees: docs/reliability.md#the-guarantees; weight sync: docs/weight-sync.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from rlhf.transport.admission import Admission, AdmissionState, get_policy_version, publish_policy_version
from rlhf.transport.codec import MalformedRecord, decode_experience, decode_prompt_job, encode
from rlhf.transport.connection import ReplicationLag, WaitPolicy, parse_redis_url
from rlhf.transport.keys import ROLLOUT_GROUP, TRAINER_GROUP, RunKeys
from rlhf.transport.stream_admin import QueueStats, dead_letters, delete_run, queue_stats, trim_stream
from rlhf.transport.streams import (
    Deduped,
    ExperienceQueue,
    PromptQueue,
    PublishResult,
    connect,
    drop_trained,
    waited,
)

_WEIGHTSYNC = {
    "BufferPool",
    "CorruptUpdate",
    "IncompatibleUpdate",
    "IncompleteUpdate",
    "PackedWeights",
    "StagedWeights",
    "StaleVersion",
    "StreamedWeights",
    "UpdateInProgress",
    "UpdateTooLarge",
    "WeightReceiver",
    "WeightSyncError",
    "manifest_checksum",
    "manifest_of",
    "copy_weights",
    "pack_weights",
    "push_weights",
    "push_weights_many",
    "push_weights_streamed",
    "receive_update",
    "weight_updates",
}


def __getattr__(name: str) -> Any:
    if name in _WEIGHTSYNC:
        return getattr(importlib.import_module("rlhf.transport.weights"), name)
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
    "ReplicationLag",
    "RunKeys",
    "WaitPolicy",
    "connect",
    "dead_letters",
    "decode_experience",
    "decode_prompt_job",
    "delete_run",
    "drop_trained",
    "encode",
    "get_policy_version",
    "publish_policy_version",
    "parse_redis_url",
    "queue_stats",
    "trim_stream",
    "waited",
    *sorted(_WEIGHTSYNC),
]
