"""``python -m bench.weight_sync --delta``: delta pushes against full pushes, per optimizer step, at two learning rates.

The trainer's side runs here: the policy (``small``, ~21M parameters, built by rlhf.tiny) in fp32 master weights
with AdamW, a few optimizer steps on random token batches (next-token loss) at lr 5e-7 and at 1e-5; after each
step the weights are cast to bf16 (as the trainer's export does with ``training.bf16``), packed and sealed
(``pack_weights``), and pushed twice to the same replica: once as a delta against the update the replica holds
(``make_delta`` + ``push_weights(delta=...)``), then in full (the same bytes under the next version: the base of the
next step's delta). The replica is the real rollout service (``rlhf serve rollout``, hf engine, bf16, its own
process, data plane on) over the TCP data plane, as ``bench.weight_sync`` measures.

Figures per learning rate and step: the fraction of bf16 elements that changed since the last push, bytes on the
wire, the push call's seconds (delta: plus the trainer's ``make_delta``), the replica's staging time (receive,
rebuild on the base, sha256 of the rebuilt buckets and parse). The replica checks every rebuilt bucket against the
full update's sha256 and answers the full update's checksum: asserted equal here for every delta push.
"""

from __future__ import annotations

import time
from typing import Any

from safetensors import safe_open

from bench._common import (
    CACHE,
    ServiceProc,
    build_model,
    emit,
    log,
    median,
    param_count,
    rnd,
    rollout_threads,
    side,
    write_yaml,
)
from rlhf.transport.weights import PackedWeights, pack_weights, push_weights
from rlhf.transport.weights.delta import make_delta
from rlhf.v1 import weights_pb2

LRS = (5e-7, 1e-5)
STEPS = 4
BATCH, SEQ = 8, 64
TOKEN = "bench-weight-sync-delta"


