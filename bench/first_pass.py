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

import time

from bench._common import CORE_THREADS, QUICK, emit, median, rnd, side, target
from bench._trainer_ab import trainer_step_ab

ROUNDS = 2 if QUICK else 6
BATCH = 16


def main() -> None:
    started = time.monotonic()

    def full_old_pass(engine) -> None:
        engine.reuse_first_pass = False

    times, losses = trainer_step_ab(
        "first_pass", {"reused": lambda engine: None, "full_old_pass": full_old_pass}, ROUNDS, BATCH
    )
    reused, full = median(times["reused"]), median(times["full_old_pass"])
    diff = max(abs(a - b) for a, b in zip(losses["reused"], losses["full_old_pass"], strict=True))
    emit(
        "first_pass",
        settings={
            "model": "small (rlhf.tiny, ~21M parameters; the critic the same size)",
            "step": f"TrainerEngine.step, PPO, {BATCH} samples of bench.pipeline's shape, 2 epochs x 2 minibatches of "
            "8, actor and critic side by side, padding-free",
            "rounds": ROUNDS,
            "resources": {m: side(CORE_THREADS, "this process, one engine at a time") for m in times},
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
