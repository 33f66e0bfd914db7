"""``ring``: ``rlhf up`` of configs/demo.yaml on the device (``engine: hf``, every service on GPU 0)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.device_check.common import REPO, Record


def run(p: dict[str, Any], rec: Record) -> None:
    """``rlhf up`` of the demo config on this device; the trainer (bf16 on CUDA) must learn."""
    import yaml  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

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
