"""Protobuf codecs of the stream records, with the checks a record must pass before a consumer sees it.

A record that fails (bytes that do not parse, required fields missing, inconsistent lengths) raises
:class:`MalformedRecord` with a reason; the queues turn that into a dead letter, never into an exception in the
consumer loop. Producers get the same checks as a ``ValueError`` before anything is written.
"""

from __future__ import annotations

import math

from rlhf.v1 import common_pb2, experience_pb2

PromptJob = experience_pb2.PromptJob
Experience = experience_pb2.Experience

MAX_JOB_ID_CHARS = 256


class MalformedRecord(ValueError):
    """A stream record that cannot be used; ``reason`` says why (it is stored with the dead letter)."""

    def __init__(self, reason: str, job_id: str = ""):
        super().__init__(reason)
        self.reason = reason
        # The record's job id when it parsed: the dead letter releases that job's admission slot only if the
        # trainer issued it (a foreign record must not loosen the staleness bound).
        self.job_id = job_id


def _check_common(msg: PromptJob | Experience, run_id: str | None, what: str) -> None:
    if not msg.job_id:
        raise MalformedRecord(f"{what}.job_id is empty")
    if len(msg.job_id) > MAX_JOB_ID_CHARS:
        raise MalformedRecord(f"{what}.job_id is longer than {MAX_JOB_ID_CHARS} characters")
    if run_id is not None and msg.run_id and msg.run_id != run_id:
        raise MalformedRecord(f"{what}.run_id is {msg.run_id!r}, but this stream belongs to run {run_id!r}")


def validate_prompt_job(job: PromptJob, run_id: str | None = None) -> None:
    """Raise MalformedRecord unless ``job`` has a job_id, a prompt (ids or text) and (if set) the right run_id."""
    _check_common(job, run_id, "PromptJob")
    if not job.prompt_ids and not job.prompt_text:
        raise MalformedRecord(f"PromptJob {job.job_id!r} has neither prompt_ids nor prompt_text")
    if job.prompt_ids and min(job.prompt_ids) < 0:
        raise MalformedRecord(f"PromptJob {job.job_id!r} has negative prompt_ids")


def validate_experience(exp: Experience, run_id: str | None = None) -> None:
    """Raise MalformedRecord unless ``exp`` is trainable.

    It needs a job_id, at least one sample, and per sample: as many finite ``sampling_logprobs`` as
    ``response_ids``, ``ref_logprobs`` either empty or as many as ``response_ids``, no negative token ids, and a
    finite score when the score's status is OK (one NaN reward turns every weight into NaN in one update).
    Token ids are checked against the vocabulary where the model is known: :func:`check_token_ids`.
    """
    _check_common(exp, run_id, "Experience")
    if not exp.samples:
        raise MalformedRecord(f"Experience {exp.job_id!r} has no samples")
    for i, s in enumerate(exp.samples):
        n = len(s.response_ids)
        where = f"Experience {exp.job_id!r} samples[{i}]"
        if len(s.sampling_logprobs) != n:
            raise MalformedRecord(f"{where} has {n} response_ids but {len(s.sampling_logprobs)} sampling_logprobs")
        if s.ref_logprobs and len(s.ref_logprobs) != n:
            raise MalformedRecord(f"{where} has {n} response_ids but {len(s.ref_logprobs)} ref_logprobs")
        if n and min(s.response_ids) < 0:
            raise MalformedRecord(f"{where} has negative response_ids")
        # finite sum <=> finite terms (NaN/inf propagate; float32 terms cannot overflow a double): C-speed
        if not math.isfinite(sum(s.sampling_logprobs)) or not math.isfinite(sum(s.ref_logprobs)):
            raise MalformedRecord(f"{where} has non-finite log-probs")
        if s.score_status == common_pb2.ITEM_STATUS_OK and not math.isfinite(s.score):
            raise MalformedRecord(f"{where} has a non-finite score ({s.score}) with status OK")
    if exp.prompt_ids and min(exp.prompt_ids) < 0:
        raise MalformedRecord(f"Experience {exp.job_id!r} has negative prompt_ids")


def check_token_ids(exp: Experience, vocab_size: int) -> None:
    """Raise MalformedRecord unless every prompt and response token id of ``exp`` is in ``[0, vocab_size)``: the
    consumer that knows its model checks this before the record can reach an embedding lookup."""
    if exp.prompt_ids and (min(exp.prompt_ids) < 0 or max(exp.prompt_ids) >= vocab_size):
        bad = next(t for t in exp.prompt_ids if not 0 <= t < vocab_size)
        raise MalformedRecord(
            f"Experience {exp.job_id!r} prompt_ids has token id {bad}, outside the vocabulary [0, {vocab_size})",
            exp.job_id,
        )
    for i, s in enumerate(exp.samples):
        ids = s.response_ids
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise MalformedRecord(
                f"Experience {exp.job_id!r} samples[{i}].response_ids has token id {bad}, outside the vocabulary "
                f"[0, {vocab_size})",
                exp.job_id,
            )


def _decode(cls, data: bytes | None, what: str):
    if data is None:
        raise MalformedRecord(f"the entry has no payload field; expected a serialized {what}")
    msg = cls()
    try:
        msg.ParseFromString(bytes(data))
    except Exception as err:  # DecodeError, or anything else the parser throws at garbage
        raise MalformedRecord(f"payload is not a valid {what} protobuf ({type(err).__name__}: {err})") from None
    return msg


def decode_prompt_job(data: bytes | None, run_id: str | None = None) -> PromptJob:
    job = _decode(PromptJob, data, "PromptJob")
    try:
        validate_prompt_job(job, run_id)
    except MalformedRecord as err:
        raise MalformedRecord(err.reason, job.job_id) from None
    return job


def decode_experience(data: bytes | None, run_id: str | None = None) -> Experience:
    exp = _decode(Experience, data, "Experience")
    try:
        validate_experience(exp, run_id)
    except MalformedRecord as err:
        raise MalformedRecord(err.reason, exp.job_id) from None
    return exp


def encode(msg: PromptJob | Experience) -> bytes:
    return msg.SerializeToString()
