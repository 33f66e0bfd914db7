"""bench.long_tail: a GRPO ring on a long-tailed response-length workload, synchronous and asynchronous, partial
rollouts off and on.

The real ring, each part its own process as ``rlhf up`` runs it (bench.pipeline's wiring: a private redis-server,
the reward and reference services, one rollout replica with the ``hf`` engine taking a whole batch of prompt jobs at
once, the trainer), the ``small`` model (~21M parameters, rlhf.tiny), GRPO (groups of 4, a rule reward: the digit
fraction of the response, one optimizer step per batch). Each prompt's response length is its own: the data set's
``max_tokens`` column (``data.map_keys.max_tokens``) holds a length drawn from a log-normal distribution with a
median of 64 and a 99th percentile of 512 tokens (issue 44), times ``--scale`` (default 0.25 on this 2-core machine:
median 16, p99 128), capped at twice the 99th percentile. The prompts go in file order (``data.shuffle: false``), so
every run trains on the same batches. The model is untrained: a sample may still end early at EOS (about 0.2% a
token), so the lengths are caps; the mean realised length is reported beside the planned one.

Four settings, ``training.max_staleness`` 0 (sync) or 1 (async) x ``actor_rollout.partial_rollouts`` off or on,
run one after the other in mirrored order (A B C D, D C B A: a load that comes and goes weighs on each alike). The
trainer pushes its weights to the replica after every step. Figures per measured step (the first step, with the
start-up, is left out), from the trainer's ``metrics.jsonl`` and the replica's ``/metrics`` read at the end of each
step: the replica's idle fraction (1 - the rise of ``rlhf_rollout_busy_seconds_total``, seconds with at least one
request admitted, over the step's wall time), the time the step's push waited for the requests in flight
(``rlhf_rollout_swap_wait_seconds``) and paused generation to install (``rlhf_rollout_swap_seconds``), samples/s
(samples trained / step time) and generated tokens/s (``rlhf_tokens_total{kind="generated"}``); "held by pushes" is
the push's wait and install over the step (admissions closed). Targets (issue 44), on the asynchronous ring with
partial rollouts on (a synchronous ring idles through every update by design): the replica held by pushes <= 5% of
the step, and idle (no request admitted, whatever the cause) <= 5%; asynchronous samples/s >= 1.5x synchronous.
``python -m bench.long_tail [--scale S] [--steps N] [--repeats R]``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench._common import (
    CACHE,
    CORE_THREADS,
    QUICK,
    RING_THREADS,
    RedisServer,
    build_model,
    emit,
    log,
    metric_rows,
    param_count,
    percentile,
    ring_services,
    rnd,
    rollout_threads,
    scorer_services,
    side,
    target,
    write_yaml,
)
from rlhf.data import builtin_arithmetic

# issue 44's workload at scale 1: a median response of 64 tokens, a 99th percentile of 512
MEDIAN, P99 = 64, 512
Z99 = 2.3263478740408408  # the standard normal's 99th percentile
PROMPTS = 8  # prompts per step (training.global_batch_size)
GROUP = 4  # samples per prompt (GRPO's group)
PROMPT_TOKENS = 48
TOKEN = "bench-long-tail-token"
SETTINGS = {  # name -> (max_staleness, partial_rollouts)
    "sync/off": (0, False),
    "sync/on": (0, True),
    "async/off": (1, False),
    "async/on": (1, True),
}


# ------------------------------------------------------------------------------------------------- pure parts


def long_tail_lengths(n: int, median: float, p99: float, cap: int, seed: int = 0) -> list[int]:
    """``n`` response lengths from the log-normal distribution with this median and 99th percentile, rounded and
    held within 1..``cap``; the same seed gives the same lengths."""
    if not 0 < median < p99:
        raise ValueError(f"need 0 < median < p99, got median {median}, p99 {p99}")
    sigma = math.log(p99 / median) / Z99
    rng = random.Random(seed)
    return [max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


@dataclass(frozen=True)
class Mark:
    """The replica's counters read at one moment (``t``: this process's monotonic clock)."""

    t: float
    busy_s: float  # rlhf_rollout_busy_seconds_total
    wait_s: float  # rlhf_rollout_swap_wait_seconds_sum
    pause_s: float  # rlhf_rollout_swap_seconds_sum
    pushes: float  # rlhf_rollout_swap_wait_seconds_count
    generated: float  # rlhf_tokens_total{kind="generated"}


def read_mark(text: str, t: float) -> Mark:
    """A :class:`Mark` from the Prometheus text of the rollout service's ``/metrics`` (a counter not yet written,
    such as the swap histograms before the first push, reads 0)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "rlhf_tokens_total" and s.labels.get("kind") != "generated":
                continue
            values[s.name] = s.value
    return Mark(
        t=t,
        busy_s=values.get("rlhf_rollout_busy_seconds_total", 0.0),
        wait_s=values.get("rlhf_rollout_swap_wait_seconds_sum", 0.0),
        pause_s=values.get("rlhf_rollout_swap_seconds_sum", 0.0),
        pushes=values.get("rlhf_rollout_swap_wait_seconds_count", 0.0),
        generated=values.get("rlhf_tokens_total", 0.0),
    )


