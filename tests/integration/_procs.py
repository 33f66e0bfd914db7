"""Start a service as a real subprocess (``python -m services.cli serve NAME``) on free loopback ports.

::

    with ServiceProc("reward", config_path, tmp_path) as svc:   # waits for /readyz
        httpx.post(svc.http_url + "/v1/score", json=...)
        grpc.insecure_channel(svc.grpc_addr)

or use the ``start_service`` fixture of tests/integration/conftest.py, which stops every process it started.
ServiceProc is rlhf.procs's (its own process group: stopping it stops what it spawned too).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from rlhf.procs import REPO, ServiceProc  # noqa: F401  (tests import them from here)


def write_config(path: Path, data: dict) -> Path:
    """Write an experiment config YAML (a dict in the shape of rlhf.config.ExperimentConfig)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
