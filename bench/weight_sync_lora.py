"""``python -m bench.weight_sync --lora``: a LoRA actor's push to vLLM as the adapter alone
(``actor_rollout.lora_sync: adapter``) against the merged model (``merged``), at rank 16 on all seven linear modules.

Pushes: two real rollout services (``rlhf serve rollout``, vLLM engine, fp32, data plane on), one started for each
kind, get ``PUSHES`` pushes each of a LoRA-wrapped ``small`` policy whose B matrices are redrawn before every push
(as training moves them): the adapter tensors to one, the merged model to the other, over the TCP data plane.
Figures per push: bytes on the wire, the push call's seconds (send, the replica's staging and swap, its answer), the
replica's staging and swap seconds. Each replica answers the pushed checksum (asserted).

Ring: the benchmark ring of ``bench.pipeline`` (PPO, small, synchronous, vLLM rollout) with the LoRA actor, once
per kind, twice, interleaved, ``RING_STEPS`` steps after the first each time: samples/s of each (pooled), at the
same cores and threads.
"""

from __future__ import annotations

import time
from typing import Any

from bench._common import (
    CACHE,
    RedisServer,
    ServiceProc,
    build_model,
    emit,
    log,
    median,
    param_count,
    rnd,
    rollout_threads,
    scorer_services,
    side,
    write_yaml,
)
from bench.pipeline import experiment, run_ours
from rlhf.lora import adapter_push_state_dict, merged_state_dict, wrap_lora
from rlhf.models import load_causal_lm
from rlhf.transport.weights import pack_weights, push_weights

RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PUSHES = 5
RING_STEPS = 4
RING_ROUNDS = 2
TOKEN = "bench-weight-sync-lora"


def _lora(kind: str) -> dict[str, Any]:
    return {"lora_r": RANK, "lora_alpha": ALPHA, "lora_target_modules": TARGETS, "lora_sync": kind}


async def _pushes(paths, log_dir) -> dict[str, list[dict[str, Any]]]:
    import torch  # noqa: PLC0415 - torch loads after bench._common sets OMP_*

    model = wrap_lora(load_causal_lm(paths.policy), RANK, ALPHA, TARGETS)
    g = torch.Generator().manual_seed(0)
    rows: dict[str, list[dict[str, Any]]] = {}
    for kind in ("adapter", "merged"):
        cfg = write_yaml(
            log_dir / f"weight_sync_lora-{kind}.yaml",
            {
                "run_id": f"bench-ws-lora-{kind}",
                "training": {"device": "cpu", "seq_length": 128},
                "actor_rollout_ref": {
                    "actor_rollout": {"load": str(paths.policy), "engine": "vllm", "max_new_tokens": 8, **_lora(kind)}
                },
            },
        )
        env = {
            "RLHF_API_TOKEN": TOKEN,
            "RLHF_REDIS_URL": None,
            "RLHF_ROLLOUT_ENGINE": "vllm",
            "RLHF_WEIGHTS_DATA_PORT": "0",
            "OMP_NUM_THREADS": str(rollout_threads("vllm")),
        }
        out = []
        with ServiceProc("rollout", cfg, log_dir, env=env) as svc:
            for version in range(1, PUSHES + 1):
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if ".lora_B." in name:
                            p.copy_(0.01 * torch.randn(p.shape, generator=g))
                weights = adapter_push_state_dict(model) if kind == "adapter" else merged_state_dict(model)
                t0 = time.perf_counter()
                packed = pack_weights({k: v.contiguous() for k, v in weights.items()}, version)
                pack_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                resp = await push_weights(svc.grpc_addr, packed, token=TOKEN, transport="tcp")
                push_s = time.perf_counter() - t0
                if not (resp.swapped and resp.version == version and resp.checksum == packed.checksum):
                    raise RuntimeError(f"{kind} push of version {version} not served: {resp}")
                out.append(
                    {
                        "version": version,
                        "bytes": resp.bytes_received,
                        "pack_s": rnd(pack_s),
                        "push_s": rnd(push_s),
                        "replica_stage_s": rnd(resp.stage_seconds),
                        "replica_swap_s": rnd(resp.swap_seconds),
                    }
                )
                log(f"{kind} push {version}: {resp.bytes_received} B in {push_s:.3f} s")
        rows[kind] = out
    return rows