def step_windows(marks: list[Mark]) -> list[dict]:
    """Per window between consecutive marks (a training step): its wall time, the replica's idle fraction (the
    share of the window with no request admitted), the pushes' wait for requests in flight and install pause, the
    pushes installed and the tokens generated."""
    out = []
    for a, b in zip(marks, marks[1:], strict=False):
        wall = b.t - a.t
        if wall <= 0:
            raise ValueError(f"marks out of order: {a.t} then {b.t}")
        busy = b.busy_s - a.busy_s
        out.append(
            {
                "wall_s": wall,
                "idle_fraction": min(1.0, max(0.0, 1.0 - busy / wall)),
                "push_wait_s": b.wait_s - a.wait_s,
                "push_pause_s": b.pause_s - a.pause_s,
                "pushes": int(round(b.pushes - a.pushes)),
                "generated_tokens": int(round(b.generated - a.generated)),
            }
        )
    return out


def summarise(windows: list[dict], rows: list[dict]) -> dict:
    """One run's figures: ``windows`` from :func:`step_windows`, ``rows`` the trainer's metrics rows of the same
    steps. Fractions and rates are over the steps' summed times (a long step weighs as long as it took)."""
    wall = sum(w["wall_s"] for w in windows)
    step_s = sum(r["time/iteration_s"] for r in rows)
    samples = sum(r["samples"] for r in rows)
    return {
        "steps_measured": len(rows),
        "samples_per_s": samples / step_s,
        "generated_tokens_per_s": sum(w["generated_tokens"] for w in windows) / wall,
        "idle_fraction": sum(w["idle_fraction"] * w["wall_s"] for w in windows) / wall,
        "push_wait_s_per_step": sum(w["push_wait_s"] for w in windows) / len(windows),
        "push_wait_fraction": sum(w["push_wait_s"] for w in windows) / wall,
        # the share of the step a push held admissions closed: its wait for the requests in flight and its install
        "push_stall_fraction": sum(w["push_wait_s"] + w["push_pause_s"] for w in windows) / wall,
        "push_pause_s_per_step": sum(w["push_pause_s"] for w in windows) / len(windows),
        "pushes": sum(w["pushes"] for w in windows),
        "response_length_mean": sum(r["response_length/mean"] * r["samples"] for r in rows) / samples,
        "step_seconds": [r["time/iteration_s"] for r in rows],
        "idle_fraction_per_step": [w["idle_fraction"] for w in windows],
        "push_wait_s_per_step_list": [w["push_wait_s"] for w in windows],
        "staleness_mean": sum(r.get("staleness/mean", 0.0) for r in rows) / len(rows),
    }


def pool(a: dict | None, b: dict) -> dict:
    """Two runs of one setting as one: step-weighted (by time) where the figure is a rate or a fraction."""
    if a is None:
        return {**b, "runs": 1}
    ta, tb = sum(a["step_seconds"]), sum(b["step_seconds"])
    na, nb = a["steps_measured"], b["steps_measured"]
    out = {**a, "runs": a["runs"] + 1, "steps_measured": na + nb, "pushes": a["pushes"] + b["pushes"]}
    for k in ("samples_per_s", "generated_tokens_per_s", "idle_fraction", "push_wait_fraction", "push_stall_fraction"):
        out[k] = (a[k] * ta + b[k] * tb) / (ta + tb)
    for k in ("push_wait_s_per_step", "push_pause_s_per_step", "response_length_mean", "staleness_mean"):
        out[k] = (a[k] * na + b[k] * nb) / (na + nb)
    for k in ("step_seconds", "idle_fraction_per_step", "push_wait_s_per_step_list"):
        out[k] = a[k] + b[k]
    return out


# ------------------------------------------------------------------------------------------------- the ring


