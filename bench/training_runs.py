"""bench.training_runs: what each additional training run costs the training service (issue 45, item 3).

One ``TrainingEngine`` (services/training) loads the bench's "small" policy (~21M parameters, fp32) once; then runs
are added one by one, each a rank-16 LoRA on every module that takes one forward_backward (4 x 128 tokens) and one
Adam step, so that its adapter, gradients and Adam moments all exist. After each run the process's resident memory
(VmRSS) and the run's tensors (adapter + moments, ``engine.memory()``) are read. The first run also pays the
allocator's high-water mark of a forward/backward, so the steady cost per run is the median RSS step from the second
run on.
"""

from __future__ import annotations

import gc
import tempfile
import time

import torch

from bench._common import QUICK, build_model, emit, log, median, rnd, target
from services.training.engine import AdamStep, TrainingEngine
from services.training.sessions import owner_of
from services.training.shared_model import LoraSpec
from services.training.tinker_protocol import AdamIn
from services.training.wire import Datum, ForwardBackwardCall

RUNS = 3 if QUICK else 8
RANK = 16
OWNER = owner_of("tml-bench")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    started = time.monotonic()
    torch.manual_seed(0)
    paths = build_model("small")
    with tempfile.TemporaryDirectory() as tmp:
        engine = TrainingEngine(str(paths.policy), tmp, "cpu")
        engine._load()
        engine.ready = True
        gc.collect()
        rss_base = rss_bytes()
        data = [
            Datum(tokens, {"target_tokens": torch.roll(tokens, -1), "weights": torch.ones(128)})
            for tokens in torch.randint(5, engine.model.vocab_size, (4, 128))
        ]
        rss, run_bytes = [], []
        for i in range(RUNS):
            model_id = f"bench:train:{i}"
            engine._new_run(OWNER, model_id, LoraSpec(RANK, i, True, True, True), None)
            engine._fwd_bwd_job(OWNER, ForwardBackwardCall(model_id, 1, "cross_entropy", None, False, data))
            engine._optim_job(OWNER, model_id, AdamStep(**AdamIn().model_dump()))
            gc.collect()
            rss.append(rss_bytes())
            run_bytes.append(engine.memory()["run_bytes"][model_id])
            log(f"run {i + 1}: rss {rss[-1] / 2**20:.1f} MiB, run tensors {run_bytes[-1] / 2**20:.2f} MiB")
        base_bytes = engine.memory()["base_bytes"]
        engine.close()
    steps = [b - a for a, b in zip(rss, rss[1:], strict=False)]
    per_run = median(steps) if steps else None
    emit(
        "training_runs",
        settings={"model": "bench small policy, fp32, cpu", "runs": RUNS, "lora_rank": RANK, "batch": "4 x 128"},
        figures={
            "base_weights_mib": rnd(base_bytes / 2**20),
            "rss_after_each_run_mib": [rnd(r / 2**20) for r in rss],
            "rss_first_run_mib": rnd((rss[0] - rss_base) / 2**20),
            "rss_per_additional_run_mib": rnd(per_run / 2**20) if per_run is not None else None,
            "run_tensors_mib": rnd(median(run_bytes) / 2**20),
        },
        ratio={"rss_per_additional_run_over_base_weights": rnd(per_run / base_bytes) if per_run is not None else None},
        targets=[
            target(
                "RSS per additional run / base weights (rank 16, every module)",
                rnd(per_run / base_bytes) if per_run is not None else None,
                "< 0.25",
                per_run is not None and per_run / base_bytes < 0.25,
            )
        ],
        notes=[
            "a run is its adapter, its Adam moments (2 x the adapter) and, between forward_backward and optim_step, "
            "its gradients; the base is loaded once whatever the number of runs",
            "rss_first_run also holds the allocator's high-water mark of the first forward/backward",
        ],
        started=started,
    )


if __name__ == "__main__":
    main()
