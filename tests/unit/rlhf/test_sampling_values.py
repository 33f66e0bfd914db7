"""actor_rollout as sampling values, decided in one place (ExperimentConfig.sampling_defaults / sample_temperature):
the trainer's prompt jobs, the rollout's request defaults, the trainer's and the reference's log-prob temperature."""

from __future__ import annotations

import pytest

from rlhf.config import parse_config
from services.reference.engine import ReferenceEngine
from services.rollout.options import default_options
from services.trainer.engine import TrainerEngine


@pytest.mark.parametrize(("do_sample", "sampled", "logits"), [(True, 0.7, 0.7), (False, 0.0, 1.0)])
def test_sampling_values_and_the_logprob_temperature(tiny_models, do_sample, sampled, logits):
    cfg = parse_config(
        {
            "training": {"device": "cpu", "seq_length": 96},
            "actor_rollout_ref": {
                "actor_rollout": {
                    "temperature": 0.7,
                    "do_sample": do_sample,
                    "top_k": 5,
                    "max_prompt_length": 32,
                    "stop": ["\n\n"],
                }
            },
        }
    )
    d = cfg.sampling_defaults()
    assert d == {"temperature": sampled, "top_p": 1.0, "top_k": 5, "max_tokens": 64, "stop": ("\n\n",)}
    assert default_options(cfg) == d  # what the rollout service fills unset request fields with
    assert cfg.sample_temperature == logits
    assert TrainerEngine(cfg).temperature == logits
    assert ReferenceEngine(cfg, device="cpu").temperature == logits  # its default when a request names none
