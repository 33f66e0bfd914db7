"""What the driver and the phases share: the plan (sizes, limits, the model's shape), a phase's result file
(:class:`Record`) and small helpers of the phases."""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PHASES = ("model", "trainer", "rollout", "push", "checkpoint", "ring", "vllm")
NEEDS_MODEL = {"trainer", "rollout", "push", "checkpoint", "vllm"}
# rlhf.tiny TinySpec fields. GPU: about 270M parameters per model (the 512-token tiny vocabulary, so the rollout
# service's tokenizer fits); head_dim 64.
GPU_SPEC = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "arch": "llama-tied",
}
CPU_SPEC = {"arch": "llama-tied"}  # the tiny shape: hidden 64, 2 layers
# Per phase: (time limit, least time worth starting it with), seconds. The limits add up to more than the deadline:
# they stop a phase that hangs, the deadline bounds the whole run.
LIMITS = {
    "cuda": {
        "model": (90, 20),
        "trainer": (120, 30),
        "rollout": (90, 20),
        "push": (180, 40),
        "checkpoint": (150, 40),
        "ring": (270, 90),
        "vllm": (300, 120),
    },
    "cpu": {
        "model": (90, 10),
        "trainer": (120, 15),
        "rollout": (90, 10),
        "push": (150, 20),
        "checkpoint": (150, 20),
        "ring": (300, 60),
        "vllm": (420, 120),
    },
}
GPU_SIZES = {
    "trainer": {"prompts": 16, "n": 4, "prompt_len": 64, "response_len": 192, "mini_batch": 16, "steps": 3},
    "rollout": {"prompts": 64, "n": 4, "prompt_len": 64, "new_tokens": 128, "requests": 8},
    "ring": {"steps": 60, "min_gain": 0.2},  # the demo gains about 0.6 in 60 steps on the CPU
    "vllm": {"prompts": 256, "prompt_len": 32, "new_tokens": 128, "pushes": 3},
}
CPU_SIZES = {
    "trainer": {"prompts": 4, "n": 4, "prompt_len": 8, "response_len": 12, "mini_batch": 8, "steps": 2},
    "rollout": {"prompts": 4, "n": 2, "prompt_len": 8, "new_tokens": 8, "requests": 2},
    "ring": {"steps": 6, "min_gain": None},  # goes round; too short to show learning (60 steps: make demo)
    "vllm": {"prompts": 16, "prompt_len": 32, "new_tokens": 16, "pushes": 3},
}
DEADLINE_S = {"cuda": 450, "cpu": 900}  # the 8-minute run: bench/device_check.sh passes what is left of it
TOKEN = "device-check"


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    gpu = not args.cpu
    device = "cuda" if gpu else "cpu"
    sizes = GPU_SIZES if gpu else CPU_SIZES
    return {
        "device": device,
        "spec": GPU_SPEC if gpu else CPU_SPEC,
        "serve_dtype": "bfloat16" if gpu else "float32",  # the rollout engine's, in rollout and push
        **sizes,
        # NCCL last: where it refuses two ranks on one GPU, its failure cannot spoil the others
        "push": {"transports": ["tcp", "grpc", "collective/gloo", *(["collective/nccl"] if gpu else [])]},
        "limits": LIMITS[device],
        "work": str(args.work),
        "out": str(args.out),
    }


class Record(dict):
    """A phase's result, written to its file at every ``put`` (atomically)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def put(self, **kw: Any) -> None:
        self.update(kw)
        self.flush()

    def check(self, name: str, ok: bool) -> bool:
        self.setdefault("checks", {})[name] = bool(ok)
        self.flush()
        return bool(ok)

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self, default=str))
        os.replace(tmp, self.path)


def model_paths(p: dict[str, Any]) -> tuple[str, str]:
    built = json.loads((Path(p["work"]) / "results" / "model.json").read_text())
    return built["policy"], built["reward"]


def sync(p: dict[str, Any]) -> None:
    if p["device"] == "cuda":
        import torch  # noqa: PLC0415 - the driver imports this module: torch loads in a phase's own process

        torch.cuda.synchronize()


def peak_gib(p: dict[str, Any]) -> float | None:
    if p["device"] != "cuda":
        return None
    import torch  # noqa: PLC0415 - the driver imports this module: torch loads in a phase's own process

    return round(torch.cuda.max_memory_allocated() / 2**30, 2)


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[2, *(rng.randrange(4, 500) for _ in range(length - 1))] for _ in range(n)]
