"""PromptJob, Sample and Experience records for tests.

Every field a test names is set and every other keeps its proto default, so a record made here equals the one the
same fields would make by hand; the one default that is not the proto's is a sample's ``score_status``
(``ITEM_STATUS_OK``: a scored sample, as the rollout worker publishes it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rlhf.v1 import common_pb2, experience_pb2

SampleLike = experience_pb2.Sample | Mapping[str, Any]


def make_sample(
    response_ids: Iterable[int] = (), *, score_status: int = common_pb2.ITEM_STATUS_OK, **fields: Any
) -> experience_pb2.Sample:
    """A sample of ``response_ids``; ``fields`` are the Sample's others (``ref_logprobs``, ``score``...)."""
    return experience_pb2.Sample(response_ids=response_ids, score_status=score_status, **fields)


def make_experience(
    job_id: str = "",
    prompt_ids: Iterable[int] = (),
    samples: Iterable[SampleLike] = (),
    *,
    job: experience_pb2.PromptJob | None = None,
    **fields: Any,
) -> experience_pb2.Experience:
    """An Experience record. ``samples``: Sample messages, or mappings of :func:`make_sample`'s arguments. ``job``:
    the PromptJob answered, whose ``job_id``, ``run_id``, ``data_index``, ``epoch`` and ``prompt_ids`` the record
    takes (as the rollout worker copies them) unless given here."""
    if job is not None:
        fields = {"run_id": job.run_id, "data_index": job.data_index, "epoch": job.epoch, **fields}
        job_id = job_id or job.job_id
        prompt_ids = prompt_ids or job.prompt_ids
    return experience_pb2.Experience(
        job_id=job_id,
        prompt_ids=prompt_ids,
        samples=[s if isinstance(s, experience_pb2.Sample) else make_sample(**s) for s in samples],
        **fields,
    )


def make_experiences(
    prompts: Sequence[Iterable[int]], samples: Sequence[SampleLike], *, job_prefix: str = "j", **fields: Any
) -> list[experience_pb2.Experience]:
    """One record per prompt, job ids ``f"{job_prefix}{j}"``, with ``len(samples) // len(prompts)`` of ``samples``
    each, in order (prompt 0 the first n): the records a rollout of n samples per prompt publishes."""
    n = len(samples) // len(prompts)
    return [
        make_experience(f"{job_prefix}{j}", prompt, samples[j * n : (j + 1) * n], **fields)
        for j, prompt in enumerate(prompts)
    ]


def make_prompt_job(job_id: str = "", prompt_ids: Iterable[int] = (), **fields: Any) -> experience_pb2.PromptJob:
    """A PromptJob; ``fields`` are its others (``run_id``, ``data_index``, ``params`` as SamplingParams or a mapping,
    ``metadata``...)."""
    return experience_pb2.PromptJob(job_id=job_id, prompt_ids=prompt_ids, **fields)
