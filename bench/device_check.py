"""bench.device_check: what must work on a CUDA machine, in one run, printing one JSON line (``make device-check``).

Written for one GPU (an H200): the whole check, install included, is meant to take under 10 minutes. It has never
run on a GPU (none was at hand when it was written); ``--cpu`` runs every phase that can run without one, on the
CPU at a small scale, and ``--dry-run`` only builds the plan and imports what each phase needs.

Phases (each one's figures, or its error, go in the JSON; one failing does not stop the others):

1. ``model``: a random-init Llama of about 1.5B parameters (hidden 2048, 24 layers, MLP 7168, 16 heads; the tiny
   tokenizer's 512-token vocabulary, so the rollout service can load it), bf16, saved in Hugging Face format.
2. ``throughput``: the same prompts (256 x 32 random token ids, 128 new tokens, temperature 1, seed per request)
   through bare vLLM ``AsyncLLM`` and through the rollout service's engine (``VllmEngine``, which drives
   ``AsyncLLM`` with the service's sampling parameters: log-probs, FINAL_ONLY outputs): generated tokens/s each.
3. ``weights``: vLLM's own weight transfer into a vLLM server (``vllm serve``, ``VLLM_SERVER_DEV_MODE=1`` for its
   RLHF routes, ``--weight-transfer-config {"backend": "nccl"}``) from this process as the trainer
   (``NCCLTrainerWeightTransferEngine`` over ``HTTPVLLMWeightSyncClient``): seconds per push of the 1.5B model,
   and a check that it lands (greedy tokens change with perturbed weights, and come back exactly with the
   originals). NCCL refuses two ranks on one GPU on some versions: the error is recorded and the same runs with
   vLLM's ``ipc`` backend (the colocated path). With ``--cpu``: the project's collective push (gloo) into a vLLM
   engine through the ``rlhf_collective`` backend instead.
3b. ``collective_nccl`` (GPU only): the same push through OUR services with nccl: this process as the trainer, a
   rollout servicer over ``VllmEngine`` (its worker on the same GPU) receiving through ``rlhf_collective``. Two ranks
   on one GPU: NCCL refuses that on many versions ("Duplicate GPU detected"); the row then records that error.
4. ``ring``: ``rlhf up`` of configs/demo.yaml on the GPU (``device: cuda``, ``training.bf16: true``, vLLM engine
   sharing the GPU at ``gpu_memory_utilization: 0.3``), 60 steps: the trainer in bf16 with fp32 master weights
   must learn (mean reward of the last 5 steps at least 0.2 above the first 5; the CPU demo gains about 0.6).

Usage: ``python -m bench.device_check [--cpu] [--dry-run] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GPU_SPEC = {"hidden_size": 2048, "intermediate_size": 7168, "num_hidden_layers": 24, "num_attention_heads": 16,
            "num_key_value_heads": 16, "max_position_embeddings": 2048}  # fmt: skip
CPU_SPEC = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 8, "max_position_embeddings": 512}  # fmt: skip


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    gpu = not args.cpu
    return {
        "device": "cuda" if gpu else "cpu",
        "spec": GPU_SPEC if gpu else CPU_SPEC,
        "dtype": "bfloat16" if gpu else "float32",
        "prompts": 256 if gpu else 16,
        "prompt_len": 32,
        "new_tokens": 128 if gpu else 16,
        "pushes": 3,
        "ring_steps": 60 if gpu else 6,
        "out": str(args.out),
    }


# ------------------------------------------------------------------------------------------------------ phases


def build_model(p: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import LlamaForCausalLM

    from rlhf.tiny import TinySpec, _llama_config, build_tokenizer

    out = Path(p["out"]) / "policy"
    spec = TinySpec(**p["spec"])
    tok = build_tokenizer(spec)
    t0 = time.perf_counter()
    with torch.device(p["device"]):
        model = LlamaForCausalLM(_llama_config(spec, tok)).to(getattr(torch, p["dtype"])).eval()
    n = sum(t.numel() for t in model.parameters())
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return {"path": str(out), "parameters": n, "build_seconds": round(time.perf_counter() - t0, 1)}


def prompts(p: dict[str, Any]) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 500) for _ in range(p["prompt_len"])] for _ in range(p["prompts"])]


async def _bare_vllm(path: str, p: dict[str, Any], mode: str) -> float:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kw = dict(model=path, dtype=p["dtype"], enforce_eager=p["device"] == "cpu", max_model_len=512,
              gpu_memory_utilization=0.4, seed=0)  # fmt: skip
    batch = prompts(p)
    params = [SamplingParams(max_tokens=p["new_tokens"], temperature=1.0, seed=i, ignore_eos=True, logprobs=0,
                             output_kind=RequestOutputKind.FINAL_ONLY) for i in range(len(batch))]  # fmt: skip
    if mode == "inproc":  # the CPU build: LLMEngine stepped here, as the rollout engine's in-process driver does
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        llm = LLMEngine.from_engine_args(EngineArgs(**kw))
        t0 = time.perf_counter()
        for i, (ids, sp) in enumerate(zip(batch, params, strict=True)):
            llm.add_request(f"b{i}", {"prompt_token_ids": ids}, sp)
        n = 0
        while llm.has_unfinished_requests():
            n += sum(len(o.outputs[0].token_ids) for o in llm.step() if o.finished)
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


async def _service_engine(path: str, p: dict[str, Any], mode: str) -> float:
    from services.rollout.engine import SamplingOptions
    from services.rollout.vllm_engine import VllmEngine

    eng = VllmEngine(path, "device-check", dtype=p["dtype"], mode=mode, max_model_len=512,
                     engine_kwargs={"gpu_memory_utilization": 0.4, "enforce_eager": p["device"] == "cpu"})  # fmt: skip
    await eng.start()
    try:
        batch = prompts(p)
        opts = [SamplingOptions(max_tokens=p["new_tokens"], temperature=1.0, seed=i, ignore_eos=True)
                for i in range(len(batch))]  # fmt: skip
        await asyncio.gather(*(eng.generate([batch[i]], opts[i]) for i in range(min(8, len(batch)))))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(eng.generate([b], o) for b, o in zip(batch, opts, strict=True)))
        n = sum(len(s.token_ids) for r in results for s in r[0].samples)
        return n / (time.perf_counter() - t0)
    finally:
        await eng.close()


def throughput(p: dict[str, Any], path: str) -> dict[str, Any]:
    mode = "async" if p["device"] == "cuda" else "inproc"
    bare = asyncio.run(_bare_vllm(path, p, mode))
    ours = asyncio.run(_service_engine(path, p, mode))
    return {"bare_vllm_tokens_per_s": round(bare, 1), "rollout_engine_tokens_per_s": round(ours, 1),
            "ratio": round(ours / bare, 3), "driver": mode}  # fmt: skip


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy(url: str, ids: list[list[int]]) -> list[list[int]]:
    body = json.dumps({"prompt": ids, "max_tokens": 8, "temperature": 0, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return [c["token_ids"] for c in json.loads(r.read())["choices"]]


def weights_gpu(p: dict[str, Any], path: str, backend: str) -> dict[str, Any]:
    """vLLM's weight-transfer API, trainer side in this process, a vLLM server as the inference side."""
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    port = _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", path, "--port", str(port), "--dtype",
           p["dtype"], "--gpu-memory-utilization", "0.3", "--max-model-len", "512", "--weight-transfer-config",
           json.dumps({"backend": backend})]  # fmt: skip
    with open(Path(p["out"]) / "vllm.log", "w") as server_log:
        server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=server_log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("vllm serve did not start; see vllm.log") from None
                time.sleep(2)
        model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=getattr(torch, p["dtype"])).to("cuda")
        original = {k: v.clone() for k, v in model.state_dict().items()}
        ids = prompts(p)[:4]
        before = _greedy(url, ids)
        client = HTTPVLLMWeightSyncClient(url)
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=_free_port(), world_size=2)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(rank=0)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=ModuleSource(model))
        with torch.no_grad():
            for t in model.parameters():
                t.add_(0.05 * torch.randn_like(t))
        seconds = []
        for _ in range(p["pushes"]):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.send_weights()
            seconds.append(time.perf_counter() - t0)
        changed = _greedy(url, ids)
        model.load_state_dict(original)
        engine.send_weights()
        restored = _greedy(url, ids)
        nbytes = sum(t.numel() * t.element_size() for t in model.parameters())
        push_s = statistics.median(seconds)
        return {"backend": backend, "push_seconds": round(push_s, 3), "GB_per_s": round(nbytes / push_s / 1e9, 2),
                "bytes": nbytes, "landed": changed != before, "restored_exactly": restored == before}  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=60)


