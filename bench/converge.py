"""``make converge``: does training make the warm-started policies better at their tasks, and how fast against TRL.

Each run is the ring as a user runs it (``rlhf up``, the vLLM engine) on ``configs/learn-<task>.yaml`` with one
algorithm, mode (``max_staleness`` 0 or 1) and seed, to the config's sample budget; TRL 1.12 trains the same model on
the same task beside it (``bench/_trl_learning.py`` in ``.venv-parity``). One JSON line per run goes to
``.cache/converge/results.jsonl``; ``bench.learning_report`` turns them into docs/learning.md. Design and figures:
docs/learning.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / ".cache" / "converge"
TASKS = ("reverse_words", "addition")
LEVELS = tuple(round(0.05 * i, 2) for i in range(1, 21))
SMOOTH = 3  # evaluations in the moving average every figure is read from

# per algorithm: the config overrides that select it (the task's file is GRPO)
ALGOS: dict[str, list[str]] = {
    "grpo": [],
    "ppo": ["training.stage=ray_ppo", "algorithm.adv_estimator=gae", "critic.load=tiny:reward"],
    "online_dpo": [
        "training.stage=ray_online_dpo",
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor_rollout.n_samples_per_prompt=2",
        "actor_rollout_ref.actor_rollout.ppo_mini_batch_size=32",
    ],
    "rloo": ["training.stage=ray_rloo", "algorithm.adv_estimator=rloo", "algorithm.kl_penalty=kl"],  # TRL's k1
    "reinforce_pp": ["training.stage=ray_reinforce_plus_plus", "algorithm.adv_estimator=reinforce_plus_plus"],
}
LORA = ["actor_rollout_ref.actor_rollout.lora_r=8", "actor_rollout_ref.actor_rollout.lora_alpha=16"]
TRL_ALGOS = ("grpo", "rloo", "online_dpo")
# the sample budget (steps of the config's batch) and greedy pass@1 on the held-out problems, on both sides
BUDGET = ["training.train_iters=60", "eval.interval=5"]
# how the held-out problems are evaluated: greedy (one answer each), or sampled as in training (4 answers each at the
# training temperature: pass@1 is then the policy's expected pass rate, the quantity RL optimises)
EVALS = {
    "greedy": ["eval.n=1", "eval.temperature=0.0"],
    "sampled": ["eval.n=4", "eval.temperature=1.0"],
}


@dataclass(frozen=True)
class Run:
    task: str
    algo: str
    mode: str  # sync | async
    seed: int
    side: str = "ours"  # ours | trl
    lora: bool = False
    eval: str = "greedy"  # a key of EVALS
    extra: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        lora = "-lora" if self.lora else ""
        kind = "" if self.eval == "greedy" else f"-{self.eval}"
        return f"{self.side}-{self.task}-{self.algo}{lora}-{self.mode}-s{self.seed}{kind}"

    def overrides(self) -> list[str]:
        staleness = 0 if self.mode == "sync" else 1
        return [
            *ALGOS[self.algo],
            *(LORA if self.lora else []),
            f"training.max_staleness={staleness}",
            f"training.seed={self.seed}",
            *BUDGET,
            *EVALS[self.eval],
            *self.extra,
        ]


def plan(tasks=TASKS, grpo_seeds=(1, 2, 3), other_seeds=(1,), trl=True, evals=tuple(EVALS)) -> list[Run]:
    """Every run of ``make converge``: greedy evaluations of GRPO sync and async on several seeds, the other
    algorithms on one, one LoRA run per task, and TRL's GRPO (same seeds), RLOO and online DPO; then GRPO, ours and
    TRL's, again with sampled evaluations."""
    runs = plan_greedy(tasks, grpo_seeds, other_seeds, trl) if "greedy" in evals else []
    if "sampled" in evals:
        for task in tasks:
            sides = [("ours", "sync"), ("ours", "async")] + ([("trl", "sync")] if trl else [])
            runs += [Run(task, "grpo", m, s, side=side, eval="sampled") for side, m in sides for s in grpo_seeds]
    return runs


def plan_greedy(tasks, grpo_seeds, other_seeds, trl) -> list[Run]:
    runs = []
    for task in tasks:
        for algo in ALGOS:
            for mode in ("sync", "async"):
                runs += [Run(task, algo, mode, s) for s in (grpo_seeds if algo == "grpo" else other_seeds)]
        runs.append(Run(task, "grpo", "sync", other_seeds[0], lora=True))
        if trl:
            runs += [Run(task, "grpo", "sync", s, side="trl") for s in grpo_seeds]
            runs += [Run(task, a, "sync", other_seeds[0], side="trl") for a in TRL_ALGOS if a != "grpo"]
    return runs


def smoothed(values: list[float], window: int = SMOOTH) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


def summarize(curve: list[dict], metric: str = "pass@1") -> dict:
    """Start, smoothed end and gain of ``metric`` over a curve of evaluations, and per accuracy level the first
    samples and seconds at which the smoothed curve reached it."""
    if not curve:
        raise ValueError("no evaluation in the run: the curve is empty")
    values = [p[metric] for p in curve]
    if any(v is None or v != v for v in values):
        raise ValueError(f"{metric} is missing or NaN in an evaluation")
    smooth = smoothed(values)
    reach = {}
    for level in (lv for lv in LEVELS if lv > values[0] + 1e-9):  # improvements only
        hit = next((p for p, s in zip(curve, smooth, strict=True) if s >= level - 1e-9), None)
        if hit is not None:
            reach[f"{level:.2f}"] = {"samples": hit["samples"], "seconds": round(hit["seconds"], 1)}
    end = sum(values[-SMOOTH:]) / len(values[-SMOOTH:])
    return {"start": values[0], "end": end, "gain": end - values[0], "reach": reach}


