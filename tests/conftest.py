"""Fixtures shared by every test layer: free ports, a private redis-server, the tiny models."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server owned by the test: own port, own directory, AOF on (so restarts keep data)."""

    def __init__(self, directory: Path, port: int | None = None):
        self.directory = directory
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not on PATH (apt-get install -y redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=10)


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