def weights_service(p: dict[str, Any], path: str, backend: str) -> dict[str, Any]:
    """The project's collective push through OUR services: this process as the trainer (rank 0, buckets on its
    device for nccl) -> a rollout servicer over ``VllmEngine``, whose worker receives through the
    ``rlhf_collective`` backend of vLLM's weight-transfer API on its own device. On one GPU both ranks share it:
    NCCL refuses that on many versions ("Duplicate GPU detected"), and the error is then this row's result."""
    import grpc
    import torch
    from safetensors.torch import load_file

    from rlhf.serving import ServiceMetrics, ServiceSettings
    from rlhf.transport.weights import pack_weights
    from rlhf.transport.weights.send import push_collective
    from services.rollout.engine import SamplingOptions
    from services.rollout.grpc_servicer import RolloutServicer, add_to_server
    from services.rollout.vllm_engine import VllmEngine

    state = load_file(str(Path(path) / "model.safetensors"))

    async def main() -> dict[str, Any]:
        gpu = p["device"] == "cuda"
        eng = VllmEngine(path, "device-check", dtype=p["dtype"], mode="async" if gpu else "inproc", max_model_len=512,
                         engine_kwargs={"gpu_memory_utilization": 0.3} if gpu else None)  # fmt: skip
        await eng.start()
        group = {"backend": backend, "device": torch.device("cuda") if backend == "nccl" else None,
                 "group_timeout_s": 120.0}  # fmt: skip

        async def push(packed):
            out = await push_collective([addr], packed, token="t", **group)
            if isinstance(out[addr], BaseException):
                raise out[addr]

        servicer = RolloutServicer(eng, ServiceSettings(api_token="t"), ServiceMetrics("rollout"))
        server = grpc.aio.server()
        add_to_server(servicer, server)
        addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        try:
            greedy = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)
            before = [s.token_ids for r in await eng.generate(prompts(p)[:4], greedy) for s in r.samples]
            g = torch.Generator().manual_seed(1)
            moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}
            seconds = []
            for version in range(1, p["pushes"] + 1):
                packed = pack_weights(moved, version)
                t0 = time.perf_counter()
                await push(packed)
                seconds.append(time.perf_counter() - t0)
            changed = [s.token_ids for r in await eng.generate(prompts(p)[:4], greedy) for s in r.samples]
            await push(pack_weights(state, p["pushes"] + 1))
            restored = [s.token_ids for r in await eng.generate(prompts(p)[:4], greedy) for s in r.samples]
            push_s = statistics.median(seconds)
            return {"backend": f"rlhf_collective/{backend} (vLLM weight transfer)", "push_seconds": round(push_s, 3),
                    "GB_per_s": round(packed.total_bytes / push_s / 1e9, 3), "bytes": packed.total_bytes,
                    "landed": changed != before, "restored_exactly": restored == before}  # fmt: skip
        finally:
            await servicer.close_data_plane()
            await server.stop(None)
            await eng.close()

    return asyncio.run(main())


