"""A private ``redis-server`` process on a free loopback port: what tests, benchmarks and examples run against.

AOF is on (``appendfsync everysec``) as compose and the Helm chart run Redis, so a server restarted on the same
directory and port comes back with its data. ``rlhf up`` has its own variant with a log file (services.launcher).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_answers(port: int, timeout: float = 0.2) -> bool:
    """True when a Redis server on 127.0.0.1:port answers PING (a server still loading its AOF answers LOADING)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class LocalRedis:
    """``LocalRedis(dir).start()`` ... ``.stop()``, or ``with LocalRedis(dir) as r:``. ``stop(kill=True)`` is kill -9;
    ``start()`` again on the same object reuses the directory and port."""

    def __init__(self, directory: str | Path, port: int | None = None, aof: bool = True):
        self.directory = Path(directory)
        self.port = port or free_port()
        self.aof = aof
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> LocalRedis:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not on PATH (apt-get install -y redis-server)")
        self.directory.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
             "--appendonly", "yes" if self.aof else "no", "--appendfsync", "everysec", "--save", "",
             "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if redis_answers(self.port):
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        self.stop(kill=True)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
