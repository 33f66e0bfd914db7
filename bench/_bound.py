"""The compute bound of bench.pipeline: each phase of one ring step at its best thread count, its core-seconds over
the cores.

``python -m bench._bound`` reads one JSON command on stdin and answers one line ``RESULT {json}`` on stdout::

    {"config": {...experiment...}, "prompt_ids": [[...], ...], "prompt_texts": [...], "steps": 4, "cores": 2}

Per step, with the same engine classes the services run (no process, queue, RPC or serialisation between them),
the phases one ring step needs:

1. generation: the rollout engine the ring runs (``actor_rollout.engine``: ``hf``, or ``vllm`` with
   ``BENCH_ENGINE=vllm``), the batch's prompts in one ``generate`` call (the replica's batcher merges the ring's
   concurrent jobs into one decode the same way);
2. reward: ``RewardEngine.score`` on the responses (the reward model's forward);
3. reference: ``ReferenceEngine.logprobs`` (the reference model's forward);
4. update: ``TrainerEngine.step`` on the experience records built from 1-3 (old log-probs and values, the
   actor's and critic's forward/backward and optimizer steps);
5. weights: the new actor weights into the generation engine: hf, copied in place into its model (the ring streams
   them); vLLM, ``swap_weights`` as the replica installs a push (its staged swap on a CPU), from a copy of the
   actor's state dict (the trainer copies its push too).

Each phase runs once at every thread count t = 1..cores, in rising order on even steps and falling on odd ones,
with ``torch.set_num_threads(t)`` in every thread that runs it: this one, the event loop's executor threads that run
the forwards and decodes, and vLLM's engine thread (its in-process driver on a CPU, as the ring's replica runs it with
one thread; vLLM's CPU worker turns torch.set_num_threads into a no-op for the whole process, expecting bound
threads, which its in-process driver does not bind: this puts the real one back). The next phase takes the last
run's output, and the trainer's state advances at each update (what counts is the time per phase). "t threads" is
the intra-op threads the process grants: the update at t >= 2 runs the actor and the critic side by side on
t - t // 2 and t // 2 of them (``PPOStage._side_threads``), at t = 1 one after the other on one thread.

The bound: a phase's core-seconds at t are the least of its wall time times t and the process CPU seconds it
measurably used (medians over the steady steps), its best the least over t; the bound's step time is the sum of the
phases' best core-seconds over the cores. It is a lower bound of any ring on these cores, synchronous or not: a
ring's step time times the cores is at least the CPU time it spends per step, and each phase costs it at least the
CPU time the phase needs at its most frugal thread count, which the best core-seconds do not exceed (the CPU seconds
are what the work took, wall x t caps them where threads beside the t add their own; running phases side by side in
separate processes only adds contention). The CPU term keeps it a bound where the machine's load stretches a wall.
``serial_step_s`` is the former figure: every phase with every thread, back to back in one process (the sum of the
phases' walls at t = cores). With ``"roofline": true`` the answer also says how close the update comes to this
machine's matmul rate (:func:`roofline`).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PHASES = ("generation", "reward", "reference", "update", "weights")


def summary(raw: dict, cores: int) -> dict:
    """The bound from the per-step measurements ``raw[phase][t] = {"wall_s": [...], "cpu_s": [...]}`` (steady steps
    only): per phase and thread count the median wall, wall x t, the median CPU seconds and the core-seconds counted
    (the least of the two); per phase its best thread count and core-seconds; the bound's step time (the best
    core-seconds over ``cores``) and ``serial_step_s`` (the walls at t = cores, back to back)."""
    phases: dict = {}
    for name in PHASES:
        per_t: dict = {}
        for t, m in sorted(raw[name].items(), key=lambda kv: int(kv[0])):
            wall, cpu = statistics.median(m["wall_s"]), statistics.median(m["cpu_s"])
            per_t[str(t)] = {
                "wall_s": wall,
                "wall_x_threads_s": wall * int(t),
                "cpu_s": cpu,
                "core_s": min(wall * int(t), cpu),
            }
        best = min(per_t, key=lambda t: per_t[t]["core_s"])
        phases[name] = {"threads": per_t, "best_threads": int(best), "best_core_s": per_t[best]["core_s"]}
    core_s = sum(p["best_core_s"] for p in phases.values())
    return {
        "cores": cores,
        "step_s": core_s / cores,
        "core_s_per_step": core_s,
        "serial_step_s": sum(p["threads"][str(cores)]["wall_s"] for p in phases.values()),
        "phases": phases,
    }


def per_step(raw: dict, cores: int) -> list[float]:
    """The bound's step time of each steady step alone (its phases' least core-seconds over the cores)."""
    n = len(next(iter(raw[PHASES[0]].values()))["wall_s"])
    return [
        sum(min(min(m["wall_s"][i] * int(t), m["cpu_s"][i]) for t, m in raw[name].items()) for name in PHASES) / cores
        for i in range(n)
    ]


async def run(c: dict) -> dict:
    import torch  # noqa: PLC0415 - torch loads after main() sets vLLM's env; bench.pipeline imports summary() without it

    from rlhf.config import parse_config  # noqa: PLC0415 - loads torch: after main() sets vLLM's env; bench.pipeline imports summary() without it
    from rlhf.v1 import common_pb2, experience_pb2  # noqa: PLC0415 - loads torch: after main() sets vLLM's env; bench.pipeline imports summary() without it
    from services.reference.engine import LogProbsItem, ReferenceEngine  # noqa: PLC0415 - loads torch: after main() sets vLLM's env; bench.pipeline imports summary() without it
    from services.reward.engine import RewardEngine  # noqa: PLC0415 - loads torch: after main() sets vLLM's env; bench.pipeline imports summary() without it
    from services.reward.scorers import Item  # noqa: PLC0415 - loads torch: after main() sets vLLM's env; bench.pipeline imports summary() without it
    from services.rollout.factory import engine_kind, make_engine  # noqa: PLC0415 - loads torch: after main() sets vLLM's env; bench.pipeline imports summary() without it
    from services.rollout.options import SamplingOptions  # noqa: PLC0415 - loads torch: after main() sets vLLM's env; bench.pipeline imports summary() without it
    from services.trainer.engine import TrainerEngine  # noqa: PLC0415 - loads torch: after main() sets vLLM's env; bench.pipeline imports summary() without it

    cfg = parse_config(c["config"])
    a = cfg.actor
    kind = engine_kind(cfg, {})
    cores = int(c.get("cores") or torch.get_num_threads())
    counts = list(range(1, cores + 1))
    loop = asyncio.get_running_loop()
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process (it expects its threads
    # bound, which its in-process driver does not do): the sweep and the trainer's actor/critic split need the real one
    set_num_threads = torch.set_num_threads
    # the forwards and decodes run in the event loop's executor threads: one pool per thread count, each of its
    # threads set to that count (torch's thread count is per thread)
    pools = {
        t: ThreadPoolExecutor(4, thread_name_prefix=f"t{t}", initializer=set_num_threads, initargs=(t,)) for t in counts
    }
    trainer = TrainerEngine(cfg, device="cpu")
    gen = make_engine(cfg, kind=kind, device="cpu", **({"max_batch_rows": 1024} if kind == "hf" else {}))
    await gen.start()
    torch.set_num_threads = set_num_threads
    reward = RewardEngine(cfg, device="cpu")
    reward.load()
    ref = ReferenceEngine(cfg, device="cpu")
    ref.load()
    tok = gen.tokenizer
    opts = SamplingOptions(n=a.n_samples_per_prompt, temperature=a.temperature, max_tokens=a.max_new_tokens)
    ref_t = cfg.logprob_temperature if cfg.logprob_temperature is not None else a.temperature
    batch = cfg.training.global_batch_size
    prompts_all = c["prompt_ids"]
    raw = {name: {t: {"wall_s": [], "cpu_s": []} for t in counts} for name in PHASES}
    version = [gen.weights_version]

    async def threads(t: int) -> None:
        set_num_threads(t)
        loop.set_default_executor(pools[t])
        if kind == "vllm":  # its engine thread runs the model
            await gen._call(lambda _llm: set_num_threads(t))

    async def phase(name: str, step: int, fn):
        """``fn()`` (a coroutine function) at every thread count; the last run's answer."""
        out = None
        for t in counts if step % 2 == 0 else counts[::-1]:
            await threads(t)
            w0, c0 = time.perf_counter(), time.process_time()
            out = await fn()
            raw[name][t]["wall_s"].append(time.perf_counter() - w0)
            raw[name][t]["cpu_s"].append(time.process_time() - c0)
        return out

    async def update(exps: list) -> None:
        trainer.step(exps)

    async def weights() -> None:
        with torch.no_grad():
            src = trainer.actor.state_dict()
            if kind == "vllm":  # as the replica installs a push (the tensors become the engine's)
                version[0] += 1
                tensors = {k: v.detach().clone() for k, v in src.items()}
                await gen.swap_weights(tensors, version[0], f"bound-{version[0]}")
            else:
                for name, v in gen.model.state_dict().items():
                    v.copy_(src[name])

    for step in range(c["steps"]):
        picks = [(step * batch + i) % len(prompts_all) for i in range(batch)]
        prompts = [prompts_all[k] for k in picks]
        results = await phase("generation", step, lambda prompts=prompts: gen.generate(prompts, opts))
        flat = [(k, p, s) for k, p, r in zip(picks, prompts, results, strict=True) for s in r.samples]
        texts = [tok.decode(s.token_ids, skip_special_tokens=True) for _, _, s in flat]
        # the reward model gets the user's text, as the ring's prompt jobs carry it (it renders its own template)
        texts_raw = c.get("prompt_texts")
        items = [
            Item(
                prompt=texts_raw[k] if texts_raw else tok.decode(p, skip_special_tokens=True),
                response=x,
                prompt_ids=list(p),
                response_ids=list(s.token_ids),
                finished=s.finish_reason == "stop",
            )
            for (k, p, s), x in zip(flat, texts, strict=True)
        ]
        scores = await phase("reward", step, lambda items=items: reward.score(items))
        lp_items = [LogProbsItem(list(p), list(s.token_ids)) for _, p, s in flat]
        refs, _ = await phase("reference", step, lambda lp_items=lp_items: ref.logprobs(lp_items, ref_t))
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
        await phase("update", step, lambda exps=exps: update(exps))
        await phase("weights", step, weights)
    await threads(cores)
    await gen.close()
    for pool in pools.values():
        pool.shutdown()
    out = {"engine": kind, "cores": cores, "steps": c["steps"], "raw": raw, "torch_threads": torch.get_num_threads()}
    if c.get("roofline"):
        upd = raw["update"][cores]["wall_s"][1:] or raw["update"][cores]["wall_s"]
        out["roofline"] = roofline(trainer, exps, statistics.median(upd))
    return out


