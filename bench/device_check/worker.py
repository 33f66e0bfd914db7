"""One phase in a process of its own (``--worker PHASE``): the phases by name, and what each imports (the dry
run's check)."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

from bench.device_check import checkpoint, model, push, ring, rollout, trainer, vllm
from bench.device_check.common import Record, log

PHASE_FNS = {
    "model": model.run,
    "trainer": trainer.run,
    "rollout": rollout.run,
    "push": push.run,
    "checkpoint": checkpoint.run,
    "ring": ring.run,
    "vllm": vllm.run,
}
IMPORTS = {
    "model": ["torch", "transformers", "safetensors", "rlhf.tiny"],
    "trainer": ["rlhf.config", "services.trainer.engine"],
    "rollout": ["services.rollout.hf_engine"],
    "push": [
        "grpc",
        "rlhf.serving",
        "services.rollout.grpc_servicer",
        "rlhf.transport.weights.send",
        "tests.support.replica",
    ],
    "checkpoint": ["torch.distributed.checkpoint", "torch.distributed.fsdp", "services.trainer.checkpoint"],
    "ring": [
        "yaml",
        "redis",
        "fastapi",
        "uvicorn",
        "grpc_health.v1.health",
        "services.launcher",
        "services.rollout.main",
        "services.trainer.main",
    ],
    "vllm": ["vllm", "services.rollout.vllm_engine", "services.rollout.vllm_transfer"],
}


def worker(phase: str, work: Path, budget_s: float) -> int:
    """``--worker PHASE``: run one phase, its result in ``WORK/results/PHASE.json``."""
    p = json.loads((work / "plan.json").read_text())
    p.update(budget_s=budget_s, t0=time.monotonic())
    rec = Record(work / "results" / f"{phase}.json")
    rec.put(status="running")
    try:
        PHASE_FNS[phase](p, rec)
    except Exception as err:  # noqa: BLE001 - the phase's result
        rec.put(status="failed", error=f"{type(err).__name__}: {err}"[:2000], trace=traceback.format_exc()[-3000:])
        log(traceback.format_exc())
        return 1
    failed = [k for k, ok in rec.get("checks", {}).items() if not ok]
    rec.put(status="failed" if failed else "ok", **({"failed_checks": failed} if failed else {}))
    return 1 if failed else 0
