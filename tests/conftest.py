"""Fixtures shared by every test layer: free ports, a private redis-server, the tiny models."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rlhf.procs import LocalRedis

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class RedisServer(LocalRedis):
    """A redis-server owned by the test: own port, own directory, AOF on (so restarts keep data)."""

    def start(self, timeout: float = 10.0) -> RedisServer:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not on PATH (apt-get install -y redis-server)")
        super().start(timeout)
        return self


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server per test."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """The rlhf.tiny policy and reward model, built once per session; RLHF_CACHE_DIR points at them."""
    from rlhf.tiny import build_tiny

    cache = Path(os.environ.get("RLHF_TEST_CACHE", tmp_path_factory.mktemp("rlhf-cache")))
    os.environ["RLHF_CACHE_DIR"] = str(cache)
    return build_tiny(cache / "tiny")
