"""bench.pipeline: training samples/s of rlhf-pipeline (sync and async) vs TRL 1.12 and vs the compute bound.

The same model, prompts, batch, response length and epochs on every side, for the tiny test model and the small one
(~21M parameters, built locally by rlhf.tiny), all on this machine's CPU, every side on the same cores
(``settings.resources`` gives each side's cores and threads):

- rlhf-pipeline: the real ring, each part its own process as ``rlhf up`` runs it (a private redis-server, the
  reward and reference services, one rollout replica with the ``hf`` engine taking a whole batch of prompt jobs at
  once (``RLHF_ROLLOUT_MAX_INFLIGHT_JOBS`` = 16, as TRL generates the batch at once), the trainer service; wired
  through the same ``RLHF_*`` variables and threads as ``rlhf up`` sets them). Synchronous is
  ``training.max_staleness: 0``, asynchronous ``max_staleness: 1`` (rollout of the next batch overlaps the update;
  samples one version old are corrected by truncated importance sampling). Weights are pushed to the replica after
  every update. Reward and reference services start once per model size; each run gets a fresh replica and trainer
  (versions never go backwards). Figure: samples trained / wall time of the steady steps (the first step, which
  includes start-up, is left out; the trainer is stopped before its final checkpoint), from ``metrics.jsonl``.
- TRL: ``PPOTrainer.train()`` / ``OnlineDPOTrainer.train()`` in .venv-parity (one worker process,
  :mod:`bench._trl_worker`, imported once) with torch's default threads, one per core, as a user runs it. Figure:
  samples / wall time of every update but the first.
- the compute bound (:mod:`bench._bound`, since issue 34): the model passes one ring step needs (generation with
  the ring's engine, hf or with ``BENCH_ENGINE=vllm`` vLLM, reward and reference forwards, the trainer's update, the
  weights into the generator), the same engine classes and configuration as the ring, each phase measured in one
  process at every thread count from 1 to the cores; a phase's cost is its least core-seconds over the thread counts
  (wall x threads, or the CPU seconds it used where fewer), the bound's step time their sum over the cores. No ring,
  synchronous or not, can beat it: its step times the cores is at least the CPU it spends, at least each phase's
  least CPU. The ring's step time over it is what the service split, queue, RPC, serialisation, idle cores and
  threads that scale worse than the best count cost; ``profile`` sets each ring process's core-seconds per step
  (``/proc``) beside the bound's share of its phases. ``serial_step_s`` is the former bound (until issue 34): the
  phases back to back in one process on every thread, which the asynchronous ring can beat by overlapping phases.
  For PPO it also reports its update's roofline (``bench._bound.roofline``, the update at every thread): the
  update's FLOPs (torch's flop counter) over its seconds against torch.mm's own fp32 rate on this machine, which
  says how much any schedule of the same work could still gain. Every figure carries the CPU model (``cpu``).

Settings (every side): 16 prompts per update from the built-in arithmetic set (chat template, up to 48 tokens), up to
16 new tokens (stop at EOS), temperature 1, lr 1e-5; PPO: GAE (gamma 1, lambda 0.95), 2 epochs over 2 minibatches
of 8 for the policy and the critic (initialised from the reward model), reward model = the tiny/small reward head;
online DPO: 2 samples per prompt, one step per batch, sigmoid loss, beta 0.1, the reward model judges each pair.
The runs alternate (TRL, bound, sync, async for PPO; the reverse for online DPO); the small model's PPO runs twice
in mirrored order (TRL, bound, sync, async, async, sync, bound, TRL) and each side's figure pools the steps of both.
Online DPO on the small model runs only with ``BENCH_FULL=1``. Targets: asynchronous PPO >= 1.5x TRL's samples/s
and step time <= 1.05x the compute bound's (issue 34; <= 1.15x of the former serial bound before), on the small
model. ``BENCH_ENGINE=vllm`` runs the ring with vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench._bound import per_step, summary
from bench._common import (
    CACHE,
    CORE_THREADS,
    QUICK,
    REPO,
    RING_THREADS,
    RedisServer,
    build_model,
    cpu_model,
    emit,
    log,
    metric_rows,
    param_count,
    proc_cpu_seconds,
    ring_services,
    rnd,
    rollout_threads,
    scorer_services,
    side,
    target,
    write_yaml,
)
from rlhf.config import parse_config
from rlhf.data import encode_prompt, load_prompts
from rlhf.models import load_tokenizer
from rlhf.serving.model_process import forward_threads

PARITY_PY = Path(os.environ.get("BENCH_PARITY_PYTHON", REPO / ".venv-parity" / "bin" / "python"))
BATCH = 16
MINI = 8
EPOCHS = 2
NEW_TOKENS = 16
PROMPT_TOKENS = 48
LR = 1e-5
# Measured steps per run (each side runs one warm-up step first). The small ring's first steps after it still warm up
# (the first pushes allocate the bucket buffers both ends then reuse, the replica double-buffers two versions): 6
# steps weigh that as a run of hundreds would not, and halve the noise of a 3-step figure on this shared machine.
STEPS = {"tiny": 3, "small": 6}
# Runs per side: the small model's are repeated in mirrored order (TRL, sync, async, async, sync, TRL), so a load
# that comes and goes on this shared machine weighs on every side alike; a side's figure pools its runs' steps.
REPEATS = {"tiny": 1, "small": 2}
if QUICK:
    STEPS = {"tiny": 1, "small": 1}
    REPEATS = {"tiny": 1, "small": 1}
# Online DPO on the small model adds ~3 minutes (three more runs of a 21M-parameter ring): only with BENCH_FULL=1, so
# that the default run stays within 5 minutes on 2 cores. The target (PPO, small) is always measured.
ALGOS = {"tiny": ("ppo", "online_dpo"), "small": ("ppo", "online_dpo") if os.environ.get("BENCH_FULL") else ("ppo",)}
# BENCH_SIZES=small measures one model size only (while working on one figure); `make bench` runs both.
SIZES = tuple(x for x in os.environ.get("BENCH_SIZES", "tiny,small").split(",") if x in ALGOS)
TOKEN = "bench-pipeline-token"
# Padding-free actor/critic/reference passes (rlhf.packing; exact, and faster: bench.padding_free) in the ring and the
# compute bound alike; BENCH_PADDING_FREE=0 measures the padded passes
CPU = cpu_model()  # recorded with every figure
PADDING_FREE = os.environ.get("BENCH_PADDING_FREE", "1") != "0"
# The ring's rollout engine: hf unless BENCH_ENGINE=vllm (see the notes for why hf)
ENGINE = os.environ.get("BENCH_ENGINE", "hf")
if ENGINE not in ("hf", "vllm"):
    raise SystemExit(f"BENCH_ENGINE must be hf or vllm, not {ENGINE!r}")


class TRLWorker:
    def __init__(self, log_path: Path):
        if not PARITY_PY.exists():
            raise RuntimeError(f"{PARITY_PY} is missing: run `make setup` (it builds .venv-parity with TRL 1.12)")
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO)
        # TRL runs as a user runs it: one process with torch's default threads, one per core it may use (the ring's
        # cores; the ring's four processes get RING_THREADS each, as `rlhf up` gives them)
        env["OMP_NUM_THREADS"] = str(CORE_THREADS)
        self.proc = subprocess.Popen(
            [str(PARITY_PY), "-m", "bench._trl_worker"],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.ready = None

    def _answer(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT ") :])
        raise RuntimeError(f"the TRL worker exited ({self.proc.poll()}); see {self.log.name}")

    def run(self, cmd: dict) -> dict:
        if self.ready is None:
            self.ready = self._answer()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        res = self._answer()
        if "error" in res:
            raise RuntimeError(f"TRL run failed: {res['error']} (log: {self.log.name})")
        return res

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def experiment(
    size: str,
    paths,
    algo: str,
    staleness: int,
    run_id: str,
    run_dir: Path,
    iters: int,
    engine: str = ENGINE,
    actor: dict | None = None,
) -> dict:
    """The benchmark ring's config; ``actor``: extra actor_rollout fields (bench.weight_sync --lora's LoRA)."""
    dpo = algo == "online_dpo"
    return {
        "run_id": run_id,
        "training": {
            "stage": "ray_online_dpo" if dpo else "ray_ppo",
            "global_batch_size": BATCH,
            "seq_length": PROMPT_TOKENS + NEW_TOKENS,
            "train_iters": iters,
            "lr": LR,
            "save_interval": 10_000,
            "save": str(run_dir / "checkpoints"),
            "device": "cpu",
            "max_staleness": staleness,
            "seed": 1,
            "padding_free": PADDING_FREE,
        },
        "actor_rollout_ref": {
            "actor_rollout": {
                "load": str(paths.policy),
                "engine": engine,
                "do_sample": True,
                "temperature": 1.0,
                "max_prompt_length": PROMPT_TOKENS,
                "max_new_tokens": NEW_TOKENS,
                "n_samples_per_prompt": 2 if dpo else 1,
                "ppo_mini_batch_size": BATCH if dpo else MINI,
                "ppo_epochs": 1 if dpo else EPOCHS,
                "clip_ratio": 0.2,
                "shuffle_minibatch": True,
                **(actor or {}),
            },
            "ref": {"micro_batch_size": 32},
        },
        "critic": {
            "load": str(paths.reward),
            "cliprange_value": 0.2,
            "critic_mini_batch_size": MINI,
            "critic_update_epochs": EPOCHS,
        },
        "reward": {"scorers": [{"type": "model", "load": str(paths.reward)}]},
        "algorithm": {
            "adv_estimator": "gae",
            "gamma": 1.0,
            "lam": 0.95,
            "kl_penalty": "kl",
            "kl_ctrl": {"type": "fixed", "kl_coef": 0.05},
        },
        "data": {"path": "builtin:arithmetic"},
    }


def _mean_dicts(a: dict, na: int, b: dict, nb: int) -> dict:
    """Step-weighted means of two runs' (nested) per-step figures."""
    return {
        k: _mean_dicts(v, na, b[k], nb) if isinstance(v, dict) else rnd((v * na + b[k] * nb) / (na + nb))
        for k, v in a.items()
        if k in b
    }


