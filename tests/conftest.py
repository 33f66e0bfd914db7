"""Fixtures shared by every test layer: free ports, a private redis-server, the tiny models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlhf.tiny import build_tiny
from tests.support.redis import RedisServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server per test."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """The rlhf.tiny policy and reward model, built once per session; RLHF_CACHE_DIR points at them."""
    cache = Path(os.environ.get("RLHF_TEST_CACHE", tmp_path_factory.mktemp("rlhf-cache")))
    os.environ["RLHF_CACHE_DIR"] = str(cache)
    return build_tiny(cache / "tiny")