def ring(p: dict[str, Any]) -> dict[str, Any]:
    """``rlhf up`` of the demo config on this device; the trainer in bf16 on CUDA must learn."""
    import yaml

    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["training"].update(train_iters=p["ring_steps"], device=p["device"], save=str(Path(p["out"]) / "ckpt"))
    actor = cfg["actor_rollout_ref"]["actor_rollout"]
    if p["device"] == "cuda":
        cfg["training"]["bf16"] = True
        actor.update(gpu_memory_utilization=0.3, engine="vllm")
    else:
        actor["engine"] = "hf"  # 2 shared cores: vLLM plus the trainer's forward would take minutes
    path = Path(p["out"]) / "ring.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = Path(p["out"]) / "ring-run"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "services.cli", "up", "--config", str(path), "--run-dir",
                           str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=540)  # fmt: skip
    metrics = (
        [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] if proc.returncode == 0 else []
    )
    if proc.returncode != 0 or len(metrics) < p["ring_steps"]:
        tail = (proc.stdout + proc.stderr)[-2000:]
        return {"exit": proc.returncode, "steps": len(metrics), "tail": tail, "learns": None}
    rewards = [m["reward/mean"] for m in metrics]
    k = min(5, len(rewards) // 2)
    first, last = statistics.mean(rewards[:k]), statistics.mean(rewards[-k:])
    # the learning bar applies to the GPU run (60 steps); a short CPU run only shows the ring goes round
    learns = last - first >= 0.2 if p["device"] == "cuda" else None
    return {"exit": 0, "steps": len(metrics), "seconds": round(time.perf_counter() - t0, 1), "window": k,
            "reward_first": round(first, 4), "reward_last": round(last, 4), "gain": round(last - first, 4),
            "learns": learns}  # fmt: skip


# ------------------------------------------------------------------------------------------------------ main


def _phase(result: dict[str, Any], name: str, fn, *a: Any) -> Any:
    t0 = time.perf_counter()
    try:
        value = fn(*a)
    except Exception as err:  # noqa: BLE001 - recorded; the next phase still runs
        result[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-1500:]}
        return None
    result[name] = {**value, "phase_seconds": round(time.perf_counter() - t0, 1)}
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run the CPU-able phases at a small scale")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and import what each phase needs")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "device-check")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    # stdout carries only the JSON line: vLLM logs to fd 1, so everything else written there goes to stderr
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    p = plan(args)
    started = time.perf_counter()
    result: dict[str, Any] = {"name": "device_check", "plan": p}
    if args.dry_run:
        import importlib

        mods = ["torch", "transformers", "vllm", "vllm.distributed.weight_transfer.factory",
                "vllm.distributed.weight_transfer.clients", "services.rollout.vllm_engine",
                "services.rollout.vllm_transfer", "rlhf.transport.weights.collective"]  # fmt: skip
        result["imports"] = {}
        for m in mods:
            try:
                importlib.import_module(m)
                result["imports"][m] = "ok"
            except Exception as err:  # noqa: BLE001
                result["imports"][m] = f"{type(err).__name__}: {err}"
        print(json.dumps(result, separators=(",", ":")), file=json_out, flush=True)
        return 0 if all(v == "ok" for v in result["imports"].values()) else 1
    if p["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(json.dumps({**result, "error": "no CUDA device; use --cpu"}), file=json_out, flush=True)
            return 2
        result["gpu"] = torch.cuda.get_device_name(0)
    built = _phase(result, "model", build_model, p)
    if built is not None:
        _phase(result, "throughput", throughput, p, built["path"])
        if p["device"] == "cuda":
            got = _phase(result, "weights", weights_gpu, p, built["path"], "nccl")
            if got is None:
                result["weights_nccl"] = result.pop("weights")
                _phase(result, "weights", weights_gpu, p, built["path"], "ipc")
            _phase(result, "collective_nccl", weights_service, p, built["path"], "nccl")
        else:
            _phase(result, "weights", weights_service, p, built["path"], "gloo")
    _phase(result, "ring", ring, p)
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, separators=(",", ":")), file=json_out, flush=True)
    ok = all("error" not in v for k, v in result.items() if isinstance(v, dict) and k != "plan")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