def _pool(acc: dict | None, res: dict) -> dict:
    """One side's figure over several runs: all measured steps' samples / all their seconds."""
    if acc is None:
        return {**res, "runs": 1}
    if "raw" in acc:  # the compute bound: its figures again from both runs' steps
        raw = {
            name: {t: {k: v + res["raw"][name][t][k] for k, v in m.items()} for t, m in per.items()}
            for name, per in acc["raw"].items()
        }
        out = _bound_figures({**acc, "raw": raw})
        out["runs"] = acc["runs"] + 1
        if "roofline" in acc:
            out["roofline"] = acc["roofline"] + res["roofline"]
        return out
    n_acc, n_res = acc["steps_measured"], res["steps_measured"]
    out = {
        **acc,
        "runs": acc["runs"] + 1,
        "samples": acc["samples"] + res["samples"],
        "seconds": acc["seconds"] + res["seconds"],
        "step_seconds": acc["step_seconds"] + res["step_seconds"],
        "steps_measured": n_acc + n_res,
    }
    out["samples_per_s"] = out["samples"] / out["seconds"]
    if "roofline" in acc:
        out["roofline"] = acc["roofline"] + res["roofline"]
    if "profile" in acc:
        out["profile"] = _mean_dicts(acc["profile"], n_acc, res["profile"], n_res)
    if "staleness_mean" in acc:
        out["staleness_mean"] = rnd((acc["staleness_mean"] * n_acc + res["staleness_mean"] * n_res) / (n_acc + n_res))
    return out


