"""Transport between the services: Redis Streams queues (prompt jobs, experience), admission control, and the
weight-sync protocol (safetensors buckets behind a verified header: over the replica's TCP data plane, opened and
committed by gRPC ``OpenWeightsTransfer`` / ``CommitWeights``, or streamed over ``RolloutService.UpdateWeights``).

``import rlhf.transport`` does not import torch; the weight-sync names load from :mod:`rlhf.transport.weights` on
first use.

A rollout replica::

    redis = connect(settings.redis_url)
    prompts, experience = PromptQueue(redis, run_id), ExperienceQueue(redis, run_id)
    while running:                      # catch redis ConnectionError/TimeoutError around an iteration and retry
        jobs = await prompts.reclaim(replica_id, min_idle_ms=job_timeout_ms, count=4)   # a dead replica's jobs
        jobs += await prompts.read(replica_id, count=4, block_ms=1000)
        for entry_id, job in jobs:
            exp = await generate_score_and_logprobs(job)
            await experience.publish_and_ack(exp, entry_id)   # None: another replica finished it first

The trainer::

    admission = Admission(redis, run_id, max_staleness, batch_size)
    await admission.restore(ckpt["admission_trained"]); trained_ids = ckpt["trained_job_ids"]
    await experience.recover(CONSUMER)                         # its unacked records come back first
    await prompts.publish_many(jobs[: await admission.free()], admission)   # refused atomically past the bound
    split = drop_trained(await experience.read(CONSUMER, count=n, block_ms=500), trained_ids)
    ... train on split.fresh ...; await admission.set_trained(total)        # retry-safe
    ... checkpoint (weights, trained_ids, total) ...; await experience.ack(ids_since_last_checkpoint)
    await prompts.trim(); await experience.trim()
    packed = await asyncio.to_thread(pack_weights, state_dict, version, parent)
    await push_weights_many(replica_addrs, packed, token=api_token); await admission.publish_policy_version(version)

Status endpoints: ``(await queue_stats(redis, run_id)).as_dict()``.
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
