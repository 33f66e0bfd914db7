"""What every benchmark shares: the JSON line, the machine, a private redis-server, service processes, models."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from math import floor, log10
from pathlib import Path
from typing import Any

import yaml
from safetensors import safe_open

from rlhf import procs
from rlhf.procs import LocalRedis
from rlhf.tiny import TinySpec, build_tiny

REPO = Path(__file__).resolve().parents[1]
QUICK = bool(os.environ.get("BENCH_QUICK"))  # smoke-test the scripts: a fraction of the work, figures meaningless
CACHE = Path(os.environ.get("BENCH_CACHE", REPO / ".cache" / "bench"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The cores every side of every benchmark runs on (the benchmark's own affinity, inherited by what it starts).
CORES: list[int] = sorted(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))
# Threads per service process as `rlhf up` sets them (services.plan.child_env: every core, idle threads
# sleeping). Inherited by every service started here; a baseline that runs as one process gets every core too
# (CORE_THREADS), as a user would run it.
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
RING_THREADS = int(os.environ["OMP_NUM_THREADS"])
CORE_THREADS = len(CORES)


def rollout_threads(engine: str) -> int:
    """A rollout replica's threads under `rlhf up`: RING_THREADS with the hf engine; vLLM keeps its serving default
    of one (services.launcher.Launcher.run)."""
    return RING_THREADS if engine != "vllm" else 1


# Idle OpenMP threads sleep instead of spinning, on every side alike. On this shared machine a spinning thread whose
# peer is descheduled burns its core: a small-model PPO update with 2 threads took 22-37 s under a load average of 5
# with the default policy, 3.8-4.6 s with PASSIVE, in the same minute (a tiny-model Generate: 500 ms of CPU vs 30 ms).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# stdout carries only the JSON line: keep a private handle on it and send everything else written to fd 1 (vLLM's
# logging, progress bars of libraries) to stderr.
_JSON_OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)


def log(*args: Any) -> None:
    """Progress goes to stderr: stdout carries only the one JSON line."""
    print(*args, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------- the JSON line


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; the platform's processor string elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def proc_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) used so far by process ``pid`` and its live descendants, from
    /proc; None where the process is gone (or off Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[int(d)] = int(fields[11]) + int(fields[12])
        children.setdefault(int(fields[1]), []).append(int(d))
    if pid not in ticks:
        return None
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += ticks.get(p, 0)
        todo += children.get(p, [])
    return total / tick


def machine() -> dict[str, Any]:
    cpu = cpu_model()
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        mem_gib = None
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": mem_gib,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "affinity": CORES,
    }
    try:
        import torch  # noqa: PLC0415 - torch: optional, and loads only after this module sets OMP_*

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


def side(threads: dict[str, int] | int, what: str = "") -> dict[str, Any]:
    """What one side of a comparison ran on: the cores (CPU ids it may run on) and the torch/OpenMP threads of each
    of its processes (an int: one process), for the JSON's ``settings.resources``."""
    out: dict[str, Any] = {"cores": CORES, "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
    if what:
        out["what"] = what
    return out


def target(figure: str, value: float | None, goal: str, met: bool | None) -> dict[str, Any]:
    """One figure against its target: ``goal`` in words (``>= 1.5x``), ``met`` None when not measured."""
    return {"figure": figure, "value": value, "target": goal, "met": met}


def emit(
    name: str,
    settings: dict[str, Any],
    figures: dict[str, Any],
    ratio: dict[str, Any],
    targets: Sequence[dict[str, Any]] = (),
    notes: Sequence[str] = (),
    started: float | None = None,
    command: str | None = None,
) -> dict[str, Any]:
    """Print the benchmark's one JSON line on stdout and return it. ``command``: how it was run (default
    ``python -m bench.<name>``)."""
    out = {
        "name": name,
        "settings": settings,
        "figures": figures,
        "ratio": ratio,
        "targets": list(targets),
        "notes": list(notes),
        "machine": machine(),
        "command": command or f"python -m bench.{name}",
        "seconds": round(time.monotonic() - started, 1) if started is not None else None,
    }
    print(json.dumps(out, separators=(",", ":"), default=_default), file=_JSON_OUT, flush=True)
    return out


def _default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


# ------------------------------------------------------------------------------------------------- statistics


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100 * len(s) + 0.5)) - 1))
    return float(s[k])


