"""``trainer``: ``TrainerEngine`` PPO steps on the device with ``training.bf16``; the config and the batches the
checkpoint phase uses too."""

from __future__ import annotations

import math
import time
from typing import Any

from bench.device_check.common import Record, model_paths, peak_gib, sync


def trainer_config(p: dict[str, Any]):
    from rlhf.config import parse_config  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    policy, reward = model_paths(p)
    t = p["trainer"]
    return parse_config(
        {
            "training": {
                "stage": "ray_ppo",
                "device": p["device"],
                "lr": 1e-4,
                "seed": 7,
                "clip_grad": 1.0,
                "bf16": True,
                "collective_timeout_s": 120,
            },
            "actor_rollout_ref": {
                "actor_rollout": {
                    "load": policy,
                    "engine": "hf",
                    "n_samples_per_prompt": t["n"],
                    "ppo_mini_batch_size": t["mini_batch"],
                    "ppo_epochs": 1,
                    "entropy_coeff": 0.01,
                },
            },
            "critic": {"load": reward, "critic_mini_batch_size": t["mini_batch"], "critic_update_epochs": 1},
            "algorithm": {"kl_ctrl": {"kl_coef": 0.05}},
        }
    )


def experiences(t: dict[str, Any], seed: int) -> list:
    """A PPO batch as the experience stream delivers it: random ids (prompt and response lengths vary a little),
    reference log-probs and scores; some responses end with EOS."""
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    from rlhf.v1 import common_pb2, experience_pb2  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    g = torch.Generator().manual_seed(seed)
    out = []
    for j in range(t["prompts"]):
        prompt = torch.randint(3, 500, (t["prompt_len"] - j % 4,), generator=g).tolist()
        exp = experience_pb2.Experience(job_id=f"s{seed}-j{j}", prompt_ids=[2, *prompt])
        for i in range(t["n"]):
            length = max(2, t["response_len"] - (i + j) % 8)
            ids = torch.randint(3, 500, (length,), generator=g).tolist()
            if (i + j) % 2:
                ids[-1] = 1  # EOS
            ref = (-6.0 - 0.1 * torch.rand(length, generator=g)).tolist()
            score = float(torch.rand((), generator=g))
            exp.samples.add(response_ids=ids, ref_logprobs=ref, score=score, score_status=common_pb2.ITEM_STATUS_OK)
        out.append(exp)
    return out


def run(p: dict[str, Any], rec: Record) -> None:
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    from services.trainer.engine import TrainerEngine  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    cfg = trainer_config(p)
    t0 = time.perf_counter()
    engine = TrainerEngine(cfg)
    rec.put(load_seconds=round(time.perf_counter() - t0, 1), group=engine.group is not None)
    emb = engine.actor.get_input_embeddings().weight
    before = emb.detach().clone()
    seconds, metrics = [], {}
    t = p["trainer"]
    for s in range(t["steps"]):
        batch = experiences(t, seed=s)
        sync(p)
        t0 = time.perf_counter()
        metrics = engine.step(batch)
        sync(p)
        seconds.append(round(time.perf_counter() - t0, 3))
        rec.put(step_seconds=seconds)
    tokens = sum(len(e.prompt_ids) + len(s.response_ids) for e in batch for s in e.samples)
    rec.put(
        rows_per_step=t["prompts"] * t["n"],
        tokens_per_step=tokens,
        tokens_per_s=round(tokens / seconds[-1], 1),
        peak_memory_gib=peak_gib(p),
        metrics={k: round(v, 5) if isinstance(v, float) else v for k, v in metrics.items()},
    )
    rec.check("finite_metrics", all(math.isfinite(v) for v in metrics.values() if isinstance(v, (int, float))))
    rec.check("master_weights_fp32", all(q.dtype == torch.float32 for q in engine.actor.parameters()))
    rec.check("weights_moved", not torch.equal(before, emb.detach()))
    out = engine.actor.get_output_embeddings()
    rec.check("tie_kept", out is not None and out.weight is engine.actor.get_input_embeddings().weight)
    pushed = engine.policy_state_dict()
    rec.put(pushed_dtypes=sorted({str(v.dtype) for v in pushed.values()}), pushed_tensors=len(pushed))
    rec.check("pushed_bf16", all(v.dtype == torch.bfloat16 for v in pushed.values() if v.is_floating_point()))
    rec.check("tie_alias_not_pushed", "lm_head.weight" not in pushed)
