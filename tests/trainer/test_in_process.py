"""The in-process step (seed 001's TRL loop, ``step(queries, responses, scores)``) against the ring's step on the
same samples: records built by the ring's parts (the reference service's engine for the reference log-probs, the
experience stream of a real redis-server between them and the trainer) give the same update to 1e-6."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.config import parse_config
from rlhf.reference_logprobs import response_logprobs
from rlhf.transport import ExperienceQueue, connect
from rlhf.v1 import common_pb2, experience_pb2
from services.reference.engine import LogProbsItem, ReferenceEngine
from services.trainer.engine import TrainerEngine
from services.trainer.in_process import InProcessTrainer

TOL = 1e-6
# seed 001's tutorial: LoRA with dropout 0.05, a value head on the policy's own backbone, TRL's whole-vocabulary KL,
# three PPO epochs over minibatches of one sample; and a plain PPO run with a critic of its own, two samples per
# prompt (the records group them) and a sampling temperature other than 1 (the reference's log-probs are at it)
TUTORIAL = {
    "actor_rollout_ref": {
        "actor_rollout": {
            "lora_r": 8,
            "lora_alpha": 16,
            "lora_dropout": 0.05,
            "ppo_epochs": 3,
            "ppo_mini_batch_size": 1,
            "engine": "hf",
        }
    },
    "critic": {"shared_backbone": True},
    "algorithm": {"kl_penalty": "full"},
}
PLAIN = {
    "actor_rollout_ref": {
        "actor_rollout": {"n_samples_per_prompt": 2, "ppo_mini_batch_size": 2, "ppo_epochs": 2, "temperature": 0.7}
    },
    "critic": {"critic_mini_batch_size": 2},
    "algorithm": {"kl_ctrl": {"kl_coef": 0.05}},
}


GRPO = {
    "training": {"stage": "ray_grpo"},
    "actor_rollout_ref": {"actor_rollout": {"n_samples_per_prompt": 2, "ppo_mini_batch_size": 4}},
}


def _config(extra: dict):
    training = {"device": "cpu", "lr": 1e-3, "seed": 11, **extra.get("training", {})}
    return parse_config({"run_id": "inproc", **extra, "training": training})


def _ring_records(cfg, queries, responses, scores, sampling) -> list[experience_pb2.Experience]:
    """The records the ring's trainer reads for these samples: reference log-probs from the reference service's
    engine (at the temperature the rollout worker asks for), published to and read from the experience stream."""
    ref = ReferenceEngine(cfg, device="cpu")
    ref.load()
    items = [LogProbsItem(list(q), list(r)) for q, r in zip(queries, responses, strict=True)]
    ref_rows, _ = asyncio.run(ref.logprobs(items, cfg.sample_temperature))
    n = cfg.actor.n_samples_per_prompt
    records = []
    for j in range(0, len(queries), n):
        exp = experience_pb2.Experience(job_id=f"ring-{j}", run_id=cfg.run_id, prompt_ids=queries[j])
        for i in range(j, j + n):
            exp.samples.add(
                response_ids=responses[i],
                sampling_logprobs=sampling[i],
                ref_logprobs=ref_rows[i],
                score=scores[i],
                score_status=common_pb2.ITEM_STATUS_OK,
                policy_version=0,
            )
        records.append(exp)
    return records


async def _through_the_stream(url: str, run_id: str, records):
    r = connect(url)
    queue = ExperienceQueue(r, run_id)
    for exp in records:
        await queue.publish(exp)
    read = await queue.read("trainer-0", count=len(records), block_ms=1000)
    await r.aclose()
    return [exp for _, exp in read]


def _weights(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    out = {f"actor.{k}": v.detach().clone() for k, v in engine.actor.state_dict().items()}
    if engine.critic is not None:
        out.update({f"critic.{k}": v.detach().clone() for k, v in engine.critic.state_dict().items()})
    return out


@pytest.mark.parametrize("extra", [TUTORIAL, PLAIN, GRPO], ids=["tutorial", "plain_ppo", "grpo"])
def test_the_in_process_step_equals_the_ring_step_on_the_same_samples(tiny_models, redis_server, extra):
    cfg = _config(extra)
    trainer = InProcessTrainer(cfg)
    ring = TrainerEngine(cfg)
    before = _weights(ring)
    assert all(torch.equal(before[k], v) for k, v in _weights(trainer.engine).items())
    n = cfg.actor.n_samples_per_prompt
    torch.manual_seed(3)
    prompts = [[2, 40 + i, 90 + 3 * i, 7 + i] for i in range(4 // n)]
    queries = [p for p in prompts for _ in range(n)]
    t = cfg.actor.temperature
    responses = [
        r.tolist() for r in trainer.generate(queries, max_new_tokens=6, do_sample=True, top_k=0, temperature=t)
    ]
    scores = [float(i % 3) - 0.5 for i in range(len(queries))]
    # the sampling log-probs a replica holding the current weights reports with its samples
    sampling = [
        r.tolist() for r in response_logprobs(ring.actor, queries, responses, ring.pad_id, cfg.sample_temperature, 16)
    ]

    records = asyncio.run(
        _through_the_stream(redis_server.url, cfg.run_id, _ring_records(cfg, queries, responses, scores, sampling))
    )
    ring_metrics = ring.step(records)
    ours = trainer.step([torch.tensor(q) for q in queries], [torch.tensor(r) for r in responses], scores, sampling)

    keys = set(ring_metrics) - {"time/step_s"}
    assert keys == set(ours) - {"time/step_s"}
    assert {"loss/policy", "policy/approxkl"} <= keys
    assert cfg.training.stage != "ray_ppo" or {"loss/value", "objective/kl"} <= keys
    for k in sorted(keys):
        assert ours[k] == pytest.approx(ring_metrics[k], abs=TOL), k
    after_ring, after_ours = _weights(ring), _weights(trainer.engine)
    assert after_ring.keys() == after_ours.keys()
    moved = [k for k in after_ring if not torch.equal(after_ring[k], before[k])]
    assert moved, "the step changed no weight"
    for k in after_ring:
        assert torch.allclose(after_ours[k], after_ring[k], atol=TOL, rtol=0), k


def test_without_sampling_log_probs_the_samples_count_as_drawn_by_the_current_weights(tiny_models):
    """TRL's step takes the responses as the policy's own: no truncated importance sampling, no mismatch measured;
    one record per prompt, the reference's log-probs as the reference service computes them."""
    cfg = _config(PLAIN)
    trainer = InProcessTrainer(cfg)
    queries = [[2, 40, 41], [2, 40, 41], [2, 50], [2, 50]]
    responses = [[60, 61, 1], [62, 1], [70, 71, 72], [73]]
    records = trainer.experiences(queries, responses, [1.0, 0.0, 0.5, 0.25])
    assert [list(r.prompt_ids) for r in records] == [[2, 40, 41], [2, 50]]
    assert [len(r.samples) for r in records] == [2, 2]
    ref = ReferenceEngine(cfg, device="cpu")
    ref.load()
    items = [LogProbsItem(q, r) for q, r in zip(queries, responses, strict=True)]
    want, _ = asyncio.run(ref.logprobs(items, cfg.sample_temperature))
    got = [list(s.ref_logprobs) for r in records for s in r.samples]
    assert len(got) == len(want) and all(g == pytest.approx(w, abs=1e-7) for g, w in zip(got, want, strict=True))
    assert all(not s.sampling_logprobs and s.policy_version == 0 for r in records for s in r.samples)
    metrics = trainer.step(queries, responses, [1.0, 0.0, 0.5, 0.25])
    assert metrics["policy/tis_weight"] == 1.0 and "mismatch/kl" not in metrics
    assert metrics["mismatch/tokens"] == 0
    assert trainer.engine.policy_version == 1


