"""The training service's sampler: the SampleResponse protobuf against the tinker SDK's decoder, the SDK's own
SampleRequest JSON parsed (or refused, naming the field), and top-k / top-p / temperature draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from tinker import types
from tinker._compat import model_dump
from tinker.proto.response_conv import deserialize_sample_response

from rlhf.serving import InvalidArgument, NotFound
from services.training.sampling import SampleSpec, Sequence, _draw, encode_sample_response, parse_sample_request
from services.training.sessions import owner_of


def _sdk_json(params: types.SamplingParams, **kw) -> dict:
    request = types.SampleRequest(
        sampling_session_id="s:sample:0",
        seq_id=1,
        num_samples=kw.pop("num_samples", 2),
        prompt=types.ModelInput.from_ints([3, 4, 5]),
        sampling_params=params,
        **kw,
    )
    return model_dump(request, exclude_unset=False, exclude_none=True, mode="json")


def test_sample_response_reads_back_through_the_sdk():
    seqs = [Sequence([7, 8, 9], [-0.5, -1.25, -2.0], "stop"), Sequence([1], [-3.0], "length")]
    prompt = np.array([np.nan, -1.5, -2.5], dtype=np.float32)
    out = deserialize_sample_response(encode_sample_response(seqs, prompt))
    assert [s.tokens for s in out.sequences] == [[7, 8, 9], [1]]
    assert out.sequences[0].logprobs == [-0.5, -1.25, -2.0]
    assert [s.stop_reason for s in out.sequences] == ["stop", "length"]
    assert out.prompt_logprobs == [None, -1.5, -2.5]
    assert deserialize_sample_response(encode_sample_response(seqs, None)).prompt_logprobs is None


def test_sdk_request_parsed():
    params = types.SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=[2, 9])
    spec = parse_sample_request(_sdk_json(params, prompt_logprobs=True), vocab_size=16, max_length=64)
    assert spec.prompt.tolist() == [3, 4, 5] and spec.num_samples == 2 and spec.max_tokens == 5
    assert (spec.temperature, spec.top_p, spec.top_k, spec.seed) == (0.5, 0.9, 3, 11)
    assert spec.stop_tokens == {2, 9} and spec.prompt_logprobs
    default = parse_sample_request(_sdk_json(types.SamplingParams(max_tokens=1)), 16, 64)
    assert default.stop_tokens is None and default.stop_strings == []  # None: the model's EOS
    assert parse_sample_request(_sdk_json(types.SamplingParams(max_tokens=1, stop=[])), 16, 64).stop_tokens == set()
    strings = parse_sample_request(_sdk_json(types.SamplingParams(max_tokens=1, stop="\n\n")), 16, 64)
    assert strings.stop_strings == ["\n\n"] and strings.stop_tokens is None


@pytest.mark.parametrize(
    ("params", "kw", "field"),
    [
        (types.SamplingParams(), {}, "sampling_params.max_tokens"),
        (types.SamplingParams(max_tokens=4, top_k=0), {}, "sampling_params.top_k"),
        (types.SamplingParams(max_tokens=4, top_p=1.5), {}, "sampling_params.top_p"),
        (types.SamplingParams(max_tokens=4, temperature=-0.1), {}, "sampling_params.temperature"),
        (types.SamplingParams(max_tokens=4, stop=[99]), {}, "sampling_params.stop"),
        (types.SamplingParams(max_tokens=62), {}, "sampling_params.max_tokens"),
        (types.SamplingParams(max_tokens=4), {"topk_prompt_logprobs": 2}, "topk_prompt_logprobs"),
        (types.SamplingParams(max_tokens=4), {"prompt_alt_tokens_k": 1}, "prompt_alt_tokens_k"),
        (types.SamplingParams(max_tokens=4), {"record_stability_info": True}, "record_stability_info"),
        (types.SamplingParams(max_tokens=4), {"num_samples": 0}, "num_samples"),
    ],
)
def test_refused_naming_the_field(params, kw, field):
    with pytest.raises(InvalidArgument) as err:
        parse_sample_request(_sdk_json(params, **kw), vocab_size=16, max_length=64)
    assert err.value.field == field and field.split(".")[-1] in str(err.value)


def test_draws_honour_top_k_top_p_and_temperature():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]).repeat(4000, 1))
    gen = torch.Generator().manual_seed(0)

    def freq(**kw) -> np.ndarray:
        spec = SampleSpec(torch.tensor([1]), 1, 1, **kw)
        return np.bincount(_draw(logits, spec, gen).numpy(), minlength=4) / len(logits)

    assert freq(temperature=0.0).tolist() == [1, 0, 0, 0]
    assert freq(top_k=2)[2:].sum() == 0 and freq(top_k=2)[0] == pytest.approx(0.5 / 0.8, abs=0.03)
    top_p = freq(top_p=0.7)  # 0.5 + 0.3 reach 0.7: the two most likely tokens only
    assert top_p[2:].sum() == 0 and top_p[0] == pytest.approx(0.5 / 0.8, abs=0.03)
    assert freq()[3] == pytest.approx(0.05, abs=0.015)
    hot = freq(temperature=2.0)  # flatter: p ~ sqrt(p)
    assert hot[3] == pytest.approx(math.sqrt(0.05) / sum(map(math.sqrt, [0.5, 0.3, 0.15, 0.05])), abs=0.02)


def test_sampler_from_a_checkpoint_with_no_run_loaded(tiny_models, tmp_path):
    """As after a restart: a sampler checkpoint read into a model that holds no run samples as the run did; when
    its sampler goes, the last adapter leaves the model and a base sampler samples the base again."""
    from services.training.engine import TrainingEngine  # noqa: PLC0415 - torch models
    from services.training.shared_model import LoraSpec  # noqa: PLC0415 - torch models

    owner = owner_of("tml-test")
    e = TrainingEngine("tiny:policy", tmp_path, "cpu")
    e._load()
    spec = SampleSpec(torch.tensor([3, 4, 5]), 2, 4, temperature=0.0, stop_tokens=set(), prompt_logprobs=True)
    e.samplers.bind(owner, "b:sample:0", None, None, None)
    base = e.samplers.sample_job(owner, "b:sample:0", spec)["sample"]
    run = e._new_run(owner, "s:train:0", LoraSpec(4, 1, True, True, True), None)
    e._write_run_json(run)
    with torch.no_grad():
        for p in run.params.values():
            p.add_(0.05)  # B away from zero: the adapter changes the outputs
    e._snapshot_run_job(owner, "s:train:0", "s:sample:0")
    trained = e.samplers.sample_job(owner, "s:sample:0", spec)["sample"]
    assert trained != base
    e._sampler_job(owner, "s:train:0", "ck", {"created": "t0"})
    e.samplers.release("s:sample:0")
    e._unload_job(["s:train:0"], "test")
    assert list(e.model.peft.peft_config) == []
    folder = e.store.sampler_checkpoint(owner, "tinker://s:train:0/sampler_weights/ck")
    e.samplers.bind(owner, "t:sample:0", "p", "ck", lambda: e.samplers.load_checkpoint(folder))
    assert e.samplers.sample_job(owner, "t:sample:0", spec)["sample"] == trained
    e.samplers.release("t:sample:0")
    assert list(e.model.peft.peft_config) == [] and not e.samplers.snapshots
    assert e.samplers.sample_job(owner, "b:sample:0", spec)["sample"] == base
    with pytest.raises(NotFound, match="does not exist"):
        e.store.sampler_checkpoint(owner_of("tml-other"), "tinker://s:train:0/sampler_weights/ck")


def test_stop_strings_end_at_the_token_that_completes_one(tiny_models, tmp_path):
    from services.training.engine import TrainingEngine  # noqa: PLC0415 - torch models

    owner = owner_of("tml-test")
    e = TrainingEngine("tiny:policy", tmp_path, "cpu")
    e._load()
    e.samplers.bind(owner, "b:sample:0", None, None, None)
    free = SampleSpec(torch.tensor([3, 4, 5]), 1, 8, temperature=0.0, stop_tokens=set())
    tokens = deserialize_sample_response(e.samplers.sample_job(owner, "b:sample:0", free)["sample"]).sequences[0].tokens
    decode = e.model.decoder()
    stop = next(decode([t]) for t in tokens[2:] if decode([t]).strip())
    first = next(k for k in range(len(tokens)) if stop in decode(tokens[: k + 1]))
    assert first < len(tokens) - 1
    spec = SampleSpec(torch.tensor([3, 4, 5]), 1, 8, temperature=0.0, stop_strings=[stop])
    seq = deserialize_sample_response(e.samplers.sample_job(owner, "b:sample:0", spec)["sample"]).sequences[0]
    assert seq.tokens == tokens[: first + 1] and seq.stop_reason == "stop"
