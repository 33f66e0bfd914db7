"""Partial rollouts' version spans: a sample joined across a swap (:func:`services.rollout.engine.join_samples`),
its options to go on with (:func:`continue_options`), its record (:func:`services.rollout.jobs.sample_record`) and an
episode's (:func:`services.rollout.jobs.episode_record`, spans gathered turn by turn), which for one version are byte
for byte the records written before spans existed."""

from __future__ import annotations

import pytest

from rlhf.v1 import common_pb2, experience_pb2, reward_pb2
from services.rollout.engine import continue_options, join_samples
from services.rollout.engine_types import Sample
from services.rollout.episodes import EpisodeResult, _add_spans
from services.rollout.jobs import episode_record, sample_record
from services.rollout.options import SamplingOptions
from services.rollout.vllm_engine import _stoppable

# The record of SCORE / sample(spans=None) below as the code before version spans wrote it (rlhf/v1 generated from
# experience.proto without span_starts / span_versions, serialized deterministically)
RECORD_BEFORE_SPANS = bytes.fromhex(
    "0a03050607120c000000bf0000a0bf000000c01a0c000040bf000080bf0000c0bf250000803f28013a0a0a03616363150000803f"
    "400248035203616263"
)
# The record of episode() below (two turns of version 3) as the code before episodes had spans wrote it
# (JobRunner._episode_sample at bb90ce7, serialized deterministically)
EPISODE_BEFORE_SPANS = bytes.fromhex(
    "0a0605060708090a1218000000bf0000a0bf0000000000000000000000c0000040bf1a18000080be000080bf000040c0000020c00000c0bf"
    "000000bf250000c03f28013a120a0b656e7669726f6e6d656e74150000c03f40014803520d74352d362d372d382d392d31305a0601010000"
    "0101620203036a080000003f0000803f7204646f6e6582010c0a057475726e731500000040"
)
ENV = "python:_environments:Echo"
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


def episode(*turns: tuple[list[tuple[int, int]] | None, int, int]) -> EpisodeResult:
    """An episode of model turns given as (the engine's spans or None, their version, environment tokens after)
    played as episodes.play records them: two tokens a turn (ids from 5 on; log-probs -0.5, -1.25, -2.0, -0.75...)."""
    r = EpisodeResult(prompt_ids=[1, 2], ended_by="done", finish_reason="stop", metrics={"turns": float(len(turns))})
    lps = iter([-0.5, -1.25, -2.0, -0.75, -0.25, -1.5])
    for spans, version, env in turns:
        _add_spans(r, spans or [(0, version)], 2)
        r.response_ids += [5 + len(r.response_ids) + k for k in range(2)]
        r.loss_mask += [True, True]
        r.logprobs += [next(lps), next(lps)]
        r.turn_versions.append(min(v for _, v in spans) if spans else version)
        r.turn_rewards.append(0.5 * len(r.turn_rewards) + 0.5)
        r.response_ids += [5 + len(r.response_ids) + k for k in range(env)]
        r.loss_mask += [False] * env
        r.logprobs += [0.0] * env
    return r


def record_of(r: EpisodeResult) -> experience_pb2.Sample:
    n = len(r.response_ids)
    ref = ([-0.25, -1.0, -3.0, -2.5, -1.5, -0.5] + [-1.0] * n)[:n]
    return episode_record(r, ref, ENV, text="t" + "-".join(map(str, r.response_ids)), version=9)


def test_a_one_version_episode_record_is_the_record_before_spans():
    one = record_of(episode((None, 3, 2), (None, 3, 0)))
    assert one.SerializeToString(deterministic=True) == EPISODE_BEFORE_SPANS
    assert one.policy_version == 3 and not one.span_starts
    # a push between turns: the second turn's tokens are version 4's, the record says so from its first token
    two = record_of(episode((None, 3, 2), (None, 4, 0)))
    assert (list(two.span_starts), list(two.span_versions), two.policy_version) == ([0, 4], [3, 4], 3)
    assert list(two.turn_policy_versions) == [3, 4]


def test_episode_spans_cover_model_and_environment_tokens():
    """A turn a push stopped after its first token (spans of its own), environment tokens taking the version of the
    model token before them, the same version across turns merged, a turn without tokens adding nothing; the
    record's policy_version the oldest model token's."""
    r = episode(([(0, 3), (1, 4)], 3, 3), (None, 4, 1), ([(0, 4), (1, 6)], 4, 0))
    assert r.spans == [(0, 3), (1, 4), (9, 6)]  # tokens 0-1, 5-6, 8-9; environment 2-4, 7
    rec = record_of(r)
    assert (list(rec.span_starts), list(rec.span_versions), rec.policy_version) == ([0, 1, 9], [3, 4, 6], 3)
    assert list(rec.turn_policy_versions) == [3, 4, 4]
    empty = EpisodeResult(prompt_ids=[1])
    _add_spans(empty, [(0, 2)], 0)  # no tokens: no span
    _add_spans(empty, [(0, 2), (3, 5)], 3)  # a last stretch past the turn's tokens: none
    assert empty.spans == [(0, 2)]
    newer = episode((None, 5, 1), ([(0, 5), (1, 2)], 2, 0))  # versions need not rise: the oldest is the minimum
    assert record_of(newer).policy_version == 2


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