def write_data(path: Path, lengths: list[int]) -> Path:
    rows = builtin_arithmetic(len(lengths))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row, n in zip(rows, lengths, strict=True):
            f.write(json.dumps({**row, "max_tokens": n}) + "\n")
    return path


def experiment(paths, data: Path, cap: int, staleness: int, partial: bool, run_id: str, run_dir: Path) -> dict:
    return {
        "run_id": run_id,
        "training": {
            "stage": "ray_grpo",
            "global_batch_size": PROMPTS,
            "seq_length": PROMPT_TOKENS + cap,
            "train_iters": 1000,
            "lr": 1e-5,
            "save_interval": 10_000,
            "save": str(run_dir / "checkpoints"),
            "device": "cpu",
            "max_staleness": staleness,
            "seed": 1,
            "padding_free": True,
        },
        "actor_rollout_ref": {
            "actor_rollout": {
                "load": str(paths.policy),
                "engine": "hf",
                "partial_rollouts": partial,
                "do_sample": True,
                "temperature": 1.0,
                "max_prompt_length": PROMPT_TOKENS,
                "max_new_tokens": cap,
                "n_samples_per_prompt": GROUP,
                "ppo_mini_batch_size": PROMPTS * GROUP,
                "ppo_epochs": 1,
                "clip_ratio": 0.2,
            },
            "ref": {"micro_batch_size": 32},
        },
        "reward": {"scorers": [{"type": "rule", "name": "char_fraction"}]},
        "algorithm": {
            "adv_estimator": "grpo",
            "kl_penalty": "low_var_kl",
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.01},
            "missing_eos_penalty": 0.0,
        },
        "data": {
            "path": str(data),
            "shuffle": False,
            "map_keys": {"prompt": "prompt", "label": "label", "max_tokens": "max_tokens"},
        },
    }


def _scrape(url: str) -> Mark:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    t = time.monotonic()
    with urllib.request.urlopen(req, timeout=10) as resp:
        return read_mark(resp.read().decode(), t)


