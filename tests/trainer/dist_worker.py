"""One trainer update per algorithm in a process of a (torchrun-style) group, for tests/trainer/test_distributed.py.

``python tests/trainer/dist_worker.py OUT [key=value ...]`` with the torchrun environment (``WORLD_SIZE``, ``RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) or none (world size 1). Rank 0 drives as the service does (``engine.step`` sends the
batch; ``policy_state_dict`` gathers the policy; ``stop_followers``), the other ranks ``follow()``. Rank 0 writes
``OUT/<stage>.json`` (metrics) and ``OUT/<stage>.safetensors`` (the policy and, for PPO, the critic after the step).
The batch is made from a fixed seed, the same at every world size: random token ids, reference log-probs and scores.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from rlhf import distributed
from rlhf.config import parse_config
from rlhf.v1 import experience_pb2
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.engine import TrainerEngine
from tests.support import make_experience, make_sample

RUNS = {
    "ray_ppo": {},
    "ray_online_dpo": {},
    "ray_grpo": {"adv_estimator": "grpo"},
    "ray_rloo": {"adv_estimator": "rloo"},
    "ray_reinforce_plus_plus": {"adv_estimator": "reinforce_plus_plus"},
}


def config(stage: str, options: dict) -> object:
    n = 2 if stage == "ray_online_dpo" else 4
    return parse_config(
        {
            "training": {
                "stage": stage,
                "device": "cpu",
                "lr": 5e-3,
                "seed": 7,
                "clip_grad": 1.0,
                "bf16": options.get("bf16", False),
                "activation_checkpointing": options.get("activation_checkpointing", False),
                "collective_timeout_s": 60,
            },
            "actor_rollout_ref": {
                # 6 does not divide the batch: uneven minibatches and uneven shares across ranks
                "actor_rollout": {
                    "n_samples_per_prompt": n,
                    "ppo_mini_batch_size": 6,
                    "ppo_epochs": 2,
                    "entropy_coeff": 0.01,
                },
            },
            "critic": {"critic_mini_batch_size": 6, "critic_update_epochs": 2},
            "algorithm": {"kl_ctrl": {"kl_coef": 0.05}, **RUNS[stage]},
        }
    )


def batch(n: int, prompts: int = 4, vocab: int = 512, seed: int = 3) -> list[experience_pb2.Experience]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(prompts):
        prompt = torch.randint(3, vocab, (2 + j % 3,), generator=g).tolist()
        exp = make_experience(f"j{j}", [2, *prompt])
        for i in range(n):
            length = 3 + (i + j) % 5
            ids = torch.randint(3, vocab, (length,), generator=g).tolist()
            if (i + j) % 2:
                ids[-1] = 1  # EOS on some responses
            ref = (-5 - torch.rand(length, generator=g)).tolist()
            exp.samples.append(make_sample(ids, ref_logprobs=ref, score=float(torch.rand((), generator=g))))
        out.append(exp)
    return out


def full_state(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    """Weights and AdamW moments of actor and critic, gathered and keyed by name (a collective on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict  # noqa: PLC0415 - torch.distributed.checkpoint: seconds to import, the resume mode only

    full = StateDictOptions(full_state_dict=True)
    out = {}
    for role, model, opt in (("actor", engine.actor, engine.actor_opt), ("critic", engine.critic, engine.critic_opt)):
        if model is None:
            continue
        for k, v in model.state_dict().items():
            out[f"{role}.{k}"] = distributed.full_value(v.detach()).clone()
        for name, st in get_optimizer_state_dict(model, opt, options=full)["state"].items():
            for key, v in st.items():
                out[f"{role}_optim.{name}.{key}"] = distributed.full_value(v).clone().reshape(-1).float()
    return out


def resume(out: Path, options: dict[str, str]) -> None:
    """PPO: with ``save=DIR`` one step on batch 1 then a checkpoint into DIR (and the state saved,
    ``saved.safetensors``); with ``load=DIR`` the restored state
    (``restored.safetensors``) and one step on batch 2 (``next.json``, ``next.safetensors``)."""
    cfg = config("ray_ppo", {})
    engine = TrainerEngine(cfg)
    driver = engine.group is None or engine.group.is_driver
    if not driver:
        engine.follow()
    elif "save" in options:
        engine.step(batch(4, seed=3))
        save_checkpoint(options["save"], engine, {"trained_job_ids": ["j0"]})
        engine.stop_followers()
    else:
        load_checkpoint(latest_checkpoint(options["load"]), engine)
        engine.stop_followers()
    state = full_state(engine)  # saved or restored
    if driver:
        save_file(state, out / ("saved.safetensors" if "save" in options else "restored.safetensors"))
    if "save" in options:
        return
    if driver:
        metrics = engine.step(batch(4, seed=5))
        engine.stop_followers()
    else:
        engine.follow()
    after = full_state(engine)
    if driver:
        save_file(after, out / "next.safetensors")
        (out / "next.json").write_text(json.dumps(metrics))


def hang(out: Path, timeout_s: float) -> None:
    """Rank 1 joins late (a slow start must not fail the join) and never enters the collective; rank 0's must fail
    after ``timeout_s``, not wait forever."""
    if os.environ.get("RANK") == "1":
        time.sleep(timeout_s * 1.5)  # longer than the collective timeout: joining is not a collective
    group = distributed.init_from_env(torch.device("cpu"), timeout_s)
    if group.rank == 1:
        time.sleep(timeout_s * 4)
        return
    t0 = time.monotonic()
    try:
        distributed.broadcast_ints([1], 1, torch.device("cpu"))
        error = None
    except RuntimeError as err:
        error = str(err)
    (out / "hang.json").write_text(json.dumps({"error": error, "waited_s": time.monotonic() - t0}))


def main() -> None:
    out = Path(sys.argv[1])
    raw = dict(a.split("=", 1) for a in sys.argv[2:])
    if "hang" in raw:
        hang(out, float(raw["hang"]))
        distributed.destroy()  # a group left to interpreter exit aborts the process (pytorch#179291)
        return
    if "save" in raw or "load" in raw:
        resume(out, raw)
        distributed.destroy(wait_for_peers=True)
        return
    options = {k: v == "1" for k, v in raw.items()}
    stages = [s for s in RUNS if options.get(s, True)]
    for stage in stages:
        cfg = config(stage, options)
        engine = TrainerEngine(cfg)
        if engine.group is None or engine.group.is_driver:
            metrics = engine.step(batch(cfg.actor.n_samples_per_prompt))
            pushed = {f"push.{k}": v for k, v in engine.policy_state_dict().items()}
            engine.stop_followers()
        else:
            engine.follow()
        # the fp32 master weights, gathered: a collective on every rank, outside the command loop
        tensors = {
            f"actor.{k}": distributed.full_value(v.detach()).clone() for k, v in engine.actor.state_dict().items()
        }
        if engine.critic is not None:
            tensors.update(
                {
                    f"critic.{k}": distributed.full_value(v.detach()).clone()
                    for k, v in engine.critic.state_dict().items()
                }
            )
        if engine.group is None or engine.group.is_driver:
            metrics["activation_checkpointing"] = float(engine.actor.is_gradient_checkpointing)
            tensors.update(pushed)
            save_file({k: v.contiguous() for k, v in tensors.items()}, out / f"{stage}.safetensors")
            (out / f"{stage}.json").write_text(json.dumps(metrics))
    distributed.destroy(wait_for_peers=True)


if __name__ == "__main__":
    main()
