"""``model``: build the policy (Llama with tied embeddings) and a critic/reward model of that shape."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.device_check.common import Record


def run(p: dict[str, Any], rec: Record) -> None:
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from safetensors import safe_open  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    from rlhf.tiny import TinySpec, build_tiny  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    if p["device"] == "cuda" and not torch.cuda.is_available():
        rec.put(no_cuda=True)
        raise RuntimeError("no CUDA device (torch.cuda.is_available() is False); use --cpu")
    spec = TinySpec(**p["spec"])
    t0 = time.perf_counter()
    paths = build_tiny(Path(p["work"]) / "models" / spec.name, spec)
    counts, keys = {}, {}
    for role, path in (("policy", paths.policy), ("reward", paths.reward)):
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            keys[role] = list(f.keys())
            counts[role] = sum(_numel(f.get_slice(k).get_shape()) for k in keys[role])
    config = json.loads((paths.policy / "config.json").read_text())
    rec.put(
        policy=str(paths.policy),
        reward=str(paths.reward),
        arch=spec.arch,
        parameters=counts,
        build_seconds=round(time.perf_counter() - t0, 1),
    )
    rec.check("tied_embeddings", config.get("tie_word_embeddings") is True)
    rec.check("tie_alias_not_saved", "lm_head.weight" not in keys["policy"])


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
