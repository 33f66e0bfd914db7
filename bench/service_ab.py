"""bench.service_ab: two copies of one service side by side, differing only in environment, called in turn.

Not part of ``make bench``: the tool behind the A/B figures in bench.serving's notes. Both copies run as real
processes (``rlhf serve NAME``) on bench.serving's configuration and requests (the tiny models), start together and
stay up, and are called in interleaved rounds (A then B, then B then A, ...), so a machine whose speed drifts over
minutes weighs on both alike. Each round is ``AB_N`` calls by ``AB_CONC`` concurrent callers, per way in (gRPC,
REST). Printed per copy and way: the median over rounds of each round's p50, the rounds' p50s, requests/s, and the
CPU per request of the service's process tree (the service and its model process).

    AB_SERVICE=reward AB_CONC=8 AB_B='{"RLHF_MODEL_PROCESS": "false"}' python -m bench.service_ab

Environment: ``AB_SERVICE`` (reward, reference, rollout), ``AB_CONC`` (default 8), ``AB_N`` (calls per round and
way, default 96), ``AB_ROUNDS`` (default 4), ``AB_WAYS`` (default ``grpc,rest``), ``AB_A`` / ``AB_B`` (JSON objects
of environment variables for copy A / B; a null value unsets one).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics

import aiohttp
import grpc

from bench._common import CACHE, ServiceProc, build_model, log, write_yaml
from bench.serving import SERVICE_ENV, config, make_calls, run_way
from rlhf.v1 import reference_pb2_grpc, reward_pb2_grpc, rollout_pb2_grpc
from services.rollout.vllm_engine import set_vllm_env_defaults

NAME = os.environ.get("AB_SERVICE", "reward")
CONC = int(os.environ.get("AB_CONC", "8"))
N = int(os.environ.get("AB_N", "96"))
ROUNDS = int(os.environ.get("AB_ROUNDS", "4"))
WAYS = tuple(os.environ.get("AB_WAYS", "grpc,rest").split(","))
COPIES = {"A": json.loads(os.environ.get("AB_A", "{}")), "B": json.loads(os.environ.get("AB_B", "{}"))}


async def main() -> None:
    set_vllm_env_defaults("cpu")
    paths = build_model("tiny")
    log_dir = CACHE / "logs"
    cfg_path = write_yaml(log_dir / "service_ab.yaml", config(paths, "bench-service-ab"))
    grpc_req, (path, body), _ = make_calls(NAME, 512)
    stub_cls, method = {
        "reward": (reward_pb2_grpc.RewardServiceStub, "Score"),
        "reference": (reference_pb2_grpc.ReferenceServiceStub, "LogProbs"),
        "rollout": (rollout_pb2_grpc.RolloutServiceStub, "Generate"),
    }[NAME]
    services = {tag: ServiceProc(NAME, cfg_path, log_dir, env={**SERVICE_ENV, **env}) for tag, env in COPIES.items()}
    for svc in services.values():
        svc.start(wait_ready=False)
    try:
        for svc in services.values():
            svc.wait_ready()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as http:
            calls = {}
            for tag, svc in services.items():
                stub_call = getattr(stub_cls(grpc.aio.insecure_channel(svc.grpc_addr)), method)

                async def by_grpc(stub_call=stub_call) -> None:
                    await stub_call(grpc_req)

                async def by_rest(url=svc.http_url + path) -> None:
                    async with http.post(url, json=body) as resp:
                        await resp.read()
                        if resp.status != 200:
                            raise RuntimeError(f"{url}: HTTP {resp.status}")

                calls[(tag, "grpc")] = (by_grpc, svc)
                calls[(tag, "rest")] = (by_rest, svc)
            keys = [k for k in calls if k[1] in WAYS]
            for k in keys:  # warm-up
                for _ in range(10):
                    await calls[k][0]()
            results: dict[tuple[str, str], list[tuple[float, float, float]]] = {k: [] for k in keys}
            for r in range(ROUNDS):
                for k in keys if r % 2 == 0 else reversed(keys):
                    call, svc = calls[k]
                    lat, wall, _, service_cpu = await run_way(call, N, CONC, svc.pid)
                    results[k].append((statistics.median(lat) * 1e3, N / wall, service_cpu / N * 1e3))
                log(f"bench.service_ab: round {r + 1} of {ROUNDS} done")
    finally:
        for svc in services.values():
            svc.stop()
    for tag, way in sorted(results):
        rows = results[(tag, way)]
        p50s = [round(x[0], 2) for x in rows]
        print(
            f"{NAME}, {CONC} callers, {tag} {COPIES[tag]}, {way}: p50 {statistics.median(p50s):.2f} ms {p50s}, "
            f"{statistics.median(x[1] for x in rows):.0f} requests/s, "
            f"service CPU {statistics.median(x[2] for x in rows):.3f} ms/request"
        )


if __name__ == "__main__":
    asyncio.run(main())