async def delta_bench(size: str = "small") -> None:
    started = time.monotonic()
    import torch  # noqa: PLC0415 - torch loads after bench._common sets OMP_*
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers loads torch: after bench._common sets OMP_*

    torch.manual_seed(0)
    paths = build_model(size)
    n_params = param_count(paths.policy)
    with safe_open(str(next(paths.policy.glob("*.safetensors"))), framework="pt") as st:
        names = list(st.keys())  # the checkpoint layout the replica expects (tied lm_head: not listed)
    log_dir = CACHE / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg = write_yaml(
        log_dir / "weight_sync_delta-rollout.yaml",
        {
            "run_id": "bench-ws-delta",
            "training": {"device": "cpu", "seq_length": 128},
            "actor_rollout_ref": {
                "actor_rollout": {"load": str(paths.policy), "engine": "hf", "max_new_tokens": 8, "dtype": "bfloat16"}
            },
        },
    )
    env = {
        "RLHF_API_TOKEN": TOKEN,
        "RLHF_REDIS_URL": None,
        "RLHF_ROLLOUT_ENGINE": "hf",
        "RLHF_WEIGHTS_DATA_PORT": "0",
        "OMP_NUM_THREADS": str(rollout_threads("hf")),
    }
    version = 0
    rows: dict[str, list[dict[str, Any]]] = {}
    log(f"bench.weight_sync --delta: policy {n_params / 1e6:.1f}M parameters, lr {LRS}, {STEPS} steps each")
    with ServiceProc("rollout", cfg, log_dir, env=env) as svc:

        async def push(packed: PackedWeights, delta: PackedWeights | None = None) -> tuple[Any, float]:
            t0 = time.perf_counter()
            resp = await push_weights(svc.grpc_addr, packed, token=TOKEN, transport="tcp", delta=delta)
            return resp, time.perf_counter() - t0

        def as_version(p: PackedWeights, v: int) -> PackedWeights:
            h = weights_pb2.WeightHeader()
            h.CopyFrom(p.header)
            h.version, h.parent_version = v, v - 1
            return PackedWeights(h, p.buckets)

        for lr in LRS:
            model = AutoModelForCausalLM.from_pretrained(paths.policy, torch_dtype=torch.float32)
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=lr)
            vocab = model.config.vocab_size

            def snapshot(model=model) -> dict[str, torch.Tensor]:
                sd = model.state_dict()
                return {k: sd[k].detach().to(torch.bfloat16).contiguous() for k in names}

            version += 1
            held = pack_weights(snapshot(), version)
            held.header.keep_base = True
            resp, _ = await push(held)  # the replica's base: the weights before training
            assert resp.version == version, resp
            prev = snapshot()
            out: list[dict[str, Any]] = []
            for step in range(1, STEPS + 1):
                ids = torch.randint(0, vocab, (BATCH, SEQ))
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                now = snapshot()
                changed = sum(int((now[k].view(torch.int16) != prev[k].view(torch.int16)).sum()) for k in names)
                total = sum(now[k].numel() for k in names)
                prev = now
                t0 = time.perf_counter()
                new = pack_weights(now, version + 1)
                new.header.keep_base = True
                pack_s = time.perf_counter() - t0
                row: dict[str, Any] = {"step": step, "changed_fraction": changed / total, "pack_s": pack_s}
                # the delta first: its base is the previous step's update, which the replica holds; then the same
                # bytes in full under the next version (the next step's delta applies to that one: the same bytes)
                for which in ("delta", "full"):
                    version += 1
                    p = as_version(new, version)
                    if which == "delta":
                        t0 = time.perf_counter()
                        delta, stats = make_delta(held, p)
                        encode_s = time.perf_counter() - t0
                        resp, push_s = await push(p, delta)
                        sent_delta = delta is not None and resp.bytes_received == delta.total_bytes
                        row["delta"] = {
                            "bytes": resp.bytes_received,
                            "encode_s": encode_s,
                            "push_s": push_s,
                            "encode_plus_push_s": encode_s + push_s,
                            "replica_stage_s": resp.stage_seconds,
                            "replica_swap_s": resp.swap_seconds,
                            "delta_buckets": stats.delta_buckets,
                            "buckets": stats.buckets,
                            "sent_as_delta": sent_delta,
                        }
                    else:
                        resp, push_s = await push(p)
                        row["full"] = {
                            "bytes": resp.bytes_received,
                            "push_s": push_s,
                            "replica_stage_s": resp.stage_seconds,
                            "replica_swap_s": resp.swap_seconds,
                        }
                    # the replica rebuilt and checked the update: it serves the full update's checksum
                    if not (resp.swapped and resp.version == version and resp.checksum == new.checksum):
                        raise RuntimeError(f"{which} push of version {version} not served as the full update: {resp}")
                    held = p
                log(
                    f"lr {lr:g} step {step}: {row['changed_fraction']:.4f} changed; delta {row['delta']['bytes']} B "
                    f"{row['delta']['encode_s']:.3f} + {row['delta']['push_s']:.3f} s (replica stage "
                    f"{row['delta']['replica_stage_s']:.3f} s), full {row['full']['bytes']} B "
                    f"{row['full']['push_s']:.3f} s (stage {row['full']['replica_stage_s']:.3f} s)"
                )
                out.append(row)
            rows[f"lr_{lr:g}"] = out

    def summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
        d_bytes = median([r["delta"]["bytes"] for r in rs])
        f_bytes = median([r["full"]["bytes"] for r in rs])
        d_s = median([r["delta"]["encode_plus_push_s"] for r in rs])
        f_s = median([r["full"]["push_s"] for r in rs])
        return {
            "changed_fraction_per_step": [rnd(r["changed_fraction"], 4) for r in rs],
            "delta_bytes_median": int(d_bytes),
            "full_bytes_median": int(f_bytes),
            "bytes_delta_vs_full": rnd(d_bytes / f_bytes),
            "delta_encode_s_median": rnd(median([r["delta"]["encode_s"] for r in rs])),
            "delta_push_s_median": rnd(median([r["delta"]["push_s"] for r in rs])),
            "delta_encode_plus_push_s_median": rnd(d_s),
            "full_push_s_median": rnd(f_s),
            "time_delta_vs_full": rnd(d_s / f_s),
            "replica_stage_s_median": {
                "delta": rnd(median([r["delta"]["replica_stage_s"] for r in rs])),
                "full": rnd(median([r["full"]["replica_stage_s"] for r in rs])),
            },
            "sent_as_delta": [r["delta"]["sent_as_delta"] for r in rs],
        }

    summaries = {k: summary(v) for k, v in rows.items()}
    emit(
        "weight_sync_delta",
        settings={
            "resources": {
                "trainer": side(
                    torch.get_num_threads(), "this process: the optimizer steps, packing, make_delta, send"
                ),
                "replica": side(rollout_threads("hf"), "rlhf serve rollout, hf engine, bf16, data plane on"),
            },
            "policy": size,
            "policy_parameters": n_params,
            "optimizer": "AdamW over fp32 master weights, default betas/eps/weight decay; pushed as bf16",
            "batch": f"{BATCH} x {SEQ} random tokens, next-token loss, one optimizer step per push",
            "learning_rates": list(LRS),
            "steps": STEPS,
            "transport": "tcp (the data plane), loopback",
        },
        figures={k: [_rounded(r) for r in v] for k, v in rows.items()},
        ratio=summaries,
        notes=[
            "changed_fraction: bf16 elements whose bits differ from the previous push (one optimizer step)",
            "delta bytes include each bucket's 8-byte count; a bucket where the delta is not smaller goes whole",
            "every delta push: the replica rebuilt each bucket on its base and checked it against the full update's "
            "sha256; its answer carries the full update's checksum (asserted)",
            "delta time = make_delta on the trainer (a word-by-word compare of the new buckets with the base's) + the "
            "push call; full time = the push call; both after pack_weights (the same for both)",
        ],
        started=started,
        command="python -m bench.weight_sync --delta",
    )


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {k: _rounded(v) if isinstance(v, dict) else rnd(v) if isinstance(v, float) else v for k, v in row.items()}


if __name__ == "__main__":
    import asyncio

    asyncio.run(delta_bench())
