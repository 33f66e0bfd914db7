"""What an engine without named adapters or per-request raw log-probs (vLLM's) says to a request that asks for them:
a refusal naming the field, instead of an answer that silently ignores it."""

from __future__ import annotations

import json

import pytest

from rlhf.serving.errors import FailedPrecondition, InvalidArgument
from services.rollout.engine import EngineBase
from services.rollout.options import SamplingOptions


class PlainEngine(EngineBase):
    kind = "plain"


@pytest.fixture
def engine(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 100, "max_position_embeddings": 64}))
    return PlainEngine(tmp_path, "plain")


def test_a_named_adapter_is_refused_by_an_engine_without_them(engine):
    with pytest.raises(FailedPrecondition, match="plain replica serves no named adapters") as err:
        engine.validate([[1, 2]], SamplingOptions(adapter="a"))
    assert err.value.field == "adapter"


@pytest.mark.parametrize(
    "opts",
    [
        SamplingOptions(raw_logprobs=True, temperature=0.7),
        SamplingOptions(raw_logprobs=True, top_k=5),
        SamplingOptions(raw_logprobs=True, top_p=0.9),
        SamplingOptions(raw_logprobs=True, repetition_penalty=1.2),
    ],
)
def test_raw_logprobs_of_a_reshaped_distribution_are_refused(engine, opts):
    with pytest.raises(InvalidArgument, match="raw_logprobs") as err:
        engine.validate([[1, 2]], opts)
    assert err.value.field == "raw_logprobs"


def test_raw_logprobs_at_temperature_1_untruncated_or_greedy_are_the_processed_ones(engine):
    assert engine.validate([[1, 2]], SamplingOptions(raw_logprobs=True, top_k=100)).raw_logprobs  # top_k = vocab: off
    assert engine.validate([[1, 2]], SamplingOptions(raw_logprobs=True, temperature=0.0)).raw_logprobs
