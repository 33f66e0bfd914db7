"""The compute bound of bench.pipeline: the model passes one ring step needs, back to back in one process.

``python -m bench._bound`` reads one JSON command on stdin and answers one line ``RESULT {json}`` on stdout::

    {"config": {...experiment...}, "prompt_ids": [[...], ...], "steps": 4}

Per step, with the same engine classes the services run (no process, queue, RPC or serialisation between them):

1. generation: the rollout's ``hf`` engine, the batch's prompts in one ``generate`` call (the replica's batcher
   merges the ring's concurrent jobs into one decode the same way);
2. reward: ``RewardEngine.score`` on the responses (the reward model's forward);
3. reference: ``ReferenceEngine.logprobs`` (the reference model's forward);
4. update: ``TrainerEngine.step`` on the experience records built from 1-3 (old log-probs and values, the
   actor's and critic's forward/backward and optimizer steps);
5. weights: the new actor weights copied into the generation engine's model (in place; the ring streams them).

The process has every core (torch's default threads, ``OMP_NUM_THREADS`` = the cores it may run on). The answer
holds each step's total and per-phase seconds.
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
    from services.reward.engine import Item, RewardEngine
    from services.rollout.engine import SamplingOptions
    from services.rollout.hf_engine import HFEngine
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
        prompts = [prompts_all[(step * batch + i) % len(prompts_all)] for i in range(batch)]
        marks = [("start", time.perf_counter())]

        def lap(name: str, marks: list = marks) -> None:
            marks.append((name, time.perf_counter()))

        results = await gen.generate(prompts, opts)
        lap("generation")
        flat = [(p, s) for p, r in zip(prompts, results, strict=True) for s in r.samples]
        texts = [tok.decode(s.token_ids, skip_special_tokens=True) for _, s in flat]
        ptexts = {id(p): tok.decode(p, skip_special_tokens=True) for p in prompts}
        items = [Item(prompt=ptexts[id(p)], response=x, prompt_ids=list(p), response_ids=list(s.token_ids),
                      finished=s.finish_reason == "stop") for (p, s), x in zip(flat, texts, strict=True)]  # fmt: skip
        scores = await reward.score(items)
        lap("reward")
        refs, _ = await ref.logprobs([LogProbsItem(list(p), list(s.token_ids)) for p, s in flat], ref_t)
        lap("reference")
        exps, k = [], 0
        for j, (p, r) in enumerate(zip(prompts, results, strict=True)):
            exp = experience_pb2.Experience(job_id=f"b{step}-{j}", run_id="bound", prompt_ids=p)
            for s in r.samples:
                sc = scores[k]
                exp.samples.append(experience_pb2.Sample(
                    response_ids=s.token_ids, sampling_logprobs=s.logprobs, ref_logprobs=refs[k],
                    score=sc.score or 0.0, score_status=common_pb2.ITEM_STATUS_OK if sc.score is not None
                    else common_pb2.ITEM_STATUS_UNSPECIFIED, policy_version=trainer.policy_version,
                ))  # fmt: skip
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
    return {"steps": steps, "torch_threads": torch.get_num_threads()}


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
