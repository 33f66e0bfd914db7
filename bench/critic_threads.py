"""bench.critic_threads: the trainer's PPO step with the critic's passes beside the actor's, each on half of the
intra-op threads, vs one after the other on all of them.

The small model (~21M parameters, rlhf.tiny), two trainer engines built alike (same seed, same weights, padding-free
as in bench.pipeline), stepping on the same experience batches of bench.pipeline's shape (16 chat-templated
arithmetic prompts + 16 response tokens), interleaved (A, B, B, A, ...), in this process with every core's threads.
``sequential``: the actor's passes, then the critic's, each with all threads (what the engine did on a CPU whose
cores the intra-op threads fill); ``side_by_side``: the critic's passes in a second thread, the actor's on this one,
each with half of the threads (``PPOStage._side_threads``). Figure: median seconds per step; ratio:
sequential / side by side (> 1: side by side is faster). The losses of the two engines must agree within float32
rounding: the same operations, run with 1 thread per side against 2 (tests/trainer/test_engine.py asserts it bit for
bit on the tiny model; on the small model some kernel's result depends on the thread count on some CPUs: 0 on the
AMD EPYC of earlier runs, ~1e-7 on an Intel Xeon with the old pass over every row as before change 5).
"""

from __future__ import annotations

import time

from bench._common import CORE_THREADS, QUICK, emit, median, rnd, side, target
from bench._trainer_ab import trainer_step_ab

ROUNDS = 2 if QUICK else 6
BATCH = 16


def main() -> None:
    started = time.monotonic()

    def sequential(engine) -> None:
        engine.ppo._parallel_critic = lambda: False

    times, losses = trainer_step_ab(
        "critic_threads", {"sequential": sequential, "side_by_side": lambda engine: None}, ROUNDS, BATCH
    )
    seq, par = median(times["sequential"]), median(times["side_by_side"])
    diff = max(abs(a - b) for a, b in zip(losses["sequential"], losses["side_by_side"], strict=True))
    half = (CORE_THREADS - CORE_THREADS // 2, CORE_THREADS // 2)
    emit(
        "critic_threads",
        settings={
            "model": "small (rlhf.tiny, ~21M parameters; the critic the same size)",
            "step": f"TrainerEngine.step, PPO, {BATCH} samples of bench.pipeline's shape, 2 epochs x 2 minibatches of "
            "8, actor and critic, padding-free",
            "rounds": ROUNDS,
            "resources": {
                "sequential": side(CORE_THREADS, "this process: actor then critic, each with every thread"),
                "side_by_side": side(
                    {"actor": half[0], "critic": half[1]}, "the same process: actor and critic in two threads at once"
                ),
            },
        },
        figures={
            "step_s": {"sequential": rnd(seq), "side_by_side": rnd(par)},
            "step_times_s": {k: [rnd(x) for x in v] for k, v in times.items()},
            "max_abs_diff_policy_plus_value_loss": diff,
        },
        ratio={"sequential_vs_side_by_side": rnd(seq / par)},
        targets=[
            target("PPO step losses, side by side vs sequential (max abs difference)", diff, "<= 1e-5", diff <= 1e-5)
        ],
        notes=[
            "why: one OpenMP team per model on these matmuls (8-row minibatches of ~30 tokens, hidden 512) scales "
            "worse than two teams of half the size side by side; the critic-after-actor rule before this change "
            "left the critic's thread off whenever the intra-op threads already filled the cores",
        ],
        started=started,
    )


if __name__ == "__main__":
    main()
