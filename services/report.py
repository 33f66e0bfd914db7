"""``rlhf report RUN_DIR``: plots and a short summary of a run from its ``metrics.jsonl``.

:func:`draw` writes ``reward.png``, ``kl.png``, ``losses.png``, ``lengths.png``, ``throughput.png`` (and
``dpo_rewards.png``, ``eval.png`` when their series are there) next to it; :func:`family` says which plot a series
goes to. Matplotlib with the Agg backend (no display needed; the ``plots`` extra, which the service images leave
out: without it :func:`draw` raises ImportError naming the extra); a truncated last line is skipped.

What each plot shows: docs/running.md#the-run-folder.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

PLOTS = ("reward.png", "kl.png", "losses.png", "lengths.png", "throughput.png")  # drawn for every run
DPO_PLOT = "dpo_rewards.png"
EVAL_PLOT = "eval.png"  # the eval section's rows (reward, pass@k), when there are any
# matplotlib is an extra (the service images leave it out): what a command without it says
PLOTS_EXTRA = "the plots need matplotlib: pip install 'rlhf-pipeline[plots]'"


def family(key: str) -> str | None:
    """The plot a metric belongs in (a file name of :data:`PLOTS` or :data:`DPO_PLOT`), or None."""
    k = key.lower()
    if k.startswith("eval/"):
        if "reward" in k or "pass@" in k:
            return EVAL_PLOT
        return "lengths.png" if "length" in k else None
    if k.startswith("rewards/"):
        return DPO_PLOT
    if k.startswith("loss"):
        return "losses.png"
    parts = k.split("/")
    if any(p == "kl" or p.endswith("kl") or p.startswith("kl_") for p in parts):
        return "kl.png"
    if ("reward" in k or k.startswith("score") or k.endswith("/scores")) and not k.endswith("/std"):
        return "reward.png"
    if k.startswith("response_length"):
        return "lengths.png"
    if k == "samples_per_s" or k.startswith("time/"):
        return "throughput.png"
    return None


def plot_keys(records: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Plot file -> the series it shows (``reward/mean``'s band and line are drawn by :func:`draw` itself)."""
    out: dict[str, list[str]] = {name: [] for name in PLOTS}
    for k in numeric_keys(records):
        f = family(k)
        if f is not None and k != "step":
            out.setdefault(f, []).append(k)
    return out


