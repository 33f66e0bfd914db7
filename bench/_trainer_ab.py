"""Trainer A/B runs for the benchmarks that compare trainer settings step for step (bench.critic_threads,
bench.first_pass). Apart from bench._common because it builds on bench.pipeline's experiment and prompts, which
import bench._common themselves."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

from bench._common import CACHE, CORE_THREADS, build_model, log
from bench.padding_free import _experiences
from bench.pipeline import experiment, prompt_set
from rlhf.config import parse_config
from services.trainer.engine import TrainerEngine


def trainer_step_ab(name: str, modes: dict[str, Callable[[Any], None]], rounds: int, batch: int = 16):
    """Two or more PPO trainer engines of the small model (same seed and weights, padding-free, bench.pipeline's
    settings), each set up by its ``modes`` function, stepping on the same experience batches of bench.pipeline's
    shape (``batch`` chat-templated arithmetic prompts + 16 response tokens), in alternating order each round (A, B,
    B, A, ...), with every core's threads. Round 0 warms up and is not timed. Returns (seconds per step, policy +
    value loss per step), each by mode."""
    import torch  # noqa: PLC0415 - torch loads after bench._common sets OMP_*

    torch.set_num_threads(CORE_THREADS)
    paths = build_model("small")
    chat = prompt_set(paths)["ids"]
    raw = experiment("small", paths, "ppo", 0, name, CACHE / name, 10)
    raw["training"]["padding_free"] = True
    cfg = parse_config(raw)
    engines = {}
    for mode, setup in modes.items():
        engines[mode] = TrainerEngine(cfg, device="cpu")
        setup(engines[mode])
    times: dict[str, list[float]] = {m: [] for m in engines}
    losses: dict[str, list[float]] = {m: [] for m in engines}
    rng = random.Random(0)
    order = list(engines)
    for r in range(rounds + 1):
        exps = _experiences(chat[:batch], [16] * batch, seed=rng.randrange(1 << 30))
        for mode in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            m = engines[mode].step(exps)
            dt = time.perf_counter() - t0
            if r:
                times[mode].append(dt)
            losses[mode].append(m["loss/policy"] + m["loss/value"])
        log(f"  round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items() if v))
    return times, losses