def curve_of_run(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(evaluations, steps) of a ring's metrics.jsonl: each evaluation with the samples trained and the training
    seconds (the steps' wall time, start-up excluded) at its step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = sorted((r for r in rows if "reward/mean" in r), key=lambda r: r["step"])
    samples, seconds, at = 0, 0.0, {0: (0, 0.0)}
    for r in steps:
        samples += int(r["samples"])
        seconds += float(r["time/iteration_s"])
        at[r["step"]] = (samples, seconds)
    curve = [
        {
            "step": r["step"],
            "samples": at[r["step"]][0],
            "seconds": at[r["step"]][1],
            "pass@1": r["eval/pass@1"],
            "reward_mean": r["eval/reward_mean"],
        }
        for r in sorted((r for r in rows if "eval/pass@1" in r), key=lambda r: r["step"])
    ]
    trained = [
        {
            "step": r["step"],
            "reward_mean": r["reward/mean"],
            "mismatch_kl": r.get("mismatch/kl"),
            "staleness_max": r.get("staleness/max"),
        }
        for r in steps
    ]
    return curve, trained


def run_ours(run: Run, out: Path, env: dict) -> dict:
    run_dir = out / "runs" / run.name
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: rlhf up would resume a folder it finds
    cmd = [
        str(ROOT / ".venv" / "bin" / "rlhf"),
        "up",
        "--config",
        f"configs/learn-{run.task.replace('_', '-')}.yaml",
        "--run-dir",
        str(run_dir),
        *run.overrides(),
    ]
    t0 = time.perf_counter()
    log = out / "logs" / f"{run.name}.log"
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"{run.name}: rlhf up exited {rc} (log: {log})")
    curve, trained = curve_of_run(run_dir)
    return {
        "curve": curve,
        "train": trained,
        "wall_s": round(time.perf_counter() - t0, 1),
        "cores": os.cpu_count(),
        "threads": "rlhf up defaults (each service one thread short of the cores)",
    }


def run_trl(run: Run, out: Path, env: dict) -> dict:
    result = out / "runs" / f"{run.name}.json"
    cmd = [
        str(ROOT / ".venv-parity" / "bin" / "python"),
        "-m",
        "bench._trl_learning",
        "--config",
        f"configs/learn-{run.task.replace('_', '-')}.yaml",
        "--algo",
        run.algo,
        "--seed",
        str(run.seed),
        "--threads",
        str(os.cpu_count()),
        "--out",
        str(result),
        *(arg for o in (*BUDGET, *EVALS[run.eval]) for arg in ("--set", o)),
    ]
    log = out / "logs" / f"{run.name}.log"
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"{run.name}: the TRL worker exited {rc} (log: {log})")
    data = json.loads(result.read_text())
    return {
        "curve": data["curve"],
        "train": data.get("train_reward", []),
        "wall_s": data.get("seconds_total"),
        "cores": data.get("cores"),
        "threads": data.get("threads"),
        "trl": data,
    }


def execute(run: Run, out: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    row = {
        "run": run.name,
        "eval": run.eval,
        "side": run.side,
        "task": run.task,
        "algo": run.algo,
        "mode": run.mode,
        "seed": run.seed,
        "lora": run.lora,
    }
    try:
        got = run_trl(run, out, env) if run.side == "trl" else run_ours(run, out, env)
        row.update(got)
        row["pass@1"] = summarize(got["curve"], "pass@1")
        row["reward"] = summarize(got["curve"], "reward_mean")
    except (RuntimeError, ValueError, OSError, KeyError) as err:
        row["error"] = str(err)  # reported with the others: a run that fails is a row, never dropped
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.converge", description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated tasks (default both)")
    p.add_argument("--algos", default=None, help="comma-separated algorithms of ours to run (default all)")
    p.add_argument("--grpo-seeds", default="1,2,3")
    p.add_argument("--no-trl", action="store_true", help="skip TRL's side")
    p.add_argument(
        "--evals", default="greedy", help="greedy and/or sampled (GRPO, ours and TRL's) evaluations, comma-separated"
    )
    p.add_argument("--only-trl", action="store_true", help="only TRL's side")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    seeds = tuple(int(s) for s in args.grpo_seeds.split(","))
    runs = plan(tuple(args.tasks.split(",")), seeds, trl=not args.no_trl, evals=tuple(args.evals.split(",")))
    if args.algos:
        runs = [r for r in runs if r.algo in args.algos.split(",") or r.side == "trl"]
    if args.only_trl:
        runs = [r for r in runs if r.side == "trl"]
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    for i, run in enumerate(runs, 1):
        print(f"[converge {i}/{len(runs)}] {run.name}", file=sys.stderr, flush=True)
        row = execute(run, args.out)
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
        brief = {k: row[k] for k in ("run", "error") if k in row}
        if "pass@1" in row:
            brief.update(start=round(row["pass@1"]["start"], 3), end=round(row["pass@1"]["end"], 3))
        print(json.dumps(brief), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
