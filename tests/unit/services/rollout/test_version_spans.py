"""Partial rollouts' version spans: a sample joined across a swap (:func:`services.rollout.engine.join_samples`),
its options to go on with (:func:`continue_options`), and its record (:func:`services.rollout.jobs.sample_record`),
which for a sample of one version is byte for byte the record written before spans existed."""

from __future__ import annotations

import pytest

from rlhf.v1 import common_pb2, experience_pb2, reward_pb2
from services.rollout.engine import continue_options, join_samples
from services.rollout.engine_types import Sample
from services.rollout.jobs import sample_record
from services.rollout.options import SamplingOptions
from services.rollout.vllm_engine import _stoppable

# The record of SCORE / sample(spans=None) below as the code before version spans wrote it (rlhf/v1 generated from
# experience.proto without span_starts / span_versions, serialized deterministically)
RECORD_BEFORE_SPANS = bytes.fromhex(
    "0a03050607120c000000bf0000a0bf000000c01a0c000040bf000080bf0000c0bf250000803f28013a0a0a03616363150000803f"
    "400248035203616263"
)
SCORE = reward_pb2.ScoreResult(score=1.0, status=common_pb2.ITEM_STATUS_OK, components={"acc": 1.0})


def sample(spans=None, version=3, tokens=(5, 6, 7), preempted=False, finish="length"):
    n = len(tokens)
    return Sample(
        token_ids=list(tokens),
        logprobs=[-0.5, -1.25, -2.0][:n] + [-0.1] * max(0, n - 3),
        finish_reason=finish,
        text="abc",
        policy_version=version,
        spans=spans,
        preempted=preempted,
    )


def test_a_one_version_record_is_the_record_before_spans():
    ref = [-0.75, -1.0, -1.5]
    one = sample_record(sample(), "abc", SCORE, ref)
    assert one.SerializeToString(deterministic=True) == RECORD_BEFORE_SPANS
    assert not one.span_starts and not one.span_versions
    two = sample_record(sample(spans=[(0, 3), (2, 4)]), "abc", SCORE, ref)
    assert list(two.span_starts) == [0, 2] and list(two.span_versions) == [3, 4]
    back = experience_pb2.Sample.FromString(two.SerializeToString())
    assert (list(back.span_starts), list(back.span_versions), back.policy_version) == ([0, 2], [3, 4], 3)


def test_join_samples_spans_cover_every_token():
    first = sample(tokens=(5, 6), version=3, preempted=True)
    rest = Sample([7, 8, 9], [-0.2, -0.3, -0.4], "stop", "whole text", 4, stop_reason=9)
    j = join_samples(first, rest)
    assert j.token_ids == [5, 6, 7, 8, 9] and j.logprobs == [-0.5, -1.25, -0.2, -0.3, -0.4]
    assert j.spans == [(0, 3), (2, 4)] and j.policy_version == 3
    assert (j.finish_reason, j.stop_reason, j.text, j.preempted) == ("stop", 9, "whole text", False)
    # stopped again, then a third version: three spans, the oldest version is the sample's
    again = join_samples(first, Sample([7], [-0.2], "length", "", 4, preempted=True))
    third = join_samples(again, Sample([8], [-0.3], "length", "", 6))
    assert third.spans == [(0, 3), (2, 4), (3, 6)] and third.policy_version == 3
    # the swap failed (same version): one span, as if never stopped; an empty stretch leaves no span
    assert join_samples(first, Sample([7], [-0.2], "length", "", 3)).spans is None
    empty = join_samples(sample(tokens=(), version=3, preempted=True), Sample([7], [-0.2], "length", "", 4))
    assert empty.spans is None and empty.policy_version == 4


def test_continue_options_keep_the_budget_and_the_options():
    o = SamplingOptions(n=4, max_tokens=100, seed=11, temperature=0.7, stop=("x",), prompt_logprobs=2)
    c = continue_options(o, 2, 30)
    assert (c.n, c.max_tokens, c.prompt_logprobs, c.temperature, c.stop) == (1, 70, None, 0.7, ("x",))
    assert c.seed != continue_options(o, 3, 30).seed != continue_options(o, 2, 31).seed
    assert continue_options(SamplingOptions(max_tokens=5), 0, 1).seed is None


@pytest.mark.parametrize("spans", [None, [(0, 1)]])
def test_one_span_writes_no_span_fields(spans):
    assert not sample_record(sample(spans=spans), "abc", SCORE, [-1.0] * 3).span_starts


class _Detokenizer:
    """vLLM's detokenizer state as :func:`services.rollout.vllm_engine._stoppable` reads it."""

    def __init__(self, tokens: int, text: str):
        self.tokens, self.output_text = tokens, text

    def num_output_tokens(self) -> int:
        return self.tokens


def test_vllm_stops_a_request_after_a_token_and_outside_stop_strings_and_characters():
    """A swap stops a vLLM request (partial rollouts) only once it has a token since its admission, and not where
    its text ends with the start of one of its stop strings (vLLM's check of the resumed request reads the new text
    only, so the stop string would be missed) or inside a character."""
    stops = ("</answer>", "##")
    assert _stoppable(_Detokenizer(3, "the answer is 4"), stops)
    assert not _stoppable(_Detokenizer(0, ""), stops)  # nothing yet: it goes on to its first token
    assert not _stoppable(None, stops)
    for text in ("4 </", "4 </answer", "so #", "4 <"):
        assert not _stoppable(_Detokenizer(4, text), stops), text
        assert _stoppable(_Detokenizer(4, text), ())  # no stop strings: anywhere
    assert _stoppable(_Detokenizer(4, "4 </answer>x"), stops)  # past it (a full stop string ends the request anyway)
    assert not _stoppable(_Detokenizer(2, "caf\ufffd"), ())  # a character cut in two
