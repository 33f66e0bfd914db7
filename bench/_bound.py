"""The compute bound of bench.pipeline: the model passes one ring step needs, back to back in one process.

``python -m bench._bound`` reads one JSON command on stdin and answers one line ``RESULT {json}`` on stdout::

    {"config": {...experiment...}, "prompt_ids": [[...], ...], "prompt_texts": [...], "steps": 4}

Per step, with the same engine classes the services run (no process, queue, RPC or serialisation between them):

1. generation: the rollout's ``hf`` engine, the batch's prompts in one ``generate`` call (the replica's batcher
   merges the ring's concurrent jobs into one decode the same way);
2. reward: ``RewardEngine.score`` on the responses (the reward model's forward);
3. reference: ``ReferenceEngine.logprobs`` (the reference model's forward);
4. update: ``TrainerEngine.step`` on the experience records built from 1-3 (old log-probs and values, the
   actor's and critic's forward/backward and optimizer steps);
5. weights: the new actor weights copied into the generation engine's model (in place; the ring streams them).

The process has every core (torch's default threads, ``OMP_NUM_THREADS`` = the cores it may run on). The answer
holds each step's total and per-phase seconds, and (``"roofline": true``) how close the update comes to this
machine's matmul rate (:func:`roofline`).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


async def run(c: dict) -> dict:
    import torch

    from rlhf.config import parse_config
    from rlhf.models import resolve_model_path
    from rlhf.v1 import common_pb2, experience_pb2
    from services.reference.engine import LogProbsItem, ReferenceEngine
    from services.reward.engine import RewardEngine
    from services.reward.scorers import Item
    from services.rollout.hf_engine import HFEngine
    from services.rollout.options import SamplingOptions
    from services.trainer.engine import TrainerEngine

    cfg = parse_config(c["config"])
    a = cfg.actor
    trainer = TrainerEngine(cfg, device="cpu")
    gen = HFEngine(resolve_model_path(a.load), "policy", device="cpu", max_batch_rows=1024)
    await gen.start()
    reward = RewardEngine(cfg, device="cpu")
    reward.load()
    ref = ReferenceEngine(cfg, device="cpu")
    ref.load()
    tok = gen.tokenizer
    opts = SamplingOptions(n=a.n_samples_per_prompt, temperature=a.temperature, max_tokens=a.max_new_tokens)
    ref_t = cfg.logprob_temperature if cfg.logprob_temperature is not None else a.temperature
    batch = cfg.training.global_batch_size
    prompts_all = c["prompt_ids"]
    steps: list[dict] = []
    for step in range(c["steps"]):
        picks = [(step * batch + i) % len(prompts_all) for i in range(batch)]
        prompts = [prompts_all[k] for k in picks]
        marks = [("start", time.perf_counter())]

        def lap(name: str, marks: list = marks) -> None:
            marks.append((name, time.perf_counter()))

        results = await gen.generate(prompts, opts)
        lap("generation")
        flat = [(k, p, s) for k, p, r in zip(picks, prompts, results, strict=True) for s in r.samples]
        texts = [tok.decode(s.token_ids, skip_special_tokens=True) for _, _, s in flat]
        # the reward model gets the user's text, as the ring's prompt jobs carry it (it renders its own template)
        raw = c.get("prompt_texts")
        items = [
            Item(
                prompt=raw[k] if raw else tok.decode(p, skip_special_tokens=True),
                response=x,
                prompt_ids=list(p),
                response_ids=list(s.token_ids),
                finished=s.finish_reason == "stop",
            )
            for (k, p, s), x in zip(flat, texts, strict=True)
        ]
        scores = await reward.score(items)
        lap("reward")
        refs, _ = await ref.logprobs([LogProbsItem(list(p), list(s.token_ids)) for _, p, s in flat], ref_t)
        lap("reference")
        exps, k = [], 0
        for j, (p, r) in enumerate(zip(prompts, results, strict=True)):
            exp = experience_pb2.Experience(job_id=f"b{step}-{j}", run_id="bound", prompt_ids=p)
            for s in r.samples:
                sc = scores[k]
                exp.samples.append(
                    experience_pb2.Sample(
                        response_ids=s.token_ids,
                        sampling_logprobs=s.logprobs,
                        ref_logprobs=refs[k],
                        score=sc.score or 0.0,
                        score_status=common_pb2.ITEM_STATUS_OK
                        if sc.score is not None
                        else common_pb2.ITEM_STATUS_UNSPECIFIED,
                        policy_version=trainer.policy_version,
                    )
                )
                k += 1
            exps.append(exp)
        trainer.step(exps)
        lap("update")
        with torch.no_grad():
            src = trainer.actor.state_dict()
            for name, v in gen.model.state_dict().items():
                v.copy_(src[name])
        lap("weights")
        ph = {name: t - marks[i][1] for i, (name, t) in enumerate(marks[1:])}
        steps.append({"total": marks[-1][1] - marks[0][1], **ph})
    await gen.close()
    out = {"steps": steps, "torch_threads": torch.get_num_threads()}
    if c.get("roofline"):
        out["roofline"] = roofline(trainer, exps, sorted(s["update"] for s in steps[1:])[len(steps[1:]) // 2])
    return out


def _mm_rate(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    """FLOP/s of torch.mm on an (m, k) x (k, n) fp32 product with this process's threads, for about ``seconds``."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    for _ in range(3):
        a @ b
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - t0)