def run_ours(
    size,
    paths,
    algo,
    staleness,
    redis_url,
    reward,
    reference,
    work: Path,
    steps: int,
    engine: str = ENGINE,
    actor: dict | None = None,
    redis_pid: int | None = None,
) -> dict:
    run_id = f"bench-{size}-{algo.replace('_', '')}-s{staleness}-{int(time.time())}"
    run_dir = work / run_id
    shutil.rmtree(run_dir, ignore_errors=True)
    # The trainer is stopped once it has logged 1 + steps steps: the first (start-up) is not counted, and it never
    # reaches train_iters, whose final checkpoint would weigh on the last step.
    cfg = write_yaml(
        run_dir / "config.yaml",
        experiment(size, paths, algo, staleness, run_id, run_dir, steps + 5, engine=engine, actor=actor),
    )
    rollout, trainer = ring_services(cfg, run_dir, run_id, redis_url, TOKEN, (reward, reference), engine, BATCH)
    metrics = run_dir / "metrics.jsonl"
    t0 = time.monotonic()
    # each process's CPU seconds at the end of the first (start-up) step and of the last measured one
    procs = {"trainer": trainer, "rollout": rollout, "reward": reward, "reference": reference}
    cpu_marks: list[tuple[float, dict[str, float]]] = []

    def cpu_mark() -> None:
        pids = {k: v.proc.pid for k, v in procs.items() if getattr(v, "proc", None) is not None}
        if redis_pid:
            pids["redis"] = redis_pid
        cpu_marks.append((time.monotonic(), {k: proc_cpu_seconds(pid) or 0.0 for k, pid in pids.items()}))

    try:
        rollout.start(wait_ready=False)
        trainer.start(wait_ready=False)  # it publishes prompt jobs; the replica takes them once it has loaded
        assert trainer.proc is not None
        while (n_rows := len(metric_rows(metrics))) < steps + 1:
            if n_rows >= 1 and not cpu_marks:
                cpu_mark()
            for proc in (trainer, rollout):  # a dead part stalls the ring: fail now, with its log
                if proc.proc is not None and proc.proc.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited {proc.proc.returncode}:\n{proc.log_tail()}")
            if time.monotonic() - t0 > 600:
                raise TimeoutError(f"{run_id}: no progress in 600 s:\n{trainer.log_tail()}")
            time.sleep(0.05)
        cpu_mark()
    finally:  # the run's state is thrown away: no graceful stop needed
        trainer.stop(kill=True)
        rollout.stop(kill=True)
    rows = metric_rows(metrics)
    steady = rows[1 : steps + 1]
    samples = sum(r["samples"] for r in steady)
    seconds = sum(r["time/iteration_s"] for r in steady)
    step_s = seconds / len(steady)
    profile: dict = {
        "update_s": rnd(sum(r["time/step_s"] for r in steady) / len(steady)),
        "wait_experience_s": rnd(sum(r["time/wait_experience_s"] for r in steady) / len(steady)),
    }
    if len(cpu_marks) == 2:  # CPU per second of the window, times the mean step: each process's core-seconds a step
        (ta, a), (tb, b) = cpu_marks
        per = {k: (b[k] - a[k]) / (tb - ta) * step_s for k in b if k in a}
        per["idle"] = CORE_THREADS * step_s - sum(per.values())
        profile["core_s_per_step"] = {k: rnd(v) for k, v in per.items()}
    return {
        "samples_per_s": samples / seconds,
        "samples": samples,
        "seconds": seconds,
        "steps_measured": len(steady),
        "step_seconds": [rnd(r["time/iteration_s"]) for r in steady],
        "first_step_s": rnd(rows[0]["time/iteration_s"]),
        "staleness_mean": rnd(sum(r.get("staleness/mean", 0.0) for r in steady) / len(steady)),
        "profile": profile,
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _profile(row: dict) -> dict:
    """Where each ring's step goes against the bound's: per process, its core-seconds a step (``/proc``, the
    steady steps) next to the bound's best core-seconds of the phases that process runs (rollout: generation;
    trainer: update and weights), and the difference; ``idle``: the cores' seconds no ring process used (waits, and
    any other load on the machine). The differences and idle add up to (ring step - bound step) x cores."""
    bp = {k: v["best_core_s"] for k, v in row["bound"]["phases"].items()}
    share = {
        "rollout": bp["generation"],
        "reward": bp["reward"],
        "reference": bp["reference"],
        "trainer": bp["update"] + bp["weights"],
        "redis": 0.0,
        "idle": 0.0,
    }
    out: dict = {"bound_core_s": {**bp, "total": row["bound"]["core_s_per_step"]}}
    for mode in ("sync", "async"):
        prof = row.get(mode, {}).get("profile", {})
        per = prof.get("core_s_per_step")
        if not per:
            continue
        out[mode] = {
            "step_s": rnd(row[mode]["seconds"] / row[mode]["steps_measured"]),
            "update_s": prof["update_s"],
            "wait_experience_s": prof["wait_experience_s"],
            "core_s_per_step": per,
            "over_bound_core_s": {k: rnd(v - share.get(k, 0.0)) for k, v in per.items()},
        }
    return out


def run_bound(size: str, paths, algo: str, prompts: dict, work: Path, steps: int) -> dict:
    """The compute bound (bench._bound): each phase of the ring's step at its best thread count of 1..CORE_THREADS,
    the phases' core-seconds over the cores; ``serial_step_s``: the phases back to back with every thread."""
    cfg = experiment(size, paths, algo, 0, f"bound-{size}-{algo}", work / "bound", (steps + 1) * CORE_THREADS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(CORE_THREADS)}
    with open(work / f"bound-{size}-{algo}.log", "ab") as logf:
        proc = subprocess.run(
            [sys.executable, "-m", "bench._bound"],
            cwd=REPO,
            env=env,
            input=json.dumps(
                {
                    "config": cfg,
                    "prompt_ids": prompts["ids"],
                    "prompt_texts": prompts["raw"],
                    "steps": steps + 1,
                    "cores": CORE_THREADS,
                    "roofline": algo == "ppo",
                }
            ).encode(),
            stdout=subprocess.PIPE,
            stderr=logf,
            timeout=900,
        )
    lines = [x for x in proc.stdout.decode().splitlines() if x.startswith("RESULT ")]
    res = json.loads(lines[-1][len("RESULT ") :]) if lines else {"error": f"exit {proc.returncode}"}
    if "error" in res:
        raise RuntimeError(f"compute bound failed: {res['error']} (log: {work}/bound-{size}-{algo}.log)")
    first = {name: {t: m["wall_s"][0] for t, m in per.items()} for name, per in res["raw"].items()}
    steady = {name: {t: {k: v[1:] for k, v in m.items()} for t, m in per.items()} for name, per in res["raw"].items()}
    out = {
        "per_step_samples": BATCH * (2 if algo == "online_dpo" else 1),
        "raw": steady,
        "engine": res["engine"],
        "torch_threads": f"1..{res['cores']} per phase",
        # the first step's phases at every thread count (start-up), for the log
        "first_step_walls_s": {name: {t: rnd(w) for t, w in per.items()} for name, per in first.items()},
        **(
            {"roofline": [{k: rnd(v) if isinstance(v, float) else v for k, v in res["roofline"].items()}]}
            if "roofline" in res
            else {}
        ),
    }
    return _bound_figures(out)


def _bound_figures(b: dict) -> dict:
    """The bound's figures from its steady steps' measurements (``raw``; pooled over runs by :func:`_pool`)."""
    sm = summary(b["raw"], CORE_THREADS)
    steps = per_step(b["raw"], CORE_THREADS)
    n = b["per_step_samples"]
    return {
        **b,
        "samples_per_s": n / sm["step_s"],
        "samples": n * len(steps),
        "seconds": sm["step_s"] * len(steps),
        "steps_measured": len(steps),
        "step_s": rnd(sm["step_s"]),
        "step_seconds": [rnd(x) for x in steps],
        "serial_step_s": rnd(sm["serial_step_s"]),
        "serial_samples_per_s": rnd(n / sm["serial_step_s"]),
        "core_s_per_step": rnd(sm["core_s_per_step"]),
        "phases": {
            name: {
                "best_threads": p["best_threads"],
                "best_core_s": rnd(p["best_core_s"]),
                "threads": {t: {k: rnd(v) for k, v in m.items()} for t, m in p["threads"].items()},
            }
            for name, p in sm["phases"].items()
        },
    }


def run_trl(worker: TRLWorker, paths, algo: str, prompts: dict, steps: int) -> dict:
    res = worker.run(
        {
            "algo": algo,
            "policy": str(paths.policy),
            "reward": str(paths.reward),
            "prompt_ids": prompts["ids"],
            "prompt_texts": prompts["texts"],
            "batch": BATCH,
            "mini_batch": MINI,
            "epochs": EPOCHS,
            "response_length": NEW_TOKENS,
            "steps": steps + 1,
            "lr": LR,
            "seed": 1,
        }
    )
    times = res["step_seconds"][1:]
    return {
        "torch_threads": worker.ready.get("torch_threads") if worker.ready else None,
        "samples_per_s": res["samples_per_step"] * len(times) / sum(times),
        "samples": res["samples_per_step"] * len(times),
        "seconds": sum(times),
        "steps_measured": len(times),
        "step_seconds": [rnd(t) for t in times],
        "first_step_s": rnd(res["step_seconds"][0]),
    }


def prompt_set(paths) -> dict:
    cfg = parse_config({"actor_rollout_ref": {"actor_rollout": {"load": str(paths.policy)}}})
    tok = load_tokenizer(paths.policy)
    records = load_prompts(cfg.data)
    ids = [encode_prompt(tok, r.prompt, PROMPT_TOKENS, True, None) for r in records[: BATCH * 8]]
    # raw: the user's text, which the ring's prompt jobs carry to the reward model (it renders its own template)
    return {"ids": ids, "texts": [tok.decode(i) for i in ids], "raw": [r.prompt for r in records[: BATCH * 8]]}


def main() -> None:
    started = time.monotonic()
    work = CACHE / "pipeline"
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("bench-*"):  # run folders of earlier invocations (checkpoints add up)
        shutil.rmtree(old, ignore_errors=True)
    worker = TRLWorker(work / "trl-worker.log")  # imports TRL while our services start
    figures: dict[str, dict] = {}
    ratio: dict[str, float | None] = {}
    params = {}
    try:
        with RedisServer(work / "redis") as redis:
            for size in SIZES:
                paths = build_model(size)
                params[size] = param_count(paths.policy)
                prompts = prompt_set(paths)
                cfg = write_yaml(
                    work / f"services-{size}.yaml",
                    experiment(size, paths, "ppo", 0, f"bench-{size}", work, 1),
                )
                steps = STEPS[size]
                env = {"RLHF_REDIS_URL": redis.url}
                with scorer_services(cfg, work / "logs", env) as (reward, reference):
                    log(f"bench.pipeline: {size} ({params[size] / 1e6:.1f}M): reward and reference ready")
                    figures[size] = {}
                    for algo in ALGOS[size]:
                        order = ["trl", "bound", "sync", "async"]
                        if algo != "ppo":
                            order.reverse()
                        runs = [w for i in range(REPEATS[size]) for w in (order if i % 2 == 0 else order[::-1])]
                        row: dict[str, dict] = {}
                        for which in runs:
                            if which == "trl":
                                res = run_trl(worker, paths, algo, prompts, steps)
                            elif which == "bound":
                                res = run_bound(size, paths, algo, prompts, work, steps)
                            else:
                                staleness = 0 if which == "sync" else 1
                                res = run_ours(
                                    size,
                                    paths,
                                    algo,
                                    staleness,
                                    redis.url,
                                    reward,
                                    reference,
                                    work,
                                    steps,
                                    redis_pid=redis.pid,
                                )
                            log(
                                f"  {size} {algo} {which}: {res['samples_per_s']:.2f} samples/s "
                                f"(steps {res['step_seconds']})"
                            )
                            row[which] = _pool(row.get(which), res)
                        for which in row:
                            row[which]["samples_per_s"] = rnd(row[which]["samples_per_s"])
                            row[which]["cpu"] = CPU  # every figure with the CPU it was measured on
                            row[which].pop("raw", None)  # the bound's per-step measurements: summed up in phases
                            row[which].pop("per_step_samples", None)
                        row["profile"] = {**_profile(row), "cpu": CPU}
                        figures[size][algo] = row
                        ratio[f"{size}/{algo}/bound_vs_trl"] = rnd(
                            row["bound"]["samples_per_s"] / row["trl"]["samples_per_s"]
                        )
                        if "roofline" in row["bound"]:  # the update's FLOP rate over torch.mm's, per run
                            ratio[f"{size}/{algo}/bound_update_vs_mm_rate"] = rnd(
                                max(r["update_vs_mm_rate"] for r in row["bound"]["roofline"])
                            )
                        for mode in ("sync", "async"):
                            ratio[f"{size}/{algo}/{mode}_vs_trl"] = rnd(
                                row[mode]["samples_per_s"] / row["trl"]["samples_per_s"]
                            )
                            # mean step time over the compute bound's step time (equal samples per step on both)
                            ring_step = row[mode]["seconds"] / row[mode]["steps_measured"]
                            ratio[f"{size}/{algo}/{mode}_step_vs_bound"] = rnd(ring_step / row["bound"]["step_s"])
                            # and over the former bound: the phases back to back in one process, every thread
                            ratio[f"{size}/{algo}/{mode}_step_vs_serial"] = rnd(
                                ring_step / row["bound"]["serial_step_s"]
                            )
    finally:
        worker.close()

    key = "small/ppo/async_vs_trl"
    bkey = "small/ppo/async_step_vs_bound"
    # reward, reference and an hf rollout run their model's forward on one thread fewer than the process has
    # (RLHF_MODEL_THREADS' default; reward and reference in a child process: RLHF_MODEL_PROCESS)
    fwd = forward_threads()
    ring_threads = {
        "trainer": RING_THREADS,
        "rollout": rollout_threads(ENGINE) if ENGINE == "vllm" else f"{RING_THREADS}, decode {fwd}",
        "reward": f"{RING_THREADS}, model process {fwd}",
        "reference": f"{RING_THREADS}, model process {fwd}",
        "redis-server": 1,
    }
    emit(
        "pipeline",
        settings={
            "models": {
                k: f"{v / 1e6:.2f}M parameters (policy; the reward/critic model is the same size)"
                for k, v in params.items()
            },
            "batch_prompts": BATCH,
            "new_tokens": NEW_TOKENS,
            "prompt_tokens_max": PROMPT_TOKENS,
            "ppo": f"{EPOCHS} epochs x {BATCH // MINI} minibatches of {MINI}, policy and critic; GAE gamma 1 lambda "
            "0.95; KL coef 0.05",
            "online_dpo": "2 samples per prompt, 1 step per batch, sigmoid loss, beta 0.1",
            "lr": LR,
            "padding_free": PADDING_FREE,
            "rollout_engine": ENGINE,
            "ours": "rlhf-pipeline ring as `rlhf up` runs it: redis-server, reward, reference, rollout "
            f"({ENGINE} engine), trainer, each its own process; sync = max_staleness 0, async = 1; weights pushed "
            "after every update",
            "trl": "TRL 1.12.0 PPOTrainer / OnlineDPOTrainer, .venv-parity, one process",
            "bound": "the compute bound (bench._bound): the ring step's model passes (generation with the ring's "
            f"{ENGINE} engine, reward, reference, update, weights into the generator), each at every thread count "
            f"1..{CORE_THREADS} in one process with the same engine classes; per phase the least core-seconds (wall "
            "x threads, or the CPU seconds it used where fewer) over the thread counts; the bound's step time is "
            f"their sum over the {CORE_THREADS} cores. serial_step_s: the phases back to back on every thread (the "
            "bound before issue 34)",
            "resources": {
                "ours": side(
                    ring_threads,
                    "five processes, threads as `rlhf up` sets them (every core each, idle threads sleeping; a "
                    "service's model forward one fewer)",
                ),
                "trl": side(CORE_THREADS, "one process, torch's default threads (one per core)"),
                "bound": side(
                    {"per phase": list(range(1, CORE_THREADS + 1))},
                    f"one process; per phase, its best thread count of 1..{CORE_THREADS}; core-seconds over "
                    f"{CORE_THREADS} cores",
                ),
            },
            "measured_steps": STEPS,
            "runs_per_side": REPEATS,
            "algorithms": {k: list(v) for k, v in ALGOS.items()},
        },
        figures={"samples_per_s": figures},
        ratio=ratio,
        targets=[
            {
                **target(
                    "asynchronous PPO / TRL PPO samples/s, small model, equal cores",
                    ratio.get(key),
                    ">= 1.5",
                    ratio.get(key) is not None and ratio[key] >= 1.5,
                ),
                "cpu": CPU,
            },
            {
                **target(
                    "asynchronous PPO step time / compute bound step time, small model",
                    ratio.get(bkey),
                    "<= 1.05",
                    ratio.get(bkey) is not None and ratio[bkey] <= 1.05,
                ),
                "cpu": CPU,
            },
        ],
        notes=NOTES,
        started=started,
    )


# What the numbers above mean and where they came from (kept with the result, rendered into docs/benchmarks.md).
NOTES = [
    "the compute bound since issue 34 item 4 (bench._bound): each phase (generation with the ring's engine, reward, "
    "reference, update, weights) at every thread count 1..cores in one process; a phase's cost is its least "
    "core-seconds over the thread counts (wall x threads, or the measured process CPU seconds where fewer: the CPU "
    "term keeps it a bound where load stretches a wall), the bound's step time the sum over the cores. A ring's step "
    "x cores is at least the CPU it spends, and each phase costs it at least its least CPU, so no ring, synchronous "
    "or not, can beat it on any machine; the former bound (the phases back to back in one process on every thread, "
    "now serial_step_s) was beaten by the asynchronous ring on another 2-core machine (0.79x). Every figure and "
    "target records the CPU model (cpu). Bound figures in the notes below that predate issue 34 (its phases, "
    "'x the bound', 'bound N samples/s') are the former serial bound",
    "profile (figures.<size>.<algo>.profile): each ring process's core-seconds per steady step (/proc, user + "
    "system, with its children) beside the bound's best core-seconds of the phases it runs (rollout: generation; "
    "reward; reference; trainer: update and weights); over_bound_core_s is the difference, idle the cores' seconds "
    "no ring process used; the differences and idle add up to (ring step - bound step) x cores",
    "ours: steady steps only (the first, with start-up, left out; stopped before the final checkpoint); "
    "TRL and the bound: every step but the first (the bound: medians over them per phase and thread count)",
    "equal resources (issue 15): every side runs on the same cores (settings.resources); TRL, one process, gets "
    "torch's default threads (one per core), as did the compute bound until issue 34 (now each phase at every "
    "thread count, its best counted); the ring's processes get what `rlhf up` gives "
    "them (every core each since issue 15). OMP_WAIT_POLICY=PASSIVE on every side: with spinning OpenMP threads a "
    "small-model update with 2 threads took 22-37 s under a load average of 5 vs 3.8-4.6 s passive, minutes apart. "
    "Before issue 15 TRL ran with one thread while the ring's processes shared both cores: the figures published "
    "then (async 1.75x, sync 1.52x TRL on the small model) did not compare equal resources and are withdrawn",
    "profile that motivated this round (issue 15): the compute bound's phases on the small model (2 threads): "
    "update 2.07 s of 2.8 s (74%), generation 0.31 s, reward 0.19-0.31 s, reference 0.11 s, weight copy 0.006 s; "
    "inside the update (torch.profiler, one TrainerEngine.step) aten::mm is 76% of the CPU time, attention 3%, "
    "fused AdamW 3%: the step is matmul-bound, so the work to drop is the padded passes' (padding tokens and the "
    "padded attention's mask)",
    "change 1, padding-free passes (training.padding_free, rlhf.packing; on in this ring and the bound): the batch's "
    "real tokens packed in one row, positions per sequence, attention within each sequence. Exact: "
    "tests/trainer/test_packing.py (logits, values, gradients, PPO / GRPO / online DPO updates and reference "
    "log-probs equal within float32 rounding; the A/B's losses differ by 1.2e-7). bench.padding_free (interleaved, "
    "one trainer thread, load average 9-10): PPO step padded / padding-free 1.35x on this ring's batch shape "
    "(3% padding: the gain is mostly the attention without a padding mask) and 1.70x with prompts of 8-48 tokens "
    "(49% padding); reference forward 1.06x / 1.60x",
    "change 2, no idle core (services.plan.child_env, so `rlhf up` and this ring): every process may use every "
    "core and idle OpenMP threads sleep, so rollout and scoring have both cores while the trainer waits and the "
    "trainer has both during an update. bench.ring_threads (asynchronous small-model PPO ring, A/B/B/A, load "
    "average 8-16): 2.94 vs 1.11 samples/s, 2.65x over one thread per process; on a loaded machine part of that "
    "is more threads winning more CPU from other jobs, so the quiet-machine gain is smaller",
    "change 3, the critic beside the actor on half of the threads each (PPOStage._side_threads; in this ring's "
    "trainer and in the bound, which run the same engine): before, on a CPU whose cores the intra-op threads filled, "
    "the critic's passes ran after the actor's, each on every thread. The profile: the step is matmul-bound on "
    "8-row minibatches of ~30 tokens (hidden 512), where one OpenMP team of 2 scales poorly (TRL's tiny PPO: 1.5-2.4 "
    "s per step on 2 threads vs 0.5 s on one). Exact: the same operations, bit-identical losses and weights "
    "on the tiny model (tests/trainer/test_engine.py::test_critic_alongside_the_actor_matches_one_after_the_other); "
    "bench.critic_threads checks the small model's losses: equal on the AMD EPYC of that round, within ~1e-7 on "
    "this round's Intel Xeon, with or without change 5 (a kernel whose result depends on its thread count); its "
    "speed-up is bench.critic_threads' ratio",
    "rollout engine: hf, the faster here for this ring. The small model's generation is 0.31 s of a 2.8 s "
    "compute-bound step (11%) and overlaps the update in the asynchronous ring; bench.engines measured vLLM "
    "1.16-1.26x hf at batch 8-64 on the small model (worth < 0.05 s per step), while a vLLM replica keeps its "
    "serving default of one thread (hf: every core) and takes ~1.7 GB. Its weight-load pause, the other reason "
    "before (0.2-0.68 of each transfer), is gone since issue 15 item 4 (the staged swap: bench.weight_sync). "
    "BENCH_ENGINE=vllm runs this ring with vLLM",
    "change 4, the weight push packs a snapshot (services/trainer/loop.py): after an update the trainer copies the "
    "policy (a memcpy) and packs that copy (safetensors buckets, sha256, the NaN check) while the next step trains, "
    "where it packed the live weights before the next step could start. The profile: in the asynchronous ring the "
    "trainer's iteration was 0.38-0.59 s longer than its update with no wait for experience; packing the small "
    "policy (86 MB) takes 0.14-0.18 s alone, more beside rollout. Exact: the same bytes are pushed "
    "(then tests/trainer/test_engine.py::test_a_policy_snapshot_keeps_the_weights_the_next_step_changes, since "
    "change 8 its test_the_push_copy_keeps_the_weights_the_next_step_changes, and every weight-sync test)"
    ". Asynchronous ring before / after (quiet machine, separate runs, so the samples/s of the "
    "runs move with the machine: 4.65 before, 4.37-4.97 after): the trainer's iteration less its update 0.38-0.59 s "
    "/ 0.01-0.12 s, step time over the bound 1.16 / 1.09-1.14",
    "why asynchronous PPO was still not 1.5x TRL at equal cores after changes 1-4 (the four runs of that round: "
    "1.09-1.20x, 1.05x before changes 3 and 4): the ring was within ~1.15x of its compute bound and the bound 1.18-"
    "1.39x TRL. Tried and left out then: rollout, reward and reference on one thread each (A/B/B/A: +5%, 2 cores "
    "only, so `rlhf up` keeps every core per process)",
    "profile that motivated changes 5-7 (this round, quiet machine): the compute bound's phases (small model, "
    "2 threads): update 1.56-1.59 s, generation 0.45-0.46 s, reward 0.34 s, reference 0.13 s of 2.4-2.8 s; its "
    "roofline (bench._bound.roofline): the update's 251 GFLOP at 160 GFLOP/s, 0.48 of this machine's best fp32 "
    "matmul rate (332 GFLOP/s on 2 threads; one thread 166, two side by side 2 x 160), so a schedule of the same "
    "fp32 work could gain at most ~2x and the work itself is what to cut. One actor forward+backward on 8 rows "
    "(one thread, torch.profiler): 102 GFLOP/s, aten::mm 78% of the time at ~127 GFLOP/s, elementwise ~20%. The "
    "asynchronous ring's CPU per step (/proc, 7 steps): 4.6-5.0 core-s at 92% of the 2 cores: trainer 3.3-3.6 "
    "(its update's two threads 2.6-2.9, packing the push 0.15-0.6 under contention), rollout 0.75, reward 0.31-0.38,"
    " reference 0.26-0.29, redis 0.02: the ring is CPU-bound, so its step time falls only with the CPU work",
    "change 5, the first minibatch's pass gives its rows' old log-probs and values (TrainerEngine.reuse_first_pass; "
    "PPO at world size 1 without a trainer-side reference): at the step's start the weights are the ones the old "
    "values are taken at, so the first (micro-)batch's forward with gradient is kept for its update and the old "
    "pass runs on the other rows only: half an actor and half a critic forward less per step at 2 minibatches "
    "(update FLOPs 251 -> 238 G). Exact: the same metrics and weights within float32 rounding over 3 steps "
    "(tests/trainer/test_engine.py::test_reusing_the_first_minibatch_pass_matches_a_full_old_pass, rel 1e-4 at lr "
    "5e-3; also with micro-batches, sequential critic and a frozen actor), the TRL parity tests unchanged. "
    "python -m bench.first_pass (the same batches, interleaved, 6 rounds): median step 1.47 -> 1.41 s (1.05x), "
    "losses within 1.5e-7",
    "change 6, the reward model's forward is padding-free with training.padding_free (as the actor, critic and "
    "reference passes were since change 1); exact: tests/trainer/test_packing.py::"
    "test_reward_model_scores_with_padding_free_equal_padded. Reward forward on 16 rows of 29 tokens, 2 threads: "
    "117 -> 90 ms. Also a fix of the bound: it gave the reward model the decoded, already templated prompt, which "
    "the reward model templated again (38-54 tokens a row where the ring's rows are 27-40); it now sends the user's "
    "text as the ring's prompt jobs do. The bound's reward phase: 0.34 -> 0.16 s",
    "change 7, pack_weights copies each tensor once into buckets laid out from dtypes and shapes (the streamed "
    "packer's layout) instead of building safetensors.torch.save's file image and hashing that: 0.16 -> 0.14 s per "
    "push of the small policy on one thread (copy 0.03, NaN check 0.008, sha256 0.06-0.075). Exact: the receivers "
    "parse the same tensors bit for bit (every weight-sync test); packed and streamed pushes of one state dict are "
    "now the same bytes (tests/trainer/test_stream_push.py::test_packed_and_streamed_weights_are_the_same_bytes)",
    "change 8, the push's copy is its buckets (services/trainer/loop.py, copy_weights + PackedWeights.seal): "
    "between two steps the trainer copies the policy straight into the push's bucket buffers, reused from an "
    "earlier push (fresh memory costs a page fault per 4 KiB: 86 MB copied into new memory 0.04 s, into a reused "
    "buffer 0.009 s), and hashes them while the next step trains; before it cloned the policy (a snapshot) and packed "
    "the clone into new buffers. The profile: in the asynchronous ring the trainer's packing took 0.15-0.6 s of CPU "
    "per step beside the update (0.14-0.16 s alone). One thread, small policy: 0.15 -> 0.09 s of CPU per push "
    "(between the steps 0.035 -> 0.027 s). Exact: the same bytes "
    "(tests/trainer/test_engine.py::test_the_push_copy_keeps_the_weights_the_next_step_changes and every weight-sync "
    "test)",
    "before / after (small model, samples/s; the machine moves 5-10% between runs, so each line is one run's "
    "interleaved sides): before changes 5-8 (3 steps a run): TRL 4.84-4.96, bound 5.94-6.15 (1.23x TRL), "
    "asynchronous ring 5.46-6.01 (1.17x); after 5-7 (3 steps): TRL 4.97-5.16, bound 6.18-7.10 (1.31x), asynchronous "
    "5.71-5.92 (1.15x); `make bench` after 5-7: TRL 5.12-5.13, bound 7.09-7.16 (1.39x), asynchronous 6.11-6.16 "
    "(1.20x, 1.16x its bound); after 5-8 with 6 measured steps a run: the table above",
    "tried and left out in this round (asynchronous small ring, runs of 7 steps, quiet machine): reward, reference "
    "and rollout at nice 10 so the trainer wins contended cores (6.16-6.28 vs 6.15-6.20 samples/s: the trainer "
    "then waits for experience, the work is the same); reward and reference on one thread, with or without rollout "
    "on one (6.21-6.50 vs 6.13-6.37: within the noise of one run); the vLLM rollout engine (5.94 samples/s, rollout "
    "0.89 core-s per step vs hf's 0.75)",
    "why asynchronous PPO is still not 1.5x TRL at equal cores: TRL takes 3.1-3.4 s per step here, so 1.5x needs "
    "2.1-2.2 s, i.e. at most ~4.2 core-s of work per step on 2 cores. The ring does ~4.6: the update alone is "
    "2.5-2.9 core-s at 0.49 of the fp32 matmul rate (the same model passes TRL runs, less the half old pass of "
    "change 5), generation, reward and reference 1.0-1.3, the verified weight push (pack, sha256 on both sides, "
    "the transfer) 0.3-0.5. The asynchronous overlap has no idle core to fill (92% busy). Closing the gap needs "
    "cheaper arithmetic per sample (bf16 on this AVX512-BF16 CPU, which TRL could use too, or fused elementwise "
    "kernels: ~20% of the update), or more cores than this 2-core machine",
    "tiny model: steps of 0.1-0.2 s, where the ring's fixed costs per step (queue, RPC, weight push) make it "
    "1.6-2.3x the bound; TRL's tiny PPO with 2 threads took 1.5-2.4 s per step (0.5 s with one thread before "
    "issue 15): OpenMP teams on tensors this small cost more than they give",
    "earlier rounds (before issue 15): fused AdamW; the critic's passes beside the actor's in a second thread; the "
    "weight push overlapping the next step; reward and reference merging concurrent requests into one forward",
    "the machine is shared (about 7 engineers' test runs): absolute figures move with the load average recorded "
    "below; each comparison runs side by side in one run, in mirrored order, and the lead may re-run `make bench`",
]


if __name__ == "__main__":
    sys.exit(main())
