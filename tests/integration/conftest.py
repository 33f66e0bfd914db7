"""Integration fixtures: services as real subprocesses on free loopback ports (see _procs.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration._procs import REPO, ServiceProc, write_config

# Services several test modules (and the docs/services.md examples) use with the same config: started once per
# session, all together on first use (their start-up is mostly imports, which overlap well), stopped at the end of the
# session.
SHARED_SERVICES = (
    ("reward", "configs/demo.yaml"),
    ("reward", "configs/reward-tiny-model.yaml"),
    ("reference", "configs/demo.yaml"),
)
# Small limits so the oversize tests stay cheap; the docs/services.md examples are far below them.
SHARED_ENV = {"RLHF_MAX_BODY_BYTES": "300000", "RLHF_MAX_MESSAGE_BYTES": str(1 << 20)}


class SharedServices:
    shared = SHARED_SERVICES  # tests read it here: `from conftest import ...` may find another directory's conftest

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[tuple[str, str], ServiceProc] = {}

    def get(self, name: str, config: str, timeout: float = 120.0) -> ServiceProc:
        """The running (ready) service for ``(name, config)``; ``config`` relative to the repository root."""
        key = (name, config)
        if key not in SHARED_SERVICES:
            raise KeyError(f"{key} is not in SHARED_SERVICES (tests/integration/conftest.py)")
        if not self.procs:
            for n, c in SHARED_SERVICES:
                self.procs[(n, c)] = ServiceProc(n, REPO / c, self.log_dir, env=SHARED_ENV).start(wait_ready=False)
        proc = self.procs[key]
        proc.wait_ready(timeout)
        return proc

    def stop(self) -> None:
        for p in self.procs.values():
            p.stop()


@pytest.fixture(scope="session")
def shared_services(tiny_models, tmp_path_factory):
    """``shared_services.get(name, config) -> ServiceProc`` for the services in SHARED_SERVICES."""
    pool = SharedServices(tmp_path_factory.mktemp("shared-services"))
    yield pool
    pool.stop()


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
