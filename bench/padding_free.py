"""bench.padding_free: the trainer's PPO step and the reference forward, padded vs padding-free (rlhf.packing).

The small model (~21M parameters, rlhf.tiny), two trainer engines built alike (same seed, same weights) that differ
only in ``training.padding_free``, stepping on the same experience batches, interleaved (off, on, on, off, ...), in
this process with a trainer service's threads. Two batch shapes of 16 samples: ``pipeline``, the shape of
bench.pipeline's batches (chat-templated arithmetic prompts of 11-12 tokens, 16 response tokens: almost no padding),
and ``varied``, prompts of 8-48 tokens and responses of 2-16 (a third to half of the padded batch is padding). The
reference figure is ``ReferenceEngine``'s forward over the same 16 samples, both ways. Figure: median seconds per
call; ratio: padded / padding-free (> 1: padding-free is faster). The losses of the two engines are compared too
(they must agree within float32 rounding; tests/trainer/test_packing.py asserts it).
"""

from __future__ import annotations

import random
import time

from bench._common import CACHE, QUICK, RING_THREADS, build_model, emit, log, median, rnd, side
from bench.pipeline import experiment, prompt_set
from rlhf.config import parse_config
from rlhf.v1 import common_pb2, experience_pb2
from services.reference.engine import LogProbsItem, ReferenceEngine
from services.trainer.engine import TrainerEngine

ROUNDS = 2 if QUICK else 4
BATCH = 16


def _experiences(prompts: list[list[int]], lengths: list[int], seed: int):
    rng = random.Random(seed)
    out = []
    for j, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        exp = experience_pb2.Experience(job_id=f"j{j}", prompt_ids=p)
        resp = [rng.randrange(3, 500) for _ in range(n)]
        exp.samples.add(
            response_ids=resp,
            sampling_logprobs=[-6.0] * n,
            ref_logprobs=[-6.1] * n,
            score=rng.random(),
            score_status=common_pb2.ITEM_STATUS_OK,
        )
        out.append(exp)
    return out


def main() -> None:
    started = time.monotonic()
    import torch  # noqa: PLC0415 - torch loads after bench._common sets OMP_*

    paths = build_model("small")
    chat = prompt_set(paths)["ids"]
    rng = random.Random(0)
    shapes = {
        "pipeline": (chat[:BATCH], [16] * BATCH),
        "varied": (
            [[rng.randrange(3, 500) for _ in range(rng.randint(8, 48))] for _ in range(BATCH)],
            [rng.randint(2, 16) for _ in range(BATCH)],
        ),
    }
    engines, refs = {}, {}
    for pf in (False, True):
        raw = experiment("small", paths, "ppo", 0, "padding-free", CACHE / "padding_free", 10)
        raw["training"]["padding_free"] = pf
        cfg = parse_config(raw)
        engines[pf] = TrainerEngine(cfg, device="cpu")
        refs[pf] = ReferenceEngine(cfg, device="cpu")
        refs[pf].load()
    figures: dict[str, dict] = {}
    ratio: dict[str, float | None] = {}
    losses: dict[str, dict] = {}
    for name, (prompts, lengths) in shapes.items():
        pad_frac = 1 - sum(len(p) + n for p, n in zip(prompts, lengths, strict=True)) / (
            BATCH * (max(map(len, prompts)) + max(lengths))
        )
        t_step: dict[bool, list[float]] = {False: [], True: []}
        t_ref: dict[bool, list[float]] = {False: [], True: []}
        loss: dict[bool, list[float]] = {False: [], True: []}
        items = [
            LogProbsItem(p, [5 + (i * 7 + j) % 400 for j in range(n)])
            for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
        ]
        for rnd_i in range(ROUNDS + 1):  # round 0 warms up (and is not counted)
            exps = _experiences(prompts, lengths, seed=rnd_i)
            for pf in (False, True) if rnd_i % 2 == 0 else (True, False):
                t0 = time.perf_counter()
                m = engines[pf].step(exps)
                dt = time.perf_counter() - t0
                t1 = time.perf_counter()
                refs[pf]._forward(items, 1.0)
                dr = time.perf_counter() - t1
                if rnd_i:
                    t_step[pf].append(dt)
                    t_ref[pf].append(dr)
                loss[pf].append(m["loss/policy"] + m["loss/value"])
            log(f"  {name} round {rnd_i}: step {t_step}")
        figures[name] = {
            "padding_fraction": rnd(pad_frac),
            "step_s": {"padded": rnd(median(t_step[False])), "padding_free": rnd(median(t_step[True]))},
            "reference_forward_s": {"padded": rnd(median(t_ref[False])), "padding_free": rnd(median(t_ref[True]))},
        }
        ratio[f"{name}/step_padded_vs_padding_free"] = rnd(median(t_step[False]) / median(t_step[True]))
        ratio[f"{name}/reference_padded_vs_padding_free"] = rnd(median(t_ref[False]) / median(t_ref[True]))
        diff = max(abs(a - b) for a, b in zip(loss[False], loss[True], strict=True))
        losses[name] = {"max_abs_diff_policy_plus_value_loss": diff}
    emit(
        "padding_free",
        settings={
            "model": "small (rlhf.tiny, ~21M parameters; critic and reference the same size)",
            "step": "TrainerEngine.step, PPO, 16 samples, 2 epochs x 2 minibatches of 8, actor and critic",
            "shapes": {
                "pipeline": "bench.pipeline's prompts (11-12 tokens) + 16 response tokens",
                "varied": "prompts of 8-48 tokens, responses of 2-16",
            },
            "rounds": ROUNDS,
            "resources": {
                "padded": side(RING_THREADS, "in this process, a trainer service's threads"),
                "padding_free": side(RING_THREADS, "the same process, interleaved with padded"),
            },
            "torch_threads": torch.get_num_threads(),
        },
        figures={**figures, "losses": losses},
        ratio=ratio,
        targets=[],
        notes=["padding-free is exact: the two engines' losses agree within float32 rounding (losses above)"],
        started=started,
    )


if __name__ == "__main__":
    main()
