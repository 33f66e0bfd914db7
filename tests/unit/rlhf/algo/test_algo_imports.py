"""rlhf.algo is pure torch: importing it pulls in no network, serving or model library."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("grpc", "fastapi", "redis", "uvicorn", "transformers", "services")

PROBE = """
import json, sys
import rlhf.algo
forbidden = {forbidden!r}
hits = sorted(m for m in sys.modules if m.split(".")[0] in forbidden)
print(json.dumps({{"hits": hits, "torch": "torch" in sys.modules, "algo": "rlhf.algo.ppo" in sys.modules}}))
"""


def test_importing_rlhf_algo_imports_only_torch():
    proc = subprocess.run(
        [sys.executable, "-c", PROBE.format(forbidden=FORBIDDEN)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["algo"] and result["torch"]  # the probe really imported the package
    assert result["hits"] == [], f"importing rlhf.algo imported {result['hits']}"
