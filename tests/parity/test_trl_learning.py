"""``bench._trl_learning`` (the TRL side of the learning comparison) on reverse_words: two GRPO steps with a greedy
evaluation after each, run as the benchmark runs it (a subprocess of this interpreter).

Checks the result's shape (one JSON line on stdout), that TRL's own prompt tokenization gives ``encode_prompt``'s ids,
and that the step-0 pass@1 is what a plain greedy decode of the warm-started policy (one prompt at a time, argmax
until EOS, no padding) scores with the same rule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from bench._trl_learning import CPU_ARGS, conversation, train_records
from rlhf.config import load_config
from rlhf.data import encode_prompt, load_eval_prompts
from rlhf.models import resolve_model_path
from services.reward.rules import RULES

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/learn-reverse-words.yaml"
GREEDY = ["eval.interval=1", "eval.n=1", "eval.temperature=0", "eval.before_training=true"]


@pytest.fixture(scope="module")
def cfg():
    return load_config(ROOT / CONFIG, GREEDY)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("trl_learning") / "result.json"
    cmd = [sys.executable, "-m", "bench._trl_learning", "--config", CONFIG, "--algo", "grpo", "--seed", "1"]
    cmd += ["--steps", "2", "--threads", "1", "--out", str(out)] + [a for s in GREEDY for a in ("--set", s)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"stdout must be one JSON line, got {len(lines)}: {proc.stdout[:2000]}"
    data = json.loads(lines[0])
    assert json.loads(out.read_text()) == data
    return data


def test_result_shape(result):
    assert (result["side"], result["trl_version"], result["algo"]) == ("trl", "1.12.0", "grpo")
    assert (result["task"], result["seed"], result["threads"], result["steps"]) == ("reverse_words", 1, 1, 2)
    assert result["optimizer_steps_per_step"] == 2  # 16 prompts x 8 samples in minibatches of 64
    hp = result["hyperparameters"]
    assert (hp["per_device_train_batch_size"], hp["steps_per_generation"], hp["num_generations"]) == (64, 2, 8)
    assert (hp["max_steps"], hp["lr_scheduler_type"], hp["beta"], hp["loss_type"]) == (4, "constant", 0.001, "dapo")
    assert set(result["mapping"]) == set(hp)
    curve = result["curve"]
    assert [p["step"] for p in curve] == [0, 1, 2]
    assert [p["samples"] for p in curve] == [0, 128, 256]
    assert curve[0]["seconds"] == 0.0 and curve[0]["seconds"] < curve[1]["seconds"] <= curve[2]["seconds"]
    assert all(0.0 <= p["pass@1"] <= 1.0 and 0.0 <= p["reward_mean"] <= 1.0 for p in curve)
    assert [r["step"] for r in result["train_reward"]] == [1, 2]
    assert result["samples_total"] == 256 and result["prompt_ids_checked"] > 0
    assert result["seconds_total"] >= curve[-1]["seconds"]
    assert result["eval_seconds_total"] > 0


def test_trl_prompt_ids_are_encode_prompts(cfg, tmp_path):
    path = str(resolve_model_path(cfg.actor.load))
    tok = AutoTokenizer.from_pretrained(path)
    records = train_records(cfg, 32) + load_eval_prompts(cfg)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8, **CPU_ARGS)
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": conversation(r)} for r in records]),
        processing_class=tok,
    )
    trl_ids = trainer._tokenize_prompts([conversation(r) for r in records])[0]
    ours = [encode_prompt(tok, r.prompt, cfg.actor.max_prompt_length) for r in records]
    assert [list(i) for i in trl_ids] == ours
    assert len({len(i) for i in ours}) > 1  # prompts of several lengths (left padding in a batch)


@torch.no_grad()
def greedy(model, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos:
            break
    return out


def test_step0_pass_at_1_is_an_independent_greedy_decode(result, cfg):
    path = resolve_model_path(cfg.actor.load)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rule = RULES[cfg.reward.scorers[0].name]
    passed, rewards = 0, []
    for r in load_eval_prompts(cfg):
        ids = encode_prompt(tok, r.prompt, cfg.actor.max_prompt_length)
        text = tok.decode(greedy(model, ids, cfg.max_new_tokens, tok.eos_token_id), skip_special_tokens=True)
        rewards.append(rule(r.prompt, text, r.label))
        passed += rewards[-1] >= cfg.eval.pass_threshold
    step0 = result["curve"][0]
    assert step0["pass@1"] == pytest.approx(passed / len(rewards), abs=1e-12)
    assert step0["reward_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-9)
