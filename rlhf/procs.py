"""Child processes: what ``rlhf up`` (services.launcher), the tests and the benchmarks start, wait for and stop.

Every child runs in its own session (process group) with its output in a log file; stopping a child signals its
whole group. :class:`Child` (any command; :func:`stop_children` stops several in order), :class:`ServiceProc`
(``python -m services.cli serve NAME`` on free loopback ports, ready on ``GET /readyz``), :class:`LocalRedis` (a
private redis-server). This module uses the standard library only: ``rlhf`` must not import ``services``.

Design: docs/running.md#stopping-restarts-and-resume.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


class LaunchError(RuntimeError):
    """A process did not start, or died before its time; the message includes the end of its log."""


# ------------------------------------------------------------ ports, logs, readiness


# Linux's default when /proc cannot be read; macOS and Windows use 49152-65535, which this also leaves alone.
_DEFAULT_EPHEMERAL = (32768, 65535)
_LOWEST_PORT = 10000


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return lo, hi


def free_ports(n: int, host: str = HOST) -> list[int]:
    """``n`` distinct TCP ports free on ``host`` right now (all sockets held open until all are chosen).

    They are drawn at random from outside the kernel's ephemeral range: a port handed to a child that binds it
    seconds later must not be taken meanwhile as the local port of some outgoing connection (a Redis or gRPC
    client's), which a port the kernel picked with ``bind(port 0)`` can be."""
    lo, hi = _ephemeral_range()
    pool = [p for p in (*range(_LOWEST_PORT, lo), *range(hi + 1, 65536)) if p >= 1024]
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for port in rng.sample(pool, min(len(pool), 64 * n)):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # the pool is small or crowded: take what the kernel gives
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = HOST) -> int:
    """A TCP port free on ``host`` right now. Two calls can return the same port: take several with free_ports."""
    return free_ports(1, host)[0]


