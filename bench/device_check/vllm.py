"""``vllm``: vLLM's own throughput and weight-transfer checks (bare ``AsyncLLM`` against ``VllmEngine``, vLLM's
nccl / ipc transfer into ``vllm serve``, our collective push into ``VllmEngine``), where ``import vllm`` works."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

from bench.device_check.common import TOKEN, Record, model_paths, random_prompts
from rlhf.procs import free_ports


async def _bare_vllm(path: str, v: dict[str, Any], dtype: str, mode: str) -> float:
    from vllm import SamplingParams  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process
    from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process

    kw = dict(
        model=path, dtype=dtype, enforce_eager=mode == "inproc", max_model_len=512, gpu_memory_utilization=0.4, seed=0
    )
    batch = random_prompts(v["prompts"], v["prompt_len"])
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
        from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process
        from vllm.v1.engine.llm_engine import LLMEngine  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process

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
    from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process
    from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process

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
    from services.rollout.options import SamplingOptions  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from services.rollout.vllm_engine import VllmEngine  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

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
        batch = random_prompts(v["prompts"], v["prompt_len"])
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
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from vllm.distributed.weight_transfer.base import ModuleSource  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process

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
        ids = random_prompts(4, v["prompt_len"])
        before = _greedy_http(url, ids)
        client = HTTPVLLMWeightSyncClient(url)
        if backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process

            info = NCCLTrainerInitInfo(rank=0, master_address="127.0.0.1", master_port=master_port, world_size=2)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo  # noqa: PLC0415 - vllm: optional (absent on most device hosts); in the phase's own process

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
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from safetensors.torch import load_file  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    from rlhf.transport.weights import pack_weights  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from rlhf.transport.weights.send import push_collective  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from services.rollout.options import SamplingOptions  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from services.rollout.vllm_engine import VllmEngine  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from tests.support.replica import Replica  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

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
        try:
            async with Replica(TOKEN, eng) as replica:  # the rollout servicer over the engine, in this process
                addr = replica.addr

                async def push(packed):
                    out = await push_collective([addr], packed, token=TOKEN, **group)
                    if isinstance(out[addr], BaseException):
                        raise out[addr]

                greedy = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)
                ids = random_prompts(4, v["prompt_len"])
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
            await eng.close()

    return asyncio.run(main())


def run(p: dict[str, Any], rec: Record) -> None:
    policy, _ = model_paths(p)
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
