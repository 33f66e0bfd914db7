"""``rollout``: the ``hf`` rollout engine on the device: sampled tokens/s with log-probs, greedy determinism,
log-probs recomputed by a plain forward."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Any

from bench.device_check.common import Record, model_paths, peak_gib, random_prompts, sync


def run(p: dict[str, Any], rec: Record) -> None:
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    from services.rollout.hf_engine import HFEngine  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from services.rollout.options import SamplingOptions  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    policy, _ = model_paths(p)
    r = p["rollout"]

    async def main() -> None:
        eng = HFEngine(policy, "device-check", dtype=p["serve_dtype"], device=p["device"], max_batch_rows=256)
        t0 = time.perf_counter()
        await eng.start()
        rec.put(start_seconds=round(time.perf_counter() - t0, 1), device=str(eng.device), dtype=p["serve_dtype"])
        try:
            prompts = random_prompts(r["prompts"], r["prompt_len"])
            per = max(1, len(prompts) // r["requests"])
            chunks = [prompts[i : i + per] for i in range(0, len(prompts), per)]
            opts = [
                SamplingOptions(n=r["n"], max_tokens=r["new_tokens"], temperature=1.0, seed=i, ignore_eos=True)
                for i in range(len(chunks))
            ]
            await eng.generate(chunks[0][:2], SamplingOptions(max_tokens=4, temperature=1.0, seed=0))  # warm-up
            sync(p)
            t0 = time.perf_counter()
            results = await asyncio.gather(*(eng.generate(c, o) for c, o in zip(chunks, opts, strict=True)))
            sync(p)
            seconds = time.perf_counter() - t0
            samples = [s for res in results for pr in res for s in pr.samples]
            n_tokens = sum(len(s.token_ids) for s in samples)
            lps = [lp for s in samples for lp in s.logprobs]
            rec.put(
                requests=len(chunks),
                samples=len(samples),
                tokens=n_tokens,
                seconds=round(seconds, 3),
                tokens_per_s=round(n_tokens / seconds, 1),
                mean_logprob=round(statistics.mean(lps), 4),
                peak_memory_gib=peak_gib(p),
            )
            rec.check("all_tokens", all(len(s.token_ids) == r["new_tokens"] for s in samples))
            rec.check("logprob_per_token", all(len(s.logprobs) == len(s.token_ids) for s in samples))
            rec.check("logprobs_valid", all(math.isfinite(x) and x <= 1e-4 for x in lps))
            greedy = SamplingOptions(max_tokens=16, temperature=0.0, ignore_eos=True)
            few = prompts[:4]
            first = [s for pr in await eng.generate(few, greedy) for s in pr.samples]
            again = [s for pr in await eng.generate(few, greedy) for s in pr.samples]
            rec.check("greedy_deterministic", [s.token_ids for s in first] == [s.token_ids for s in again])

            def recompute() -> float:  # the reported greedy log-probs against one forward over prompt + response
                worst = 0.0
                with torch.no_grad():
                    for prompt, s in zip(few, first, strict=True):
                        ids = torch.tensor([prompt + s.token_ids], device=eng.device)
                        logits = eng.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
                        lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0].cpu()
                        worst = max(worst, (lp - torch.tensor(s.logprobs)).abs().max().item())
                return worst

            # informational: batched decoding with a KV cache (bf16 on the GPU) against a plain forward
            rec.put(logprob_recompute_max_abs=round(await asyncio.to_thread(recompute), 5))
        finally:
            await eng.close()

    asyncio.run(main())
