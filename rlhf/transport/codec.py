"""Protobuf codecs of the stream records, with the checks a record must pass before a consumer sees it.

A record that fails (bytes that do not parse, a record of the other type, required fields missing, inconsistent
lengths) raises :class:`MalformedRecord` with a reason; the queues turn that into a dead letter, never into an
exception in the consumer loop. Producers get the same checks as a ``ValueError`` before anything is written.
:func:`encode` tags every record (``record_type``): PromptJob and Experience share field numbers and wire types.

Design (the record type, untagged records): docs/reliability.md#the-guarantees ("The queues").
"""

from __future__ import annotations

import math

from google.protobuf import unknown_fields
from google.protobuf.message import Message

from rlhf.v1 import common_pb2, experience_pb2

PromptJob = experience_pb2.PromptJob
Experience = experience_pb2.Experience
RECORD_TYPES = {PromptJob: experience_pb2.RECORD_TYPE_PROMPT_JOB, Experience: experience_pb2.RECORD_TYPE_EXPERIENCE}

MAX_JOB_ID_CHARS = 256

# Bounds on an experience record's numbers: finite but absurd values (a score of 3e38, a log-prob of -3e38) are as
# poisonous as NaN, since they overflow float32 once squared, summed or exponentiated in the losses (GAE, whitening,
# the critic's squared error, importance ratios). Each bound is far outside what a working producer sends.
# Design and reasons: docs/reliability.md#the-guarantees ("Poison records").
MAX_ABS_SCORE = 1e6  # rules score 0/1, reward models tens, environments sums of such; (1e6)**2 x a batch fits float32
LOGPROB_MIN = -1e4  # a sampled token is never below log(float32's tiniest) ~ -104; keeps vLLM's -9999 floor for -inf
LOGPROB_MAX = 0.01  # log p <= 0; the slack is float32 rounding of gather(z) - logsumexp(z) at large |z|


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

    It needs a job_id, at least one sample, and per sample: as many ``sampling_logprobs`` as ``response_ids``,
    ``ref_logprobs`` either empty or as many as ``response_ids``, every log-prob in [LOGPROB_MIN, LOGPROB_MAX], no
    negative token ids, and a score within +-MAX_ABS_SCORE when the score's status is OK (one NaN or 3e38 reward
    turns a step's losses non-finite). The reason names the record, the field and the value.
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
        _check_logprobs(s.sampling_logprobs, f"{where}.sampling_logprobs")
        _check_logprobs(s.ref_logprobs, f"{where}.ref_logprobs")
        if s.score_status == common_pb2.ITEM_STATUS_OK:
            if not math.isfinite(s.score):
                raise MalformedRecord(f"{where} has a non-finite score ({s.score}) with status OK")
            if abs(s.score) > MAX_ABS_SCORE:
                raise MalformedRecord(
                    f"{where}.score is {s.score:g} with status OK, outside [{-MAX_ABS_SCORE:g}, {MAX_ABS_SCORE:g}] "
                    "(MAX_ABS_SCORE): no working scorer gives that"
                )
    if exp.prompt_ids and min(exp.prompt_ids) < 0:
        raise MalformedRecord(f"Experience {exp.job_id!r} has negative prompt_ids")


def _check_logprobs(values, where: str) -> None:
    """Raise MalformedRecord naming the first value of ``values`` that is not a log-prob in [LOGPROB_MIN,
    LOGPROB_MAX]."""
    if not values:
        return
    # finite sum <=> finite terms (NaN/inf propagate; float32 terms cannot overflow a double), then the range: C-speed
    if math.isfinite(sum(values)) and min(values) >= LOGPROB_MIN and max(values) <= LOGPROB_MAX:
        return
    j, v = next((j, v) for j, v in enumerate(values) if not LOGPROB_MIN <= v <= LOGPROB_MAX)  # NaN compares False
    if not math.isfinite(v):
        raise MalformedRecord(f"{where}[{j}] is {v}: non-finite log-probs")
    raise MalformedRecord(
        f"{where}[{j}] is {v:g}, outside [{LOGPROB_MIN:g}, {LOGPROB_MAX:g}] (LOGPROB_MIN, LOGPROB_MAX): not a "
        "log-prob a model produces"
    )


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


def _wire_type_clash(msg: Message) -> str | None:
    """The path of a field whose number ``msg``'s type knows but that arrived with another wire type, if any."""
    known = msg.DESCRIPTOR.fields_by_number
    for f in unknown_fields.UnknownFieldSet(msg):
        if f.field_number in known:
            return known[f.field_number].name
    for fd, value in msg.ListFields():
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue
        for i, sub in enumerate(value if fd.is_repeated else [value]):
            inner = _wire_type_clash(sub)
            if inner is not None:
                return f"{fd.name}[{i}].{inner}" if fd.is_repeated else f"{fd.name}.{inner}"
    return None


def _check_record_type(msg: PromptJob | Experience, what: str) -> None:
    want = RECORD_TYPES[type(msg)]
    got = msg.record_type
    if got == want:
        return
    if got != experience_pb2.RECORD_TYPE_UNSPECIFIED:
        name = experience_pb2.RecordType.Name(got) if got in experience_pb2.RecordType.values() else str(got)
        raise MalformedRecord(
            f"the record is tagged {name}, but {what} records are expected: it was written to the wrong stream"
        )
    clash = _wire_type_clash(msg)
    if clash is not None:
        raise MalformedRecord(
            f"the record is not a {what}: its field {clash} has another wire type (another message's bytes?)"
        )


def _decode(cls, data: bytes | None, what: str):
    if data is None:
        raise MalformedRecord(f"the entry has no payload field; expected a serialized {what}")
    msg = cls()
    try:
        msg.ParseFromString(bytes(data))
    except Exception as err:  # noqa: BLE001 - DecodeError, or whatever the parser throws at garbage
        raise MalformedRecord(f"payload is not a valid {what} protobuf ({type(err).__name__}: {err})") from None
    _check_record_type(msg, what)
    msg.ClearField("record_type")  # a wire-level tag: decoded records equal the messages that were encoded
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


# ``record_type`` (field 15, varint) as wire bytes: appended to a serialized message it sets the field (the last
# value of a scalar wins), so encode() tags a record without touching the caller's message.
_TAGS = {cls: bytes([15 << 3, value]) for cls, value in RECORD_TYPES.items()}


def encode(msg: PromptJob | Experience) -> bytes:
    """The record's bytes, tagged with its type."""
    return msg.SerializeToString() + _TAGS[type(msg)]
