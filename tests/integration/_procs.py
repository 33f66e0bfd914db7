"""Start a service as a real subprocess (``python -m services.cli serve NAME``) on free loopback ports.

::

    with ServiceProc("reward", config_path, tmp_path) as svc:   # waits for /readyz
        httpx.post(svc.http_url + "/v1/score", json=...)
        grpc.insecure_channel(svc.grpc_addr)

or use the ``start_service`` fixture of tests/integration/conftest.py, which stops every process it started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rlhf.local_redis import free_port as _free_port  # noqa: F401  (tests import it from here)
from services.launcher import http_ready

REPO = Path(__file__).resolve().parents[2]


def write_config(path: Path, data: dict) -> Path:
    """Write an experiment config YAML (a dict in the shape of rlhf.config.ExperimentConfig)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


class ServiceProc:
    """One service process. ``start()`` waits until ``GET /readyz`` answers 200 (or the process dies: then it raises
    with the end of the log)."""

    def __init__(
        self,
        name: str,
        config: str | Path,
        log_dir: str | Path,
        *,
        env: dict[str, str] | None = None,
        grpc_port: int | None = None,
        http_port: int | None = None,
        extra_args: list[str] | None = None,
        cwd: str | Path | None = None,
    ):
        self.name = name
        self.cwd = Path(cwd) if cwd is not None else REPO
        self.config = str(config)
        self.grpc_port = grpc_port or _free_port()
        self.http_port = http_port or _free_port()
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_dir) / f"{name}-{self.http_port}.log"
        self.env = dict(os.environ)
        self.env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), self.env.get("PYTHONPATH")]))
        self.env.update(env or {})
        self.proc: subprocess.Popen | None = None
        self._log = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "services.cli", "serve", self.name, "--config", self.config,
                "--host", "127.0.0.1", "--grpc-port", str(self.grpc_port), "--http-port", str(self.http_port),
                *self.extra_args]  # fmt: skip

    def start(self, timeout: float = 90.0, wait_ready: bool = True) -> ServiceProc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.argv, cwd=self.cwd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"{self.name} exited with {code} during start-up:\n{self.log_tail()}")
            if http_ready(self.http_url, timeout=1):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def __enter__(self) -> ServiceProc:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
