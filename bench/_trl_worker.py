"""TRL 1.12 side of bench.pipeline, run by .venv-parity's Python (TRL cannot share the main environment with vLLM).

``.venv-parity/bin/python bench/_trl_worker.py`` reads one JSON command per line on stdin, trains with TRL and answers
one line ``RESULT {json}`` on stdout per command (anything else on stdout is library chatter). Importing TRL takes a
while, so one worker serves every run of a benchmark. Commands::

    {"algo": "ppo" | "online_dpo", "policy": DIR, "reward": DIR, "prompt_ids": [[...], ...],
     "prompt_texts": [...], "batch": 16, "mini_batch": 8, "epochs": 2, "response_length": 16, "steps": 4,
     "lr": 1e-5, "seed": 1}

- ``ppo``: ``trl.experimental.ppo.PPOTrainer`` with the policy, a frozen copy as reference, the reward model as
  reward and as the critic's start, ``batch`` prompts per update (``per_device_train_batch_size`` = batch,
  ``num_mini_batches`` = batch / mini_batch), ``num_ppo_epochs`` = epochs, ``response_length``, stop at EOS;
- ``online_dpo``: ``trl.experimental.online_dpo.OnlineDPOTrainer``, ``batch`` prompts per step, 2 completions each,
  ``max_new_tokens`` = response_length, the reward model as the judge of the pair.

The answer holds the wall time of every update (between consecutive ``on_step_end`` callbacks, the first measured
from ``on_train_begin``) and the samples (completions) per update.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from trl.experimental.ppo import PPOConfig, PPOTrainer


def _callback(times: list[float]):
    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())

    return Timer()


def run_ppo(c: dict, out_dir: str) -> dict:
    torch.manual_seed(c["seed"])
    tok = AutoTokenizer.from_pretrained(c["policy"])
    policy = AutoModelForCausalLM.from_pretrained(c["policy"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(c["policy"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(c["reward"], num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(c["reward"], num_labels=1, dtype=torch.float32)
    batch, mini = c["batch"], c["mini_batch"]
    n_prompts = batch * c["steps"]
    ids = [c["prompt_ids"][i % len(c["prompt_ids"])] for i in range(n_prompts)]
    args = PPOConfig(
        output_dir=out_dir,
        seed=c["seed"],
        per_device_train_batch_size=batch,  # TRL 1.12: the rollout batch; num_mini_batches splits it
        gradient_accumulation_steps=1,
        num_mini_batches=batch // mini,
        num_ppo_epochs=c["epochs"],
        total_episodes=n_prompts,
        local_rollout_forward_batch_size=batch,
        response_length=c["response_length"],
        stop_token="eos",
        temperature=1.0,
        kl_coef=c.get("kl_coef", 0.05),
        cliprange=0.2,
        cliprange_value=0.2,
        gamma=1.0,
        lam=0.95,
        learning_rate=c["lr"],
        lr_scheduler_type="constant",
        bf16=False,
        fp16=False,
        use_cpu=True,
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    ds = Dataset.from_dict({"input_ids": ids})
    times: list[float] = []
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=ds,
        eval_dataset=ds,
        callbacks=[_callback(times)],
    )
    trainer.train()
    return {"step_seconds": [b - a for a, b in zip(times, times[1:], strict=False)], "samples_per_step": batch}


def run_online_dpo(c: dict, out_dir: str) -> dict:
    torch.manual_seed(c["seed"])
    tok = AutoTokenizer.from_pretrained(c["policy"])
    policy = AutoModelForCausalLM.from_pretrained(c["policy"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(c["policy"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(c["reward"], num_labels=1, dtype=torch.float32)
    batch = c["batch"]
    n_prompts = batch * c["steps"]
    texts = [c["prompt_texts"][i % len(c["prompt_texts"])] for i in range(n_prompts)]
    args = OnlineDPOConfig(
        output_dir=out_dir,
        seed=c["seed"],
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        max_steps=c["steps"],
        beta=0.1,
        loss_type="sigmoid",
        max_new_tokens=c["response_length"],
        max_length=512,
        temperature=1.0,
        learning_rate=c["lr"],
        lr_scheduler_type="constant",
        bf16=False,
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    times: list[float] = []
    trainer = OnlineDPOTrainer(
        model=policy,
        ref_model=ref,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tok,
        reward_processing_classes=tok,
        callbacks=[_callback(times)],
    )
    trainer.train()
    return {"step_seconds": [b - a for a, b in zip(times, times[1:], strict=False)], "samples_per_step": 2 * batch}


def main() -> None:
    # torch's default: OMP_NUM_THREADS if set (bench.pipeline sets it to the cores the ring runs on), else one
    # thread per core
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter goes to stderr; the answers go to the real stdout
    print("RESULT " + json.dumps({"ready": True, "torch_threads": torch.get_num_threads()}), file=out, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        c = json.loads(line)
        try:
            with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
                res = run_ppo(c, tmp) if c["algo"] == "ppo" else run_online_dpo(c, tmp)
        except Exception as err:  # noqa: BLE001 - reported to the benchmark, which fails loudly
            traceback.print_exc()
            res = {"error": f"{type(err).__name__}: {err}"}
        print("RESULT " + json.dumps(res), file=out, flush=True)


if __name__ == "__main__":
    main()