@pytest.fixture(scope="module")
def plain_trainer(tiny_models):
    return InProcessTrainer(_config(PLAIN))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([[2, 3]], [[4]], [1.0, 2.0]), "as many queries, responses and scores"),
        (([[2, 3]], [[]], [1.0]), r"responses\[0\] is empty"),
        (([torch.zeros(1, 2, dtype=torch.long)], [[4]], [1.0]), r"queries\[0\]: a 1-D tensor"),
        (([[2, 3]], [[4]], [float("nan")]), r"scores\[0\] is nan"),
        (([[2, 3]], [[4]], [3e38]), r"scores\[0\] is 3e\+38, outside \[-1e\+06, 1e\+06\]"),
        (([[2, 3]], [[4]], [1.0], [[-3e38]]), r"logprobs\[0\]\[0\] is -3e\+38, outside \[-10000, 0.01\]"),
        (([[2, 3]], [[4]], [torch.ones(2)]), r"scores\[0\]: one number per response"),
        (([[2, 3]], [[10**6]], [1.0]), "outside the vocabulary"),
    ],
)
def test_bad_samples_are_refused_with_what_is_wrong(plain_trainer, args, message):
    trainer = plain_trainer
    with pytest.raises(ValueError, match=message):
        trainer.step(*args)
    assert trainer.engine.policy_version == 0


def test_the_tutorial_example_runs_and_saves_a_plain_policy(tiny_models, tmp_path):
    """examples/trl_tutorial_ppo.py, seed 001's loop as written there, end to end: three steps, the start-up note
    about LoRA dropout, and a policy folder transformers loads as a plain causal LM."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = tmp_path / "rl_model"
    run = subprocess.run(
        [sys.executable, str(root / "examples" / "trl_tutorial_ppo.py"), "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert any("lora_dropout 0.05" in line and "off while training" in line for line in lines)
    steps = [line for line in lines if line.startswith("epoch 0 step ")]
    assert len(steps) == 3 and all("loss/policy" in line for line in steps)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert not any(".lora_" in k for k in model.state_dict())
