"""bench.ring_threads: the asynchronous small-model PPO ring with one thread per process vs every core per process.

bench.pipeline's ring (same settings, hf engine), run with two thread settings for all four torch services (reward,
reference, rollout, trainer), alternating A, B, B, A: ``quarter``, what ``rlhf up`` gives each process (a quarter of
the cores, at least one: 1 on 2 cores), and ``all``, every core to every process with ``OMP_WAIT_POLICY=PASSIVE``
(so a process that waits, e.g. rollout during an update, leaves its cores to the one that works instead of spinning
on them). Figure: samples/s of the steady steps, pooled per setting. Not part of ``make bench`` (about 4 minutes):
``python -m bench.ring_threads``; it decided the thread setting ``rlhf up`` (services.plan.child_env) and so
bench.pipeline use: every core per process, ``OMP_WAIT_POLICY=PASSIVE``.
"""

from __future__ import annotations

import os
import shutil
import time

from bench._common import (
    CACHE,
    CORE_THREADS,
    QUICK,
    RedisServer,
    build_model,
    emit,
    log,
    rnd,
    scorer_services,
    side,
    write_yaml,
)
from bench.pipeline import _pool, experiment, run_ours

SETTINGS = {"quarter": max(1, (os.cpu_count() or 1) // 4), "all": CORE_THREADS}
STEPS = 1 if QUICK else 3
REPEATS = 1 if QUICK else 2


def main() -> None:
    started = time.monotonic()
    work = CACHE / "ring_threads"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    paths = build_model("small")
    order = ["quarter", "all"]
    runs = [w for i in range(REPEATS) for w in (order if i % 2 == 0 else order[::-1])]
    rows: dict[str, dict] = {}
    saved = os.environ.get("OMP_NUM_THREADS")
    try:
        with RedisServer(work / "redis") as redis:
            for which in runs:
                os.environ["OMP_NUM_THREADS"] = str(SETTINGS[which])  # inherited by every service started below
                os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # both settings (bench._common's default)
                cfg = write_yaml(work / "services.yaml", experiment("small", paths, "ppo", 1, "rt", work, 1))
                env = {"RLHF_REDIS_URL": redis.url}
                with scorer_services(cfg, work / "logs", env) as (reward, reference):
                    res = run_ours("small", paths, "ppo", 1, redis.url, reward, reference, work, STEPS)
                log(f"  {which}: {res['samples_per_s']:.2f} samples/s (steps {res['step_seconds']})")
                rows[which] = _pool(rows.get(which), res)
    finally:
        if saved is not None:
            os.environ["OMP_NUM_THREADS"] = saved
    for r in rows.values():
        r["samples_per_s"] = rnd(r["samples_per_s"])
    emit(
        "ring_threads",
        settings={
            "ring": "bench.pipeline's asynchronous small-model PPO ring (max_staleness 1, hf engine)",
            "resources": {
                k: side({s: v for s in ("trainer", "rollout", "reward", "reference")}, "each service process")
                for k, v in SETTINGS.items()
            },
            "measured_steps": STEPS,
            "runs_per_setting": REPEATS,
        },
        figures={"samples_per_s": rows},
        ratio={"all_vs_quarter": rnd(rows["all"]["samples_per_s"] / rows["quarter"]["samples_per_s"])},
        notes=["alternating runs (A, B, B, A) on a shared machine; the load average is recorded with the result"],
        started=started,
    )


if __name__ == "__main__":
    main()
