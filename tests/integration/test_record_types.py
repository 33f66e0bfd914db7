"""Stream records carry their type: an Experience written to the prompts stream (or a PromptJob to the experience
stream) is dead-lettered, not read as the other type (issue 17.10). Real redis-server (fixture ``redis_server``)."""

from __future__ import annotations

import asyncio

import pytest

from rlhf.transport import ExperienceQueue, PromptQueue, connect, dead_letters
from rlhf.transport.codec import MalformedRecord, decode_experience, decode_prompt_job, encode
from rlhf.transport.keys import PAYLOAD_FIELD
from rlhf.v1 import common_pb2, experience_pb2

RUN = "types"


def job(i: int) -> experience_pb2.PromptJob:
    return experience_pb2.PromptJob(
        job_id=f"job-{i}",
        run_id=RUN,
        prompt_ids=[1, 2, 3],
        params=common_pb2.SamplingParams(n=2, stop=["x"]),
        label="4",
    )


def experience(i: int) -> experience_pb2.Experience:
    sample = experience_pb2.Sample(response_ids=[7, 8], sampling_logprobs=[-0.5, -1.0], score=1.0)
    return experience_pb2.Experience(
        job_id=f"job-{i}", run_id=RUN, prompt_ids=[1, 2, 3], samples=[sample], replica_id="r1", issued_policy_version=2
    )


def test_codec_refuses_the_other_record_type_and_reads_untagged_records():
    # tagged (what encode writes now): the other type is refused by its tag
    with pytest.raises(MalformedRecord, match="RECORD_TYPE_EXPERIENCE"):
        decode_prompt_job(encode(experience(1)))
    with pytest.raises(MalformedRecord, match="RECORD_TYPE_PROMPT_JOB"):
        decode_experience(encode(job(1)))
    # untagged (written before the tag): still read as their own type ...
    assert decode_prompt_job(job(2).SerializeToString()) == job(2)
    assert decode_experience(experience(2).SerializeToString()) == experience(2)
    # ... and an untagged Experience read as a PromptJob is refused by its wire types
    with pytest.raises(MalformedRecord, match="another wire type"):
        decode_prompt_job(experience(3).SerializeToString())
    # the tag is on the wire only: encoding leaves the message alone and decoding gives it back equal
    original = job(4)
    tagged = encode(original)
    assert original == job(4) and experience_pb2.PromptJob.FromString(tagged).record_type == 1
    assert decode_prompt_job(tagged) == job(4)


def test_codec_bounds_scores_and_logprobs():
    """Issue 46.5: finite but absurd numbers are refused naming the field; the values producers really send pass (a
    log-prob a hair above 0 from float rounding, vLLM's -9999 floor, a score of 1e6, any score of a failed item)."""

    def with_sample(**fields):
        exp = experience(5)
        sample = exp.samples[0]
        sample.score_status = common_pb2.ITEM_STATUS_OK
        for name, value in fields.items():
            if isinstance(value, list):
                getattr(sample, name)[:] = value
            else:
                setattr(sample, name, value)
        return exp

    for fine in (
        {"sampling_logprobs": [0.0, -9999.0], "ref_logprobs": [0.005, -1e4]},
        {"score": -1e6},
        {"score": 3e38, "score_status": common_pb2.ITEM_STATUS_SCORER_ERROR},  # not trained on: its score is unused
    ):
        assert decode_experience(encode(with_sample(**fine))) == with_sample(**fine)
    for bad, reason in (
        ({"score": 3e38}, r"samples\[0\]\.score is 3e\+38 with status OK, outside \[-1e\+06, 1e\+06\]"),
        ({"score": -1.5e6}, r"samples\[0\]\.score is -1\.5e\+06"),
        ({"ref_logprobs": [-1.0, -3e38]}, r"samples\[0\]\.ref_logprobs\[1\] is -3e\+38, outside \[-10000, 0\.01\]"),
        ({"ref_logprobs": [-10001.0, -1.0]}, r"samples\[0\]\.ref_logprobs\[0\] is -10001"),
        ({"sampling_logprobs": [-0.5, 0.02]}, r"samples\[0\]\.sampling_logprobs\[1\] is 0\.02"),
        ({"sampling_logprobs": [float("nan"), -1.0]}, r"samples\[0\]\.sampling_logprobs\[0\] is nan: non-finite"),
    ):
        with pytest.raises(MalformedRecord, match=r"^Experience 'job-5' " + reason) as err:
            decode_experience(encode(with_sample(**bad)))
        assert err.value.job_id == "job-5"


def test_wrong_records_in_the_streams_are_dead_lettered(redis_server):
    async def body():
        r = connect(redis_server.url)
        try:
            pq, eq = PromptQueue(r, RUN), ExperienceQueue(r, RUN)
            await pq.publish(job(0))
            await r.xadd(pq.stream, {PAYLOAD_FIELD: encode(experience(9))})  # an Experience in the prompts stream
            await r.xadd(pq.stream, {PAYLOAD_FIELD: experience(8).SerializeToString()})  # untagged, too
            await pq.publish(job(1))
            got = await pq.read("r1", count=10, block_ms=100)
            assert [j.job_id for _, j in got] == ["job-0", "job-1"]
            await r.xadd(eq.stream, {PAYLOAD_FIELD: encode(job(7))})  # a PromptJob in the experience stream
            await eq.publish(experience(0))
            got = await eq.read("trainer", count=10, block_ms=100)
            assert [e.job_id for _, e in got] == ["job-0"]
            reasons = [d["reason"] for d in await dead_letters(r, RUN)]
            assert sum("RECORD_TYPE_EXPERIENCE" in x for x in reasons) == 1, reasons
            assert sum("another wire type" in x for x in reasons) == 1, reasons
            assert sum("RECORD_TYPE_PROMPT_JOB" in x for x in reasons) == 1, reasons
        finally:
            await r.aclose()

    asyncio.run(body())
