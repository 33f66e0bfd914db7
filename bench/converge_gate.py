"""The convergence gate of ``make test`` (tests/e2e/test_convergence.py) and the metric band it is held to.

One GRPO run on reverse_words as a user runs it: ``rlhf up`` for the first half of the steps, then ``rlhf up
--resume`` to the end. ``python -m bench.converge_gate --runs 5`` repeats it on seeds 1..5 and writes the trusted band
(bench/converge_band.json): per step, the range of each key metric over those runs, widened by a margin. How to widen
it on purpose: docs/learning.md, "The convergence gate".
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from bench._common import cpu_model

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "learn-reverse-words.yaml"
BAND = Path(__file__).resolve().parent / "converge_band.json"
STEPS, RESUME_AT = 30, 15
# the metrics held to the band: held-out evaluations (every 5 steps) and the training reward (5-step means)
EVAL_KEYS = ("eval/reward_mean", "eval/pass@1")
TRAIN_KEY = "reward/mean"
MARGIN = 1.0  # of the band's width, added on each side
MIN_HALF_WIDTH = 0.08


def up(args: list[str], timeout: float = 600) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--quiet", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"rlhf up {' '.join(args)} exited {out.returncode}: {out.stdout[-2000:]}{out.stderr[-2000:]}"
        )


def run_gate(run_dir: Path, seed: int = 1) -> list[dict]:
    """The gate's run: STEPS steps, stopped after RESUME_AT (a checkpoint there) and resumed; metrics.jsonl rows."""
    first = [f"training.train_iters={RESUME_AT}", f"training.save_interval={RESUME_AT // 3}", f"training.seed={seed}"]
    up(["--config", str(CONFIG), "--run-dir", str(run_dir), *first])
    up(["--resume", str(run_dir), f"training.train_iters={STEPS}"])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def key_metrics(rows: list[dict]) -> dict[str, dict[str, float]]:
    """{metric: {step: value}}: the evaluations at their steps, the training reward as 5-step means (at each 5th
    step). A metric missing where it is due, or not finite, raises ValueError: a gap is an error, never a pass."""
    out: dict[str, dict[str, float]] = {k: {} for k in (*EVAL_KEYS, TRAIN_KEY)}
    evals = {r["step"]: r for r in rows if "eval/pass@1" in r}
    train = {r["step"]: r for r in rows if TRAIN_KEY in r}
    for step in range(0, STEPS + 1, 5):
        for k in EVAL_KEYS:
            out[k][str(step)] = _finite(evals.get(step, {}).get(k), k, step)
        if step:
            window = [_finite(train.get(s, {}).get(TRAIN_KEY), TRAIN_KEY, s) for s in range(step - 4, step + 1)]
            out[TRAIN_KEY][str(step)] = sum(window) / 5
    return out


def _finite(value, key: str, step: int) -> float:
    if value is None:
        raise ValueError(f"{key} is missing at step {step}")
    if not math.isfinite(value):
        raise ValueError(f"{key} is {value} at step {step}")
    return float(value)


def make_band(runs: list[dict[str, dict[str, float]]]) -> dict:
    band: dict = {"runs": len(runs), "margin": MARGIN, "min_half_width": MIN_HALF_WIDTH, "metrics": {}}
    for key in runs[0]:
        band["metrics"][key] = {}
        for step in runs[0][key]:
            values = [r[key][step] for r in runs]
            lo, hi = min(values), max(values)
            pad = max(MARGIN * (hi - lo), MIN_HALF_WIDTH)
            band["metrics"][key][step] = [round(lo - pad, 4), round(hi + pad, 4)]
    return band


def outside_band(metrics: dict[str, dict[str, float]], band: dict) -> list[str]:
    """Every value outside its trusted range (a metric or step the band has and the run lacks counts too)."""
    misses = []
    for key, steps in band["metrics"].items():
        for step, (lo, hi) in steps.items():
            value = metrics.get(key, {}).get(step)
            if value is None:
                misses.append(f"{key} at step {step}: missing")
            elif not lo <= value <= hi:
                misses.append(f"{key} at step {step}: {value:.4f} outside [{lo}, {hi}]")
    return misses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.converge_gate", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="gate runs (seeds 1..N) the band is made from")
    p.add_argument(
        "--add",
        action="store_true",
        help="keep the band's runs from other CPU models and make the band from all of them (on another machine)",
    )
    p.add_argument("--work", type=Path, default=ROOT / ".cache" / "converge-gate")
    p.add_argument("--out", type=Path, default=BAND)
    args = p.parse_args(argv)
    cpu = cpu_model()  # a warm start and its curve differ between CPU models (docs/learning.md)
    kept = []
    if args.add and args.out.exists():
        kept = [r for r in json.loads(args.out.read_text())["seen"] if r.get("cpu") != cpu]
    runs = []
    for seed in range(1, args.runs + 1):
        run_dir = args.work / f"seed{seed}"
        if run_dir.exists():
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        runs.append({"cpu": cpu, "seed": seed, **key_metrics(run_gate(run_dir, seed))})
        print(json.dumps(runs[-1]), flush=True)
    seen = kept + runs
    band = make_band([{k: v for k, v in r.items() if k in (*EVAL_KEYS, TRAIN_KEY)} for r in seen])
    args.out.write_text(
        json.dumps({**band, "cpus": sorted({r.get("cpu", "?") for r in seen}), "seen": seen}, indent=1) + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
