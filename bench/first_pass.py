"""bench.first_pass: the trainer's PPO step with the first minibatch's pass reused for its rows' old log-probs and
values (``TrainerEngine.reuse_first_pass``, the default) vs an old pass over every row.

The small model (~21M parameters, rlhf.tiny), two trainer engines built alike (same seed, same weights,
padding-free, the critic beside the actor as the trainer runs it on a CPU), stepping on the same experience batches
of bench.pipeline's shape (16 chat-templated arithmetic prompts + 16 response tokens, 2 epochs x 2 minibatches of 8),
interleaved (A, B, B, A, ...), in this process with every core's threads. Figure: median seconds per step; ratio:
full old pass / reused (> 1: reuse is faster). The losses must agree within float32 rounding (the test:
tests/trainer/test_engine.py::test_reusing_the_first_minibatch_pass_matches_a_full_old_pass). Not part of
``make bench`` (about a minute): ``python -m bench.first_pass``.
"""

from __future__ import annotations

import random
import time

from bench._common import CACHE, CORE_THREADS, QUICK, build_model, emit, log, median, rnd, side, target

ROUNDS = 2 if QUICK else 6
BATCH = 16


def main() -> None:
    started = time.monotonic()
    import torch

    from bench.padding_free import _experiences
    from bench.pipeline import experiment, prompt_set
    from rlhf.config import parse_config
    from services.trainer.engine import TrainerEngine

    torch.set_num_threads(CORE_THREADS)
    paths = build_model("small")
    chat = prompt_set(paths)["ids"]
    raw = experiment("small", paths, "ppo", 0, "first-pass", CACHE / "first_pass", 10)
    raw["training"]["padding_free"] = True
    cfg = parse_config(raw)
    engines = {mode: TrainerEngine(cfg, device="cpu") for mode in ("reused", "full_old_pass")}
    engines["full_old_pass"].reuse_first_pass = False
    times: dict[str, list[float]] = {m: [] for m in engines}
    losses: dict[str, list[float]] = {m: [] for m in engines}
    rng = random.Random(0)
    for r in range(ROUNDS + 1):  # round 0 warms up (and is not counted)
        exps = _experiences(chat[:BATCH], [16] * BATCH, seed=rng.randrange(1 << 30))
        for mode in ("reused", "full_old_pass") if r % 2 == 0 else ("full_old_pass", "reused"):
            t0 = time.perf_counter()
            m = engines[mode].step(exps)
            dt = time.perf_counter() - t0
            if r:
                times[mode].append(dt)
            losses[mode].append(m["loss/policy"] + m["loss/value"])
        log(f"  round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items() if v))
    reused, full = median(times["reused"]), median(times["full_old_pass"])
    diff = max(abs(a - b) for a, b in zip(losses["reused"], losses["full_old_pass"], strict=True))
    emit(
        "first_pass",
        settings={
            "model": "small (rlhf.tiny, ~21M parameters; the critic the same size)",
            "step": f"TrainerEngine.step, PPO, {BATCH} samples of bench.pipeline's shape, 2 epochs x 2 minibatches of "
            "8, actor and critic side by side, padding-free",
            "rounds": ROUNDS,
            "resources": {m: side(CORE_THREADS, "this process, one engine at a time") for m in engines},
        },
        figures={
            "step_s": {"reused": rnd(reused), "full_old_pass": rnd(full)},
            "step_times_s": {k: [rnd(x) for x in v] for k, v in times.items()},
            "max_abs_diff_policy_plus_value_loss": diff,
        },
        ratio={"full_old_pass_vs_reused": rnd(full / reused)},
        targets=[
            target("PPO step losses, reused vs full old pass (max abs difference)", diff, "<= 1e-5", diff <= 1e-5)
        ],
        notes=[
            "why: at the step's start the weights are the ones the old values are taken at, so the first "
            "(micro-)batch's forward with gradient doubles as its rows' old pass: half an actor and half a critic "
            "forward less per step at 2 minibatches"
        ],
        started=started,
    )


if __name__ == "__main__":
    main()