def log_tail(path: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log ("" when there is none); only its last 64 KiB are read."""
    if path is None:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def http_ready(url: str, timeout: float = 1.0, context: ssl.SSLContext | None = None) -> bool:
    """``GET /readyz`` answers 200 (``context``: TLS settings for an ``https://`` URL). A certificate that does not
    verify raises LaunchError at once: retrying cannot fix it."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/readyz", timeout=timeout, context=context) as r:
            return r.status == 200
    except urllib.error.URLError as err:
        if isinstance(err.reason, ssl.SSLCertVerificationError):
            raise LaunchError(
                f"cannot verify the certificate of {url}: {err.reason.verify_message}; set RLHF_TLS_CA to the CA "
                "bundle that signed RLHF_TLS_CERT (and make the certificate name 127.0.0.1)"
            ) from None
        return False
    except (ConnectionError, TimeoutError, OSError, ValueError):
        return False


def redis_answers(port: int, timeout: float = 0.2, host: str = HOST) -> bool:
    """True when a Redis server on ``host:port`` answers PING (a server still loading its AOF answers LOADING)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# ------------------------------------------------------------ any child


@functools.cache
def _prctl() -> Callable[..., int] | None:
    # Looked up in the parent: between fork and exec the child must not load a library (a lock another thread of the
    # parent held at the fork would never be released).
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _die_with_parent() -> Callable[[], None] | None:
    """The hook that gives a child SIGTERM when its parent dies, or None. Only from the main thread: the kernel sends
    the signal when the *thread* that forked the child ends, so a child started from a worker thread (a redis-server
    restarted in ``asyncio.to_thread``) would die with that thread."""
    prctl = _prctl() if sys.platform.startswith("linux") else None
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None

    def hook() -> None:  # runs in the child between fork and exec
        with contextlib.suppress(Exception):
            prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG

    return hook


class Child:
    """A child process in its own process group, its output in ``log_path``: appended to, so that a restarted
    child's lives follow each other, or (``append=False``) begun afresh at each start; None: discarded. ``env``:
    the whole environment (None: this process's). Subclasses build their command line in the ``argv`` property."""

    tail_lines = 40  # log_tail's default
    stop_timeout = 20.0  # stop()'s default grace after SIGTERM

    def __init__(
        self,
        name: str,
        argv: Sequence[str] = (),
        log_path: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        *,
        append: bool = True,
    ):
        self.name = name
        self._argv = list(argv)
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.append = append
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        return self._argv

    def start(self) -> Child:
        argv = self.argv  # first: a subclass may refuse (a program not on PATH) before a log is opened
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab" if self.append else "wb")  # noqa: SIM115 - closed in stop()
        try:
            self.proc = subprocess.Popen(
                argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=self._log or subprocess.DEVNULL,
                stderr=subprocess.STDOUT if self._log else subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        except BaseException:
            self.close_log()
            raise
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the child alone (what it spawned is left to it), if it is running."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (the child and whatever it spawned)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(
        self,
        timeout: float | None = None,
        *,
        kill: bool = False,
        force: Callable[[], bool] = lambda: False,
        say: Callable[[str], None] = lambda s: None,
    ) -> int | None:
        """SIGTERM to the group, wait up to ``timeout`` (default ``stop_timeout``; cut short when ``force()`` turns
        true), then SIGKILL; ``kill``: SIGKILL at once. Also kills what is left of the group after the child exited.
        Returns the exit status (None: never started)."""
        if self.proc is None:
            return None
        timeout = self.stop_timeout if timeout is None else timeout
        if self.running and not kill:
            say(f"stopping {self.name} (pid {self.pid})")
            self.signal_group(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.running and time.monotonic() < deadline and not force():
                time.sleep(0.05)
            if self.running:
                say(f"{self.name} did not stop within {timeout:.0f}s: killing it")
        self.signal_group(signal.SIGKILL)  # the child if still alive, and any stragglers of its group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.close_log()
        return self.proc.returncode

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int | None = None) -> str:
        return log_tail(self.log_path, self.tail_lines if lines is None else lines)

    def __enter__(self) -> Child:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def stop_children(
    children: Iterable[Child],
    grace_s: float = 20.0,
    force: Callable[[], bool] = lambda: False,
    say: Callable[[str], None] = lambda s: None,
) -> None:
    """Stop ``children`` one by one in the given order (:meth:`Child.stop`)."""
    for child in children:
        child.stop(grace_s, force=force, say=say)


# ------------------------------------------------------------ a service


def service_env(overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with the repository on ``PYTHONPATH``, no model downloads, unbuffered output, and
    ``overrides`` over it (a value None unsets the variable)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for k, v in (overrides or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def serve_args(service: str, config: str | Path, grpc_port: int, http_port: int, host: str = HOST) -> list[str]:
    """The arguments after the Python interpreter that start a service: ``-m services.cli serve NAME ...``."""
    return [
        "-m",
        "services.cli",
        "serve",
        service,
        "--config",
        str(config),
        "--host",
        host,
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(http_port),
    ]


class ServiceProc(Child):
    """One service (``rlhf serve NAME``) for a test or a benchmark, on free loopback ports unless given, run from
    ``cwd`` (default: the repository), its log ``<log_dir>/<name>-<http_port>.log`` begun afresh at each start.
    ``env`` goes over this process's environment (:func:`service_env`). ``start()`` waits until ``GET /readyz``
    answers 200 (the process dying first raises LaunchError, a RuntimeError, with the end of its log) and stops the
    process when it does not get ready. ``with ServiceProc(...) as svc:`` starts (if not started) and stops it."""

    ready_timeout = 90.0

    def __init__(
        self,
        name: str,
        config: str | Path,
        log_dir: str | Path,
        *,
        env: Mapping[str, str | None] | None = None,
        grpc_port: int | None = None,
        http_port: int | None = None,
        extra_args: Sequence[str] | None = None,
        cwd: str | Path | None = None,
    ):
        self.config = str(config)
        # one free_ports(2): two free_port() calls can return the same port (the first is closed before the
        # second is chosen), and a service whose gRPC and HTTP ports are one cannot start
        picked = free_ports(2) if not (grpc_port and http_port) else []
        self.grpc_port = grpc_port or picked[0]
        self.http_port = http_port or picked[1]
        self.extra_args = list(extra_args or [])
        super().__init__(
            name,
            log_path=Path(log_dir) / f"{name}-{self.http_port}.log",
            env=service_env(env),
            cwd=Path(cwd) if cwd is not None else REPO,
            append=False,
        )

    @property
    def http_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def grpc_addr(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    @property
    def argv(self) -> list[str]:
        return [sys.executable, *serve_args(self.name, self.config, self.grpc_port, self.http_port), *self.extra_args]

    def start(self, timeout: float | None = None, wait_ready: bool = True) -> ServiceProc:
        super().start()
        if wait_ready:
            try:
                self.wait_ready(timeout)
            except BaseException:
                self.stop()
                raise
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until ``GET /readyz`` answers 200 (default ``ready_timeout``); TimeoutError after that."""
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (rc := self.poll()) is not None:
                raise LaunchError(f"{self.name} exited with {rc} during start-up:\n{self.log_tail()}")
            if http_ready(self.http_url, timeout=1):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")


# ------------------------------------------------------------ redis-server


class LocalRedis(Child):
    """A private redis-server bound to loopback: its own port (free unless given) and data ``directory``, AOF on
    (``appendfsync everysec``) as compose and the Helm chart run Redis, so a server restarted on the same directory
    and port comes back with its data. ``start()`` waits until it answers PING; ``stop(kill=True)`` is kill -9;
    ``start()`` again reuses the directory and port. ``extra_args`` (read at each start) go after the others, e.g.
    ``["--replicaof", "127.0.0.1", "6379"]``. ``log_path`` None: its output is discarded."""

    stop_timeout = 10.0

    def __init__(
        self,
        directory: str | Path,
        port: int | None = None,
        aof: bool = True,
        extra_args: list[str] | None = None,
        *,
        log_path: str | Path | None = None,
        exe: str | None = None,
    ):
        super().__init__("redis", log_path=log_path)
        self.directory = Path(directory)
        self.port = port or free_port()
        self.aof = aof
        self.extra_args = list(extra_args or [])
        self.exe = exe

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    @property
    def argv(self) -> list[str]:
        exe = self.exe or shutil.which("redis-server")
        if exe is None:
            raise LaunchError("redis-server is not on PATH (apt-get install -y redis-server)")
        return [
            exe,
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--dir",
            str(self.directory),
            "--appendonly",
            "yes" if self.aof else "no",
            "--appendfsync",
            "everysec",
            "--save",
            "",
            "--daemonize",
            "no",
            *self.extra_args,
        ]

    def start(self, timeout: float = 15.0) -> LocalRedis:
        self.directory.mkdir(parents=True, exist_ok=True)
        super().start()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop(kill=True)
            raise
        return self

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise LaunchError(f"redis-server exited with {self.poll()}:\n{self.log_tail()}")
            if redis_answers(self.port):
                return
            time.sleep(0.02)
        raise LaunchError(f"redis-server did not answer on port {self.port} within {timeout:.0f}s:\n{self.log_tail()}")
