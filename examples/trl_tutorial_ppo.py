"""Seed 001's TRL tutorial (PPOTrainer with LoRA, 4-bit base, a value head on the policy and its own loop of
``generate`` -> score -> ``ppo_trainer.step(queries, responses, scores)``), step by step, on this project's trainer
in one process (services.trainer.in_process), with the tiny models rlhf.tiny builds (nothing is downloaded).

    python examples/trl_tutorial_ppo.py                  # about 30 s on a CPU
    python examples/trl_tutorial_ppo.py --load-in-4bit   # QLoRA, as the tutorial (needs the qlora extra)

What differs from the tutorial, and why: docs/in-process.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from rlhf.models import load_sequence_classifier, resolve_model_path, score_head_outputs
from services.trainer.in_process import InProcessTrainer

QUERIES = [
    "how do plants grow",
    "tell me about the sea",
    "what is a good breakfast",
    "why is the sky blue",
    "name a fast animal",
    "describe a quiet morning",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load-in-4bit", action="store_true", help="QLoRA: the policy's base in 4 bits (bitsandbytes)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the queries")
    parser.add_argument("--out", default=None, help="where to save the trained policy (default: a temporary folder)")
    args = parser.parse_args()
    torch.manual_seed(0)

    # 1. the model, its LoRA adapters (peft's LoraConfig) and, with --load-in-4bit, the 4-bit base
    #    (BitsAndBytesConfig: nf4, double quantization, bf16 compute); the value head on the policy's own
    #    backbone (AutoModelForCausalLMWithValueHead): critic.shared_backbone
    lora = {
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,  # accepted; off during RL, as TRL turns dropout off (a start-up note says so)
        "lora_target_modules": ["q_proj", "v_proj", "k_proj", "o_proj", "gate_proj", "down_proj", "up_proj"],
        "lora_sync": "merged",
    }
    if args.load_in_4bit:
        lora.update(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)
        lora.update(bnb_4bit_compute_dtype="bfloat16")
    # 2. PPOConfig(kl_penalty="full", ppo_epochs=3, batch_size=2, mini_batch_size=1), with the rest of that
    #    PPOConfig's defaults (learning_rate 1.41e-5, an adaptive KL controller from 0.2 toward 6, lam 0.95,
    #    vf_coef 0.1)
    cfg = {
        "run_id": "trl-tutorial",
        "training": {"device": "cpu", "global_batch_size": 2, "lr": 1.41e-5, "seed": 0},
        "actor_rollout_ref": {
            "actor_rollout": {"load": "tiny:policy", "ppo_epochs": 3, "ppo_mini_batch_size": 1, "engine": "hf", **lora}
        },
        "critic": {"shared_backbone": True, "vf_coef": 0.1},
        "algorithm": {
            "kl_penalty": "full",
            "kl_ctrl": {"type": "adaptive", "kl_coef": 0.2, "target_kl": 6.0, "horizon": 10000},
            "lam": 0.95,
        },
    }
    trainer = InProcessTrainer(cfg)
    for note in trainer.cfg.notes:
        print("note:", note)
    tokenizer = trainer.tokenizer

    # 3. the reward model. The tutorial scores with a reward adapter on the same base (reward_adapter, not built
    #    here: docs/status.md); this scores with a reward model of its own, at the last token, as
    #    compute_reward_score(input_ids)[0, -1, 0] does
    reward_model = load_sequence_classifier(resolve_model_path("tiny:reward")).eval()

    # 4. the queries (the tutorial reads them from queries.json, one {"query": ...} per line)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "queries.json"
        data.write_text("".join(json.dumps({"query": q}) + "\n" for q in QUERIES))
        items = [json.loads(line) for line in data.read_text().splitlines()]
    batch_size = trainer.cfg.training.global_batch_size

    # 5. the loop: generate, score, step
    generation_kwargs = {"top_k": 0, "top_p": 1.0, "do_sample": True, "max_new_tokens": 32}
    for epoch in range(args.epochs):
        for start in range(0, len(items), batch_size):
            batch = items[start : start + batch_size]
            query_tensors = [tokenizer(item["query"], return_tensors="pt")["input_ids"].squeeze(0) for item in batch]
            response_tensors = trainer.generate(query_tensors, **generation_kwargs)
            scores = []
            with torch.no_grad():
                for query, response in zip(query_tensors, response_tensors, strict=True):
                    input_ids = torch.cat([query, response]).unsqueeze(0)
                    scores.append(score_head_outputs(reward_model, input_ids, tokenizer.pad_token_id)[0, -1])
            stats = trainer.step(query_tensors, response_tensors, scores)
            print(
                f"epoch {epoch} step {stats['step']}: reward {stats['reward/mean']:+.3f} "
                f"loss/policy {stats['loss/policy']:+.4f} loss/value {stats['loss/value']:.4f} "
                f"kl {stats['objective/kl']:.2e} kl_coef {stats['kl_coef']:.4f}"
            )

    # 6. save the trained policy (a LoRA policy merged into its base: a plain Hugging Face folder)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="rl_model-"))
    trainer.save_pretrained(out)
    print(f"saved the policy to {out}")


if __name__ == "__main__":
    main()
