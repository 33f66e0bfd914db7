"""bench.partial_rollouts: how long a weight push waits for the requests in flight, with partial rollouts off and on.

One ``hf`` engine per setting (``actor_rollout.partial_rollouts``) and one ``vllm`` engine (in-process driver) whose
setting is switched between rounds, in this process, on the CPU, float32, the ``small`` model (~21M parameters,
rlhf.tiny). Each round: one ``generate`` call of ``N`` sampled samples x
``NEW_TOKENS`` tokens (``ignore_eos``, temperature 1); once the engine has decoded ``PUSH_AFTER`` steps of it, a push
of the same model with perturbed weights (``swap_weights``, as a received update is installed). Off: the push waits
until the request has finished; on: the request stops at the next token, the push installs, the request goes on
under the new version. The settings alternate (off, on, on, off, ...). Figures, medians over the rounds: the push's
wait for requests in flight (``SwapResult.wait_seconds``), the request's wall time, and where the samples were cut.
Not yet a ring measurement (issue 44 item 1: a long-tail workload in a ring, the replica's idle fraction per push).
"""

from __future__ import annotations

import asyncio
import time

from bench._common import QUICK, RING_THREADS, build_model, emit, log, median, param_count, rnd, side

N = 8
NEW_TOKENS = 32 if QUICK else 192
PUSH_AFTER = 8 if QUICK else 24
ROUNDS = 1 if QUICK else 2
PROMPT = [2, 40, 41, 42, 43, 44, 45, 46]


async def _round(engine, steps: list[int], new, version: int) -> dict:
    from services.rollout.options import SamplingOptions  # noqa: PLC0415 - torch after bench._common sets OMP_*

    opts = SamplingOptions(n=N, max_tokens=NEW_TOKENS, temperature=1.0, seed=version, ignore_eos=True)
    steps.clear()
    t0 = time.perf_counter()
    request = asyncio.create_task(engine.generate([PROMPT], opts))
    while len(steps) < PUSH_AFTER and not request.done():
        await asyncio.sleep(0.001)
    swap = await engine.swap_weights(new, version, f"bench-{version}")
    (result,) = await request
    return {
        "push_wait_s": swap.wait_seconds,
        "request_s": time.perf_counter() - t0,
        "cut_at": [s.spans[1][0] for s in result.samples if s.spans],
    }


async def main() -> None:
    started = time.monotonic()
    import torch  # noqa: PLC0415 - torch after bench._common sets OMP_*
    from safetensors.torch import load_file  # noqa: PLC0415 - torch after bench._common sets OMP_*

    from services.rollout.engine_types import EngineHooks  # noqa: PLC0415 - torch after bench._common sets OMP_*
    from services.rollout.hf_engine import HFEngine  # noqa: PLC0415 - torch after bench._common sets OMP_*
    from services.rollout.vllm_engine import (  # noqa: PLC0415 - torch after bench._common sets OMP_*
        VllmEngine,
        set_vllm_env_defaults,
    )

    set_vllm_env_defaults("cpu")

    paths = build_model("small")
    state = load_file(str(paths.policy / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    settings = [("hf", False), ("hf", True), ("vllm", False), ("vllm", True)]
    steps: dict[tuple[str, bool], list[int]] = {k: [] for k in settings}
    engines = {}
    for kind, partial in settings:
        hooks = EngineHooks(on_step=steps[(kind, partial)].append)
        if kind == "hf":
            engines[(kind, partial)] = HFEngine(
                paths.policy, "small", device="cpu", hooks=hooks, partial_rollouts=partial
            )
        elif not partial:  # one vLLM engine in this process: the setting is switched per round
            engines[(kind, partial)] = VllmEngine(paths.policy, "small", mode="inproc", hooks=hooks)
        else:
            engines[(kind, partial)] = engines[(kind, False)]
            steps[(kind, partial)] = steps[(kind, False)]
        if engines[(kind, partial)].ready is False:
            await engines[(kind, partial)].start()
    runs: dict[tuple[str, bool], list[dict]] = {k: [] for k in settings}
    version = 0
    for rep in range(ROUNDS):
        for kind, partial in settings if rep % 2 == 0 else [(k, not p) for k, p in settings]:
            version += 1  # each engine sees increasing versions (it skips the others')
            new = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in state.items()}
            eng = engines[(kind, partial)]
            eng.partial_rollouts = partial
            runs[(kind, partial)].append(await _round(eng, steps[(kind, partial)], new, version))
            log(f"bench.partial_rollouts: {kind} partial={partial} {runs[(kind, partial)][-1]}")
    for eng in {id(e): e for e in engines.values()}.values():
        await eng.close()

    def summary(rs: list[dict]) -> dict:
        return {
            "push_wait_s": rnd(median([r["push_wait_s"] for r in rs]), 4),
            "request_s": rnd(median([r["request_s"] for r in rs])),
            "samples_cut": sum(len(r["cut_at"]) for r in rs),
            "cut_at_token": sorted({c for r in rs for c in r["cut_at"]}),
        }

    figures = {f"{kind}_{'on' if partial else 'off'}": summary(runs[(kind, partial)]) for kind, partial in settings}

    def ratio(kind: str) -> float | None:
        off, on = figures[f"{kind}_off"]["push_wait_s"], figures[f"{kind}_on"]["push_wait_s"]
        return rnd(off / on) if on else None

    emit(
        "partial_rollouts",
        settings={
            "resources": {
                "hf": side(RING_THREADS, "in this process, one engine per setting, alternating"),
                "vllm": side(RING_THREADS, "in this process (inproc driver), one engine, the setting alternating"),
            },
            "model": f"small, {param_count(paths.policy) / 1e6:.2f}M parameters, float32, cpu",
            "request": f"one generate call, n={N}, {NEW_TOKENS} new tokens (ignore_eos), temperature 1; the push "
            f"after {PUSH_AFTER} decode steps",
            "rounds": ROUNDS,
        },
        figures=figures,
        ratio={"hf_push_wait_off_vs_on": ratio("hf"), "vllm_push_wait_off_vs_on": ratio("vllm")},
        notes=["no target yet: issue 44 item 1 measures the replica's idle fraction in a ring"],
        started=started,
    )


if __name__ == "__main__":
    asyncio.run(main())
