"""Weight pushes across hosts: the trainer host pushes the policy to both rollout replicas over tcp (the data plane)
and over the gloo collective; seconds per push and the bytes each veth link carried.

Run by tests/cluster/run.py after the ring's ledger is taken (it moves the replicas' versions on). The pushing side
runs inside trainer-0's namespace (``python -m tests.cluster.pushbench``, one JSON line); the harness reads the
links' byte counters around it. The weights are a policy's own tensors (``model.safetensors`` in checkpoint layout: a
replica takes only tensors of its model's shapes): the ring's tiny policy, then a 36M-parameter one on two extra
replicas started for it. Last, rollout-1's link is cut in the middle of a push of that one (:func:`cut_mid_push`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from safetensors.torch import load_file

from rlhf.procs import http_ready
from rlhf.tiny import TinySpec, build_tiny
from rlhf.transport import pack_weights, push_weights_many
from tests.cluster import netns


async def _push(targets: list[str], weights, version: int, transport: str, token: str) -> float:
    packed = pack_weights(weights, version)
    t0 = time.perf_counter()
    res = await push_weights_many(targets, packed, token=token, timeout=120.0, transport=transport)
    dt = time.perf_counter() - t0
    bad = {t: r for t, r in res.items() if isinstance(r, BaseException)}
    if bad:
        raise RuntimeError(f"push of version {version} over {transport} failed: {bad}")
    return dt


async def _push_once(targets: list[str], weights, version: int, transport: str, token: str, timeout: float) -> dict:
    """One push, each target's outcome (``--cut-test``: the harness cuts a link while it runs)."""
    packed = pack_weights(weights, version)
    print("pushing", flush=True)
    t0 = time.perf_counter()
    res = await push_weights_many(targets, packed, token=token, timeout=timeout, transport=transport)
    return {
        "push_s": round(time.perf_counter() - t0, 3),
        "outcome": {
            t: f"{type(r).__name__}: {str(r)[:160]}" if isinstance(r, BaseException) else "ok" for t, r in res.items()
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True, help="folder with model.safetensors")
    ap.add_argument("--targets", required=True, help="comma list of rollout gRPC addresses")
    ap.add_argument("--transport", choices=["tcp", "collective", "grpc"], required=True)
    ap.add_argument("--version", type=int, required=True, help="first version pushed (above what the replicas serve)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--token", required=True)
    ap.add_argument("--cut-test", action="store_true", help="one push, say 'pushing' as it starts, report outcomes")
    ap.add_argument("--timeout", type=float, default=120.0, help="the push's deadline (the trainer's: 120 s)")
    args = ap.parse_args(argv)

    weights = load_file(str(Path(args.policy) / "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    targets = args.targets.split(",")
    if args.cut_test:
        rec = asyncio.run(_push_once(targets, weights, args.version, args.transport, args.token, args.timeout))
        print(json.dumps(rec))
        return 0
    times = [
        asyncio.run(_push(targets, weights, args.version + i, args.transport, args.token)) for i in range(args.rounds)
    ]
    print(json.dumps({"transport": args.transport, "payload_bytes": nbytes, "replicas": len(targets), "push_s": times}))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------ the harness's side (root namespace)

_SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(1); c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t0 = t0 or time.perf_counter(); n += len(b)
print(n, time.perf_counter() - t0)
"""
_SOURCE = """
import socket, sys, time
for _ in range(50):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError:
        time.sleep(0.1)
buf = b"x" * (1 << 20)
for _ in range(int(sys.argv[3])):
    c.sendall(buf)
c.close()
"""


def raw_link(cluster, src: str, dst: str, mib: int = 256, port: int = 5201) -> dict:
    """One TCP stream of ``mib`` MiB from ``src`` to ``dst`` across the bridge: what a link carries at most here."""
    sink = subprocess.Popen(
        cluster.net.host(dst).wrap([sys.executable, "-c", _SINK, str(port)]), stdout=subprocess.PIPE, text=True
    )
    try:
        subprocess.run(
            cluster.net.host(src).wrap([sys.executable, "-c", _SOURCE, cluster.ip(dst), str(port), str(mib)]),
            check=True,
            timeout=120,
        )
        out, _ = sink.communicate(timeout=60)
    finally:
        if sink.poll() is None:
            sink.kill()
    n, secs = out.split()
    return {"bytes": int(n), "s": round(float(secs), 3), "MiB_per_s": round(int(n) / float(secs) / 2**20, 1)}


def measure(cluster, rounds: int = 5) -> dict:
    """Weight pushes from trainer-0 to both replicas over tcp and the gloo collective, after the ring ended: the
    ring's own tiny policy to its replicas, then a 36M-parameter policy (144 MB in float32) to two extra replicas
    started for it on the rollout hosts, where the links' bandwidth, not the per-push overhead, sets the time."""
    replicas = ["rollout-0", "rollout-1"]
    out: dict = {"raw_tcp_link": raw_link(cluster, "trainer-0", "rollout-0")}
    policy = cluster.dir / "cache" / "tiny" / "policy"
    for transport in ("tcp", "collective"):
        out[f"tiny_{transport}"] = _bench(cluster, replicas, 50051, "http", policy, transport, rounds)
    big = build_tiny(
        cluster.dir / "cache" / "push-model",
        TinySpec(
            hidden_size=768, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=12
        ),
    )
    cfg = cluster.config.read_text().replace("load: tiny:policy", f"load: {big.policy}")
    big_cfg = cluster.dir / "push-model.yaml"
    big_cfg.write_text(cfg)
    procs = []
    try:
        for h in replicas:
            env = cluster.env("rollout", h)
            env.pop("RLHF_REDIS_URL")  # serving only: no ring
            env.update(RLHF_GRPC_PORT="50061", RLHF_HTTP_PORT="8001", RLHF_WEIGHTS_DATA_PORT="50062")
            argv = ["rlhf", "serve", "rollout", "--config", str(big_cfg), "--grpc-port", "50061", "--http-port", "8001"]
            procs.append(cluster.add(f"{h}-push-model", h, argv, env, restart=False))
        for h in replicas:
            _wait_http(f"http://{cluster.ip(h)}:8001", 300)
        for transport in ("tcp", "collective"):
            out[f"big_{transport}"] = _bench(cluster, replicas, 50061, "8001", big.policy, transport, 3)
        # the link back within the push's deadline (TCP carries on), and back only after it (the push fails there)
        out["cut_mid_push_resumed"] = cut_mid_push(cluster, replicas, big.policy, outage_s=5.0, timeout=60.0)
        out["cut_mid_push_timed_out"] = cut_mid_push(cluster, replicas, big.policy, outage_s=15.0, timeout=8.0)
    finally:
        for p in procs:
            p.stop(10)
        shutil.rmtree(cluster.dir / "cache" / "push-model", ignore_errors=True)  # 275 MB, rebuilt in seconds
    return out


def cut_mid_push(
    cluster, replicas: list[str], policy: Path, *, outage_s: float, timeout: float, cut_after_s: float = 0.15
) -> dict:
    """A push of the larger policy over tcp (deadline ``timeout``) with rollout-1's link cut ``cut_after_s`` into it
    (the transfer takes about 0.3 s), back ``outage_s`` later; then one more push. Each replica must serve the old
    version or the new one, whole (a cut transfer installs nothing), and both the version of the push after."""
    http = 8001
    targets = ",".join(f"{cluster.ip(h)}:50061" for h in replicas)
    old = [_served(cluster, h, http) for h in replicas]
    env = cluster.env("trainer", "trainer-0")
    argv = [sys.executable, "-m", "tests.cluster.pushbench", "--policy", str(policy), "--targets", targets]
    argv += ["--transport", "tcp", "--version", str(max(old) + 1), "--token", env["RLHF_API_TOKEN"], "--cut-test"]
    argv += ["--timeout", str(timeout)]
    proc = subprocess.Popen(
        cluster.net.host("trainer-0").wrap(argv),
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        if line.strip() != "pushing":
            return {"error": f"push did not start: {line!r}"}
        time.sleep(cut_after_s)
        cluster.net.cut(replicas[1])
        time.sleep(outage_s)
        cluster.net.restore(replicas[1])
        rec = json.loads(proc.communicate(timeout=120)[0].strip().splitlines()[-1])
    finally:
        if proc.poll() is None:
            proc.kill()
    served = [_served(cluster, h, http) for h in replicas]
    after = _bench(cluster, replicas, 50061, str(http), policy, "tcp", 1)
    whole = all(s in (o, max(old) + 1) for s, o in zip(served, old, strict=True))
    return {
        "cut_after_s": cut_after_s,
        "outage_s": outage_s,
        "push_timeout_s": timeout,
        **rec,
        "served_before": old,
        "served_after_cut_push": served,
        "served_after_next_push": after.get("served_after"),
        "passed": whole and len(set(after.get("served_after") or [None, -1])) == 1,
    }


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not http_ready(url, timeout=2):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready")
        time.sleep(0.5)


def _bench(cluster, replicas: list[str], grpc_port: int, http: str, policy: Path, transport: str, rounds: int) -> dict:
    http_port = 8000 if http == "http" else int(http)
    targets = ",".join(f"{cluster.ip(h)}:{grpc_port}" for h in replicas)
    version = max(_served(cluster, h, http_port) for h in replicas) + 1
    links = {h: netns.link_stats(cluster.net.host(h)) for h in ["trainer-0", *replicas]}
    env = cluster.env("trainer", "trainer-0")
    argv = [sys.executable, "-m", "tests.cluster.pushbench", "--policy", str(policy), "--targets", targets]
    argv += ["--transport", transport, "--version", str(version), "--rounds", str(rounds)]
    argv += ["--token", env["RLHF_API_TOKEN"]]
    res = subprocess.run(
        cluster.net.host("trainer-0").wrap(argv),
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        return {"error": (res.stderr.strip().splitlines() or [str(res.returncode)])[-1]}
    rec = json.loads(res.stdout.strip().splitlines()[-1])
    after = {h: netns.link_stats(cluster.net.host(h)) for h in links}
    med = statistics.median(rec["push_s"])
    return {
        "payload_bytes": rec["payload_bytes"],
        "replicas": rec["replicas"],
        "push_s_median": round(med, 4),
        "push_s": [round(t, 4) for t in rec["push_s"]],
        "MiB_per_s_to_all": round(rec["payload_bytes"] * rec["replicas"] / med / 2**20, 1),
        "trainer_link_tx_bytes_per_push": (after["trainer-0"][1] - links["trainer-0"][1]) // rounds,
        "replica_link_rx_bytes_per_push": [(after[h][0] - links[h][0]) // rounds for h in replicas],
        "served_after": [_served(cluster, h, http_port) for h in replicas],
    }


def _served(cluster, host: str, port: int = 8000) -> int:
    with urllib.request.urlopen(f"http://{cluster.ip(host)}:{port}/v1/weights/version", timeout=5) as r:
        return int(json.loads(r.read())["version"])