def rnd(x: float | None, digits: int = 3) -> float | None:
    """Round to ``digits`` significant digits (JSON stays readable)."""
    if x is None:
        return None
    if x == 0:
        return 0.0

    return round(x, -int(floor(log10(abs(x)))) + digits - 1)


# ------------------------------------------------------------------------------------------------- processes


class RedisServer(LocalRedis):
    """A private redis-server on a free loopback port, AOF on (everysec) as compose and Helm run it."""


class ServiceProc(procs.ServiceProc):
    """``python -m services.cli serve NAME --config FILE`` on free loopback ports (rlhf.procs), with the benchmarks'
    limits: 180 s to get ready (larger models than the tests', vLLM), 30 s to stop after SIGTERM."""

    ready_timeout = 180.0
    stop_timeout = 30.0
    tail_lines = 30


# ------------------------------------------------------------------------------------------------- models

# The model sizes the benchmarks use, built locally by rlhf.tiny (no download). head_dim is 32 or 64 (vLLM CPU).
MODEL_SPECS: dict[str, dict[str, int]] = {
    # the test model: ~0.1M parameters
    "tiny": {},
    # "small": tens of millions of parameters (~21M policy, the same again for the critic/reward model)
    "small": dict(
        hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8
    ),
    # weight sync: >= 100M parameters (~103M)
    "large": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16
    ),
}


@contextmanager
def scorer_services(
    config: Path, log_dir: Path, env: dict[str, str | None]
) -> Iterator[tuple[ServiceProc, ServiceProc]]:
    """The reward and reference services of a benchmark ring, started together (their model loads overlap), ready
    on entry and stopped on exit."""
    reward = ServiceProc("reward", config, log_dir, env=env).start(wait_ready=False)
    reference = ServiceProc("reference", config, log_dir, env=env).start(wait_ready=False)
    try:
        reward.wait_ready()
        reference.wait_ready()
        yield reward, reference
    finally:
        reward.stop()
        reference.stop()


def build_model(size: str, **overrides: int):
    """Build (once; reused while the spec is unchanged) the policy + reward model of a size; returns TinyPaths."""
    spec = TinySpec(**{**MODEL_SPECS[size], **overrides})
    suffix = "" if not overrides else "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    return build_tiny(CACHE / "models" / f"{size}{suffix}", spec)


def param_count(model_dir: Path) -> int:
    n = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118
                shape = st.get_slice(name).get_shape()
                k = 1
                for d in shape:
                    k *= d
                n += k
    return n


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def metric_rows(path: Path) -> list[dict]:
    """The complete lines of a trainer's metrics.jsonl so far (none before it exists; a line being written is not)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(x) for x in text.splitlines() if x.strip().endswith("}")]


def ring_services(
    cfg: Path, run_dir: Path, run_id: str, redis_url: str, token: str, scorers: tuple, engine: str, inflight: int
) -> tuple[ServiceProc, ServiceProc]:
    """A rollout replica (``engine``, at most ``inflight`` jobs at once) and a trainer for ``cfg``, wired to the
    running reward and reference services ``scorers``; neither is started."""
    reward, reference = scorers
    common = {"RLHF_REDIS_URL": redis_url, "RLHF_RUN_ID": run_id, "RLHF_API_TOKEN": token}
    rollout = ServiceProc(
        "rollout",
        cfg,
        run_dir / "logs",
        env={
            **common,
            "RLHF_REWARD_ADDR": reward.grpc_addr,
            "RLHF_REFERENCE_ADDR": reference.grpc_addr,
            "RLHF_REPLICA_ID": f"{run_id}-rollout-0",
            "RLHF_ROLLOUT_ENGINE": engine,
            "RLHF_WEIGHTS_DATA_PORT": "0",
            "RLHF_ROLLOUT_MAX_INFLIGHT_JOBS": str(inflight),
            "OMP_NUM_THREADS": str(rollout_threads(engine)),
        },
    )
    trainer = ServiceProc(
        "trainer",
        cfg,
        run_dir / "logs",
        env={**common, "RLHF_ROLLOUT_ADDRS": rollout.grpc_addr, "RLHF_RUN_DIR": str(run_dir)},
    )
    return rollout, trainer
