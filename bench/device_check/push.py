"""``push``: tcp, grpc and collective pushes from this process, as the trainer, into a rollout replica in another
process (tests.support.replica over the ``hf`` engine on the device) of the tied model: each lands and the
originals come back."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from bench.device_check.common import REPO, TOKEN, Record, model_paths, random_prompts


def _start_replica(p: dict[str, Any], policy: str, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """The rollout replica the pushes go to (tests.support.replica: the rollout servicer over the ``hf`` engine on
    this device, gRPC and the TCP data plane on free loopback ports), its stderr in push-replica.log."""
    from tests.support.replica import start_child  # grpc, torch: in the phase's process, not the driver's  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    args = ["--token", TOKEN, "--engine", "hf", "--model", policy, "--name", "device-check"]
    args += ["--device", p["device"], "--dtype", p["serve_dtype"]]
    return start_child(*args, stderr=Path(p["work"]) / "logs" / "push-replica.log", timeout=timeout_s)


def _push_weights(p: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(original, perturbed) weights as a trainer pushes them: the checkpoint layout (the tie's alias,
    lm_head.weight, left out), in the serving dtype; the same tensors in every process (a fixed seed)."""
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from safetensors.torch import load_file  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    policy, _ = model_paths(p)
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
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    from rlhf.transport.weights import copy_weights, pack_weights, push_weights  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from rlhf.transport.weights.send import push_collective  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from rlhf.v1 import rollout_pb2_grpc, weights_pb2  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

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


GREEDY_PROMPTS = random_prompts(4, 12, seed=5)


async def _greedy_grpc(stub: Any, metadata: Any) -> list[list[int]]:
    """The replica's greedy tokens for :data:`GREEDY_PROMPTS`, through its gRPC ``Generate``."""
    from rlhf.v1 import common_pb2, rollout_pb2  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    req = rollout_pb2.GenerateRequest(
        prompts=[common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=x)) for x in GREEDY_PROMPTS],
        params=common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
    )
    resp = await stub.Generate(req, metadata=metadata, timeout=120)
    return [list(c.token_ids) for r in resp.results for c in r.completions]


def push_row_main(work: Path, addr: str, transport: str, version: int, before: str) -> int:
    """``--push-row``: one transport's row from a process of its own (NCCL: a communicator that hangs or aborts its
    process takes only this one down); prints the row as JSON."""
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    p = json.loads((work / "plan.json").read_text())
    if p["device"] == "cuda":
        torch.cuda.set_device(0)
    state, moved = _push_weights(p)
    row = asyncio.run(_transport_row(addr, transport, version, json.loads(before), state, moved))
    print(json.dumps(row), flush=True)
    return 0


def run(p: dict[str, Any], rec: Record) -> None:
    from rlhf.v1 import rollout_pb2_grpc  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    policy, _ = model_paths(p)
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