def roofline(trainer, exps: list, update_s: float) -> dict:
    """The update's FLOPs over its measured seconds (median of the steady steps) against torch.mm's own rate here.

    FLOPs: torch's flop counter over one more ``TrainerEngine.step`` on the last batch, with the critic's passes
    after the actor's (the counter sees its own thread's operations; the operations are the same side by side).
    Matmul rate: the update's commonest product (a minibatch's packed tokens x hidden, times hidden x intermediate)
    and a large square one (2048^3) on every thread, and the first on one thread times the threads (the update's
    actor and critic run one team each side by side). The update's rate over the best of them says how much a
    faster schedule of the same fp32 work could still gain."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    cfg = trainer.actor.config
    trainer._parallel_critic = lambda: False
    with FlopCounterMode(display=False) as counter:
        trainer.step(exps)
    flops = counter.get_total_flops()
    tokens = sum(len(e.prompt_ids) + len(s.response_ids) for e in exps for s in e.samples)
    mini = trainer.cfg.actor.ppo_mini_batch_size
    rows = max(1, round(tokens / sum(len(e.samples) for e in exps) * mini))
    threads = torch.get_num_threads()
    shape = f"{rows}x{cfg.hidden_size}x{cfg.intermediate_size}"
    rates = {
        shape: _mm_rate(rows, cfg.hidden_size, cfg.intermediate_size),
        "2048x2048x2048": _mm_rate(2048, 2048, 2048),
    }
    torch.set_num_threads(1)  # the update's two sides run one team each: one thread's rate, times the threads
    rates[f"{shape}, 1 thread x {threads}"] = threads * _mm_rate(rows, cfg.hidden_size, cfg.intermediate_size)
    torch.set_num_threads(threads)
    achieved = flops / update_s
    return {
        "update_gflop": flops / 1e9,
        "update_s": update_s,
        "update_gflop_per_s": achieved / 1e9,
        "mm_gflop_per_s": {k: round(v / 1e9, 1) for k, v in rates.items()},
        "update_vs_mm_rate": achieved / max(rates.values()),
        "torch_threads": threads,
    }


def main() -> None:
    import torch

    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter goes to stderr; the answer goes to the real stdout
    c = json.loads(sys.stdin.readline())
    try:
        res = asyncio.run(run(c))
    except Exception as err:  # noqa: BLE001 - reported to the benchmark, which fails loudly
        import traceback

        traceback.print_exc()
        res = {"error": f"{type(err).__name__}: {err}", "torch_threads": torch.get_num_threads()}
    print("RESULT " + json.dumps(res), file=out, flush=True)


if __name__ == "__main__":
    main()
