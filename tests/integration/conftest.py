"""Integration fixtures: services as real subprocesses on free loopback ports (see _procs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _procs import ServiceProc, write_config  # noqa: E402


@pytest.fixture
def start_service(tmp_path, tiny_models):
    """``start_service(name, config_dict_or_path, **kw) -> ServiceProc`` (ready); all are stopped at the end.

    A dict config is written to tmp_path. ``kw`` goes to ServiceProc (env, extra_args, grpc_port, http_port) plus
    ``wait_ready`` and ``timeout`` for start().
    """
    started: list[ServiceProc] = []

    def _start(name: str, config, *, wait_ready: bool = True, timeout: float = 90.0, **kw) -> ServiceProc:
        if isinstance(config, dict):
            config = write_config(tmp_path / f"{name}-{len(started)}.yaml", config)
        proc = ServiceProc(name, config, tmp_path / "logs", **kw)
        started.append(proc)
        return proc.start(timeout=timeout, wait_ready=wait_ready)

    yield _start
    for proc in reversed(started):
        proc.stop()