def parse_record(line: str | bytes) -> dict[str, Any] | None:
    """One metrics.jsonl line as a dict, or None for a blank, half-written or non-object line."""
    line = line.strip()
    if not line:
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file (lines that are not JSON objects are skipped)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return [rec for rec in map(parse_record, f) if rec is not None]


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def numeric_keys(records: Iterable[Mapping[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and _num(v) is not None:
                keys.setdefault(k, None)
    return list(keys)


def reward_key(records: Sequence[Mapping[str, Any]]) -> str | None:
    """The series that is "the mean reward": reward/mean, else reward, else the first reward*mean, else any reward."""
    keys = numeric_keys(records)
    for k in ("reward/mean", "reward", "rewards/mean", "score/mean"):
        if k in keys:
            return k
    for pred in (lambda k: "reward" in k and "mean" in k, lambda k: "reward" in k and "std" not in k):
        for k in keys:
            if pred(k.lower()):
                return k
    return None


def series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for i, r in enumerate(records):
        y = _num(r.get(key))
        if y is None:
            continue
        x = _num(r.get("step"))
        xs.append(x if x is not None else float(i))
        ys.append(y)
    return xs, ys


def _figure(title: str, ylabel: str):
    try:
        import matplotlib
    except ImportError:
        raise ImportError(PLOTS_EXTRA) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _save(fig, ax, path: Path, any_data: bool) -> Path:
    import matplotlib.pyplot as plt

    if any_data:
        ax.legend(loc="best", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def draw(run_dir: str | Path, records: Sequence[Mapping[str, Any]] | None = None) -> list[Path]:
    """Write the plots of :data:`PLOTS` (and :data:`DPO_PLOT` for online DPO) into ``run_dir`` from its
    metrics.jsonl; returns their paths."""
    run_dir = Path(run_dir)
    if records is None:
        records = load_metrics(run_dir / "metrics.jsonl")
    keys = numeric_keys(records)
    out = []

    fig, ax = _figure("reward", "reward")
    rk = reward_key(records)
    drawn = False
    if rk:
        xs, ys = series(records, rk)
        ax.plot(xs, ys, marker="o", markersize=3, label=rk, linewidth=2)
        std_key = rk.rsplit("/", 1)[0] + "/std" if "/" in rk else None
        if std_key in keys:
            band = []
            for i, r in enumerate(records):
                y, sd = _num(r.get(rk)), _num(r.get(std_key))
                if y is not None and sd is not None:
                    x = _num(r.get("step"))
                    band.append((x if x is not None else float(i), y, sd))
            if band:
                ax.fill_between(
                    [b[0] for b in band],
                    [b[1] - b[2] for b in band],
                    [b[1] + b[2] for b in band],
                    alpha=0.2,
                    label=f"± {std_key}",
                )
        drawn = bool(xs)
    groups = plot_keys(records)
    for k in groups.pop("reward.png"):
        if k != rk:
            xs, ys = series(records, k)
            ax.plot(xs, ys, linewidth=1, alpha=0.7, label=k)
            drawn = drawn or bool(xs)
    out.append(_save(fig, ax, run_dir / "reward.png", drawn))

    titles = {
        "kl.png": "KL divergence to the reference",
        "losses.png": "losses",
        "lengths.png": "response length",
        "throughput.png": "throughput and time",
        DPO_PLOT: "DPO implicit rewards",
        EVAL_PLOT: "evaluation on held-out prompts",
    }
    for name, chosen in groups.items():
        if name in (DPO_PLOT, EVAL_PLOT) and not chosen:
            continue
        fig, ax = _figure(titles[name], titles[name].split()[0])
        drawn = False
        for k in chosen:
            xs, ys = series(records, k)
            ax.plot(xs, ys, marker="o", markersize=2, label=k)
            drawn = drawn or bool(xs)
        out.append(_save(fig, ax, run_dir / name, drawn))
    return out


def summary(records: Sequence[Mapping[str, Any]]) -> str:
    """A few lines: steps, first/last mean reward (and the average over the first/last few steps), last KL."""
    if not records:
        return "no training steps recorded"
    evals = [r for r in records if any(k.startswith("eval/") for k in r)]
    records = [r for r in records if not any(k.startswith("eval/") for k in r)]
    lines = [f"steps: {len(records)}"]
    rk = reward_key(records)
    if rk:
        _, ys = series(records, rk)
        if ys:
            k = max(1, min(5, len(ys) // 4))
            first, last = sum(ys[:k]) / k, sum(ys[-k:]) / k
            lines.append(f"{rk}: first {ys[0]:+.4f}, last {ys[-1]:+.4f}")
            lines.append(
                f"{rk} averaged over the first/last {k} step(s): {first:+.4f} -> {last:+.4f} ({last - first:+.4f})"
            )
    for key in ("objective/kl",) + tuple(k for k in numeric_keys(records) if family(k) == "kl.png"):
        _, ys = series(records, key)
        if ys:
            lines.append(f"{key}: last {ys[-1]:.4f}")
            break
    if evals:
        last = evals[-1]
        pk = sorted(k for k in last if k.startswith("eval/pass@"))
        lines.append(
            f"eval at step {last.get('step')}: reward {last.get('eval/reward_mean', float('nan')):+.4f}"
            + "".join(f", {k.removeprefix('eval/')} {last[k]:.3f}" for k in pk)
            + f", failed {100 * last.get('eval/failed_fraction', 0.0):.0f}%"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        print(f"rlhf report: {metrics} does not exist", file=sys.stderr)
        return 2
    records = load_metrics(metrics)
    try:
        paths = draw(run_dir, records)
    except ImportError as err:  # the plots extra is missing: the summary needs no matplotlib
        print(summary(records))
        print(f"rlhf report: {err}", file=sys.stderr)
        return 1
    print(summary(records))
    print("plots: " + ", ".join(str(p) for p in paths))
    return 0