def _mm_rate(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    """FLOP/s of torch.mm on an (m, k) x (k, n) fp32 product with this process's threads, for about ``seconds``."""
    import torch  # noqa: PLC0415 - torch loads after main() sets vLLM's env; bench.pipeline imports summary() without it

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
    import torch  # noqa: PLC0415 - torch loads after main() sets vLLM's env; bench.pipeline imports summary() without it
    from torch.utils.flop_counter import FlopCounterMode  # noqa: PLC0415 - torch loads after main() sets vLLM's env; bench.pipeline imports summary() without it

    cfg = trainer.actor.config
    trainer.ppo._parallel_critic = lambda: False
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
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter goes to stderr; the answer goes to the real stdout
    c = json.loads(sys.stdin.readline())
    if c["config"].get("actor_rollout_ref", {}).get("actor_rollout", {}).get("engine") == "vllm":
        # as the rollout service does, before anything imports torch
        from services.rollout.vllm_engine import set_vllm_env_defaults  # noqa: PLC0415 - loads torch: after main() sets vLLM's env; bench.pipeline imports summary() without it

        set_vllm_env_defaults("cpu")
    import torch  # noqa: PLC0415 - torch loads after main() sets vLLM's env; bench.pipeline imports summary() without it

    try:
        res = asyncio.run(run(c))
    except Exception as err:  # noqa: BLE001 - reported to the benchmark, which fails loudly
        traceback.print_exc()
        res = {"error": f"{type(err).__name__}: {err}", "torch_threads": torch.get_num_threads()}
    print("RESULT " + json.dumps(res), file=out, flush=True)


if __name__ == "__main__":
    main()