def run_setting(name: str, paths, data: Path, cap: int, redis_url: str, scorers, work: Path, steps: int) -> dict:
    staleness, partial = SETTINGS[name]
    run_id = f"lt-{name.replace('/', '-')}-{int(time.time())}"
    run_dir = work / run_id
    cfg = write_yaml(run_dir / "config.yaml", experiment(paths, data, cap, staleness, partial, run_id, run_dir))
    # two batches' jobs in flight: the asynchronous ring's admission allows them (max_staleness 1), and the next
    # batch can start beside the long tail of the one before
    rollout, trainer = ring_services(cfg, run_dir, run_id, redis_url, TOKEN, scorers, "hf", 2 * PROMPTS)
    metrics = run_dir / "metrics.jsonl"
    url = rollout.http_url + "/metrics"
    marks: list[Mark] = []
    t0 = time.monotonic()
    try:
        rollout.start(wait_ready=False)
        trainer.start(wait_ready=False)
        while (n := len(metric_rows(metrics))) < steps + 1:
            if n > len(marks):  # a step ended (the first: start-up): read the replica's counters
                marks.append(_scrape(url))
            for proc in (trainer, rollout):
                if proc.proc is not None and proc.proc.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited {proc.proc.returncode}:\n{proc.log_tail()}")
            if time.monotonic() - t0 > 900:
                raise TimeoutError(f"{run_id}: no progress in 900 s:\n{trainer.log_tail()}")
            time.sleep(0.02)
        marks.append(_scrape(url))
        if len(marks) != steps + 1:  # two steps ended within one poll: their windows cannot be told apart
            raise RuntimeError(f"{run_id}: {len(marks)} reads of /metrics for {steps + 1} steps; run it again")
    finally:
        trainer.stop(kill=True)
        rollout.stop(kill=True)
    rows = metric_rows(metrics)[1 : steps + 1]
    res = summarise(step_windows(marks), rows)
    res["wall_s"] = round(time.monotonic() - t0, 1)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.long_tail", description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=0.25, help="response lengths x this (1: median 64, p99 512)")
    p.add_argument("--steps", type=int, default=1 if QUICK else 4, help="measured steps per run")
    p.add_argument("--repeats", type=int, default=1 if QUICK else 2, help="runs per setting (mirrored order)")
    args = p.parse_args(argv)
    started = time.monotonic()
    median, p99 = MEDIAN * args.scale, P99 * args.scale
    cap = max(2, round(2 * p99))
    if median < 1:
        raise SystemExit(f"--scale {args.scale} makes the median response {median:.2f} tokens: use a larger scale")
    overrides = {}
    if PROMPT_TOKENS + cap > 512:  # the small model's positions (rlhf.tiny's default 512)
        overrides["max_position_embeddings"] = 1 << (PROMPT_TOKENS + cap - 1).bit_length()
    work = CACHE / "long_tail"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    paths = build_model("small", **overrides)
    lengths = long_tail_lengths(512, median, p99, cap)
    data = write_data(work / "data.jsonl", lengths)
    # the batches a run trains on, the start-up step's included (jobs go in file order)
    used = lengths[: PROMPTS * (args.steps + 1)]
    order = list(SETTINGS)
    runs = [s for i in range(args.repeats) for s in (order if i % 2 == 0 else order[::-1])]
    figures: dict[str, dict] = {}
    with RedisServer(work / "redis") as redis:
        cfg = write_yaml(work / "services.yaml", experiment(paths, data, cap, 0, False, "lt", work))
        with scorer_services(cfg, work / "logs", {"RLHF_REDIS_URL": redis.url}) as scorers:
            for name in runs:
                res = run_setting(name, paths, data, cap, redis.url, scorers, work, args.steps)
                log(
                    f"bench.long_tail {name}: {res['samples_per_s']:.2f} samples/s, idle "
                    f"{res['idle_fraction']:.1%}, push wait {res['push_wait_s_per_step']:.2f} s/step, "
                    f"steps {[rnd(x) for x in res['step_seconds']]}"
                )
                figures[name] = pool(figures.get(name), res)
    for f in figures.values():
        for k, v in f.items():
            if isinstance(v, float):
                f[k] = rnd(v)
            elif isinstance(v, list):
                f[k] = [rnd(x) for x in v]
    sps = {k: v["samples_per_s"] for k, v in figures.items()}
    ratio = {
        "async_vs_sync_partial_on": rnd(sps["async/on"] / sps["sync/on"]),
        "async_vs_sync_partial_off": rnd(sps["async/off"] / sps["sync/off"]),
        "async_on_vs_off_samples_per_s": rnd(sps["async/on"] / sps["async/off"]),
        "sync_on_vs_off_samples_per_s": rnd(sps["sync/on"] / sps["sync/off"]),
    }
    idle_on = figures["async/on"]["idle_fraction"]
    stall_on = figures["async/on"]["push_stall_fraction"]
    emit(
        "long_tail",
        settings={
            "resources": {
                "ring": side(
                    {
                        "trainer": RING_THREADS,
                        "rollout": rollout_threads("hf"),
                        "reward": RING_THREADS,
                        "reference": RING_THREADS,
                    },
                    "each service process (rlhf up's threads); every setting alike",
                )
            },
            "model": f"small, {param_count(paths.policy) / 1e6:.2f}M parameters, float32, cpu",
            "engine": "hf",
            "algorithm": f"GRPO, {PROMPTS} prompts x {GROUP} samples a step, one optimizer step, rule reward "
            "(digit fraction), lr 1e-5, temperature 1",
            "lengths": f"log-normal, median {median:g}, p99 {p99:g} (issue 44's 64 / 512 x scale {args.scale:g}), "
            f"capped at {cap}; a row's max_tokens (EOS may end a sample earlier)",
            "lengths_of_the_batches_trained": {
                "median": percentile(used, 50),
                "p90": percentile(used, 90),
                "p99": percentile(used, 99),
                "max": max(used),
                "mean": rnd(sum(used) / len(used)),
            },
            "measured_steps_per_run": args.steps,
            "runs_per_setting": args.repeats,
            "cores": CORE_THREADS,
        },
        figures=figures,
        ratio=ratio,
        targets=[
            target(
                "replica held by pushes (wait for the requests in flight + install) / step, async, partial on",
                stall_on,
                "<= 0.05",
                stall_on <= 0.05,
            ),
            target(
                "replica idle (no request admitted) / step, async, partial on",
                idle_on,
                "<= 0.05",
                idle_on <= 0.05,
            ),
            target(
                "async / sync samples/s, partial rollouts on",
                ratio["async_vs_sync_partial_on"],
                ">= 1.5x",
                (ratio["async_vs_sync_partial_on"] or 0) >= 1.5,
            ),
        ],
        notes=[
            "the machine is shared (other work on the same cores during the run): compare the settings' ratios, "
            "not the absolute rates",
            "idle: no request admitted in the replica (a sync ring idles through every update by design)",
        ],
        started=started,
        command="python -m bench.long_tail" + (f" --scale {args.scale:g}" if args.scale != 0.25 else ""),
    )


if __name__ == "__main__":
    main()