def _rings(paths, work) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    with RedisServer(work / "redis") as redis:
        cfg = write_yaml(work / "services.yaml", experiment("small", paths, "ppo", 0, "bench-lora", work, 1))
        with scorer_services(cfg, work / "logs", {"RLHF_REDIS_URL": redis.url}) as (reward, reference):
            for kind in ("adapter", "merged") * RING_ROUNDS:  # interleaved: a load change hits both kinds
                res = run_ours(
                    "small", paths, "ppo", 0, redis.url, reward, reference, work, RING_STEPS,
                    engine="vllm", actor=_lora(kind),
                )  # fmt: skip
                log(f"ring with {kind} pushes: {res['samples_per_s']:.2f} samples/s")
                row = out.setdefault(kind, {"samples": 0, "seconds": 0.0, "step_seconds": []})
                row["samples"] += res["samples"]
                row["seconds"] += res["seconds"]
                row["step_seconds"] += res["step_seconds"]
    for row in out.values():
        row["samples_per_s"] = rnd(row["samples"] / row["seconds"])
        row["seconds"] = rnd(row["seconds"])
    return out


async def lora_bench() -> None:
    started = time.monotonic()
    import torch  # noqa: PLC0415 - torch loads after bench._common sets OMP_*

    paths = build_model("small")
    work = CACHE / "weight_sync_lora"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    log(f"bench.weight_sync --lora: small policy, rank {RANK} on {len(TARGETS)} modules, {PUSHES} pushes each")
    pushes = await _pushes(paths, work / "logs")
    rings = _rings(paths, work)

    def summary(rs: list[dict[str, Any]]) -> dict[str, float | None]:
        return {"bytes": median([r["bytes"] for r in rs]), "push_s": rnd(median([r["push_s"] for r in rs]))}

    a, m = summary(pushes["adapter"]), summary(pushes["merged"])
    emit(
        "weight_sync_lora",
        settings={
            "resources": {
                "trainer": side(torch.get_num_threads(), "this process: pack_weights and the push call"),
                "replica": side(rollout_threads("vllm"), "rlhf serve rollout, vLLM engine, fp32, data plane on"),
            },
            "policy": "small",
            "policy_parameters": param_count(paths.policy),
            "lora": {"r": RANK, "alpha": ALPHA, "target_modules": TARGETS},
            "pushes": PUSHES,
            "transport": "tcp (the data plane), loopback",
            "ring": f"bench.pipeline's PPO ring, small, synchronous, vLLM rollout, {RING_ROUNDS} runs per kind "
            f"interleaved, {RING_STEPS} steps after the first in each",
        },
        figures={"pushes": pushes, "rings": rings},
        ratio={
            "bytes_adapter_vs_merged": rnd(a["bytes"] / m["bytes"], 4),
            "push_s_adapter_vs_merged": rnd(a["push_s"] / m["push_s"]),
            "ring_samples_per_s_adapter_vs_merged": rnd(
                rings["adapter"]["samples_per_s"] / rings["merged"]["samples_per_s"]
            ),
            "median_bytes": {"adapter": a["bytes"], "merged": m["bytes"]},
            "median_push_s": {"adapter": a["push_s"], "merged": m["push_s"]},
        },
        notes=[
            "push_s: the push call, from the first byte sent to the replica's answer (it answers after the swap)",
            "adapter: the replica writes the adapter folder and loads it into vLLM (add_lora) while generation goes "
            "on; merged: vLLM's weight-transfer API loads the whole model (the swap gate pauses generation)",
            "ring: the same PPO ring with lora_sync adapter and merged; a synchronous ring waits for each push, and "
            "with adapters vLLM also runs the LoRA layers at every decoded token (its CPU LoRA kernels), which the "
            "merged model does not: which wins depends on the model's size against the decoding work",
        ],
        started=started,
        command="python -m bench.weight_sync --lora",
    )


if __name__ == "__main__":
    import asyncio

    asyncio.run(lora_bench())
