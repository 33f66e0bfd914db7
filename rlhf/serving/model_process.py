"""A service's model in a process of its own: the forward runs beside the event loop instead of under its GIL.

With ``RLHF_MODEL_PROCESS`` (the default) a reward or reference service starts a child (``python -m
rlhf.serving.model_process``) that loads the model and runs each merged call; the service keeps the tokenizer,
validation and batching. Frames over the child's stdin/stdout (:func:`write_frame` / :func:`read_frame`: a length
prefix, a JSON header, raw bytes; never pickle). The child runs a handler named ``module:factory``:
``factory(init) -> handler``, ``handler.hello`` first, then one ``handler.call(header, payload) -> (header,
payload)`` per frame. :func:`forward_threads`: one torch thread fewer than the process was given, at least one.
Design and measurements: docs/services.md#reference (the model process, its threads; bench.serving).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
from typing import IO, Any, Protocol

from rlhf.serving import errors

log = logging.getLogger("rlhf.serving")

_PREFIX = struct.Struct("<IQ")  # header bytes, payload bytes


def forward_threads(requested: int | None = None) -> int:
    """Torch threads for a service's model forward: ``requested`` (``RLHF_MODEL_THREADS``), else one fewer than
    ``OMP_NUM_THREADS`` (else the cores this process may use), at least 1 (module docstring)."""
    if requested:
        return int(requested)
    given = os.environ.get("OMP_NUM_THREADS", "")
    n = int(given) if given.isdigit() and int(given) > 0 else len(os.sched_getaffinity(0))
    return max(1, n - 1)


def set_torch_threads(n: int | None) -> None:
    if n:
        import torch  # noqa: PLC0415 - services import this before torch may load

        torch.set_num_threads(int(n))


class Handler(Protocol):
    hello: dict

    def call(self, header: dict, payload: bytes) -> tuple[dict, bytes]: ...


def write_frame(out: IO[bytes], header: dict, payload: bytes = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    out.write(_PREFIX.pack(len(head), len(payload)))
    out.write(head)
    if payload:
        out.write(payload)
    out.flush()


def _read_exact(src: IO[bytes], n: int) -> bytes:
    buf = src.read(n) if n else b""
    if len(buf) != n:
        raise EOFError(f"stream ended after {len(buf)} of {n} bytes")
    return buf


def read_frame(src: IO[bytes]) -> tuple[dict, bytes]:
    hlen, plen = _PREFIX.unpack(_read_exact(src, _PREFIX.size))
    return json.loads(_read_exact(src, hlen)), _read_exact(src, plen)


class ModelProcess:
    """The parent's side: ``start()`` spawns the child and returns its hello; ``call(header, payload)`` runs one
    request on it (blocking, one at a time: call it from a worker thread); ``close()`` ends it."""

    def __init__(
        self,
        target: str,
        init: dict,
        name: str,
        error_classes: dict[str, type] | None = None,
        threads: int | None = None,
    ):
        self.target = target
        self.init = init
        self.name = name
        self.threads = threads  # torch threads in the child (None: torch's default there)
        self.error_classes = error_classes or {}
        self.hello: dict = {}
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> dict:
        with self._lock:
            return self._start()

    def _start(self) -> dict:
        # stderr is the service's own: the child's log lines and tracebacks land in the service log
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlhf.serving.model_process"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        try:
            write_frame(proc.stdin, {"target": self.target, "init": self.init, "threads": self.threads})
            head, _ = read_frame(proc.stdout)
        except (EOFError, OSError):
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"{self.name}: the model process exited with code {proc.returncode} while loading"
            ) from None
        if "error" in head:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{self.name}: the model process could not load the model: {head['error']['message']}")
        self._proc, self.hello = proc, head["hello"]
        log.info("%s: model process %d ready", self.name, proc.pid)
        return self.hello

    def call(self, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()  # the last one died: its calls failed; this one gets a new child
            proc = self._proc
            try:
                write_frame(proc.stdin, header, payload)
                head, out = read_frame(proc.stdout)
            except (EOFError, OSError):
                code = proc.wait()
                self._proc = None
                raise errors.Internal(
                    f"{self.name}: the model process exited (code {code}) during this call; nothing was returned "
                    "(its log is in this service's log); the next call starts a new one"
                ) from None
        if "error" in head:
            e = head["error"]
            cls = self.error_classes.get(e["type"]) or getattr(errors, e["type"], None)
            if not (isinstance(cls, type) and issubclass(cls, errors.RLHFError)):
                cls = errors.Internal
            raise cls(e["message"], e.get("field"))
        return head, out

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # the child exits at the end of its input
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


def _serve(frames_in: IO[bytes], frames_out: IO[bytes]) -> None:
    """The child's loop: the init frame builds the handler, then one reply per request frame until end of input."""
    first, _ = read_frame(frames_in)
    try:
        set_torch_threads(first.get("threads"))
        module, factory = first["target"].split(":", 1)
        handler: Handler = getattr(importlib.import_module(module), factory)(first["init"])
    except Exception as err:  # reported to the parent, which refuses to start
        log.exception("model process: loading failed")
        write_frame(frames_out, {"error": {"type": type(err).__name__, "message": str(err)}})
        return
    write_frame(frames_out, {"hello": handler.hello})
    while True:
        try:
            header, payload = read_frame(frames_in)
        except EOFError:
            return
        try:
            head, out = handler.call(header, payload)
        except Exception as err:  # every failure goes back to the caller of this request
            if not isinstance(err, errors.RLHFError):
                log.exception("model process: a call failed")
            e: dict[str, Any] = {"type": type(err).__name__, "message": str(err)}
            if isinstance(err, errors.RLHFError):
                e["field"] = err.field
            head, out = {"error": e}, b""
        write_frame(frames_out, head, out)


def main() -> None:
    # The child ends when its input does (the service closed it or died). A Ctrl-C or a SIGTERM sent to the whole
    # process group must not kill it while the service drains its in-flight requests (RLHF_SHUTDOWN_GRACE_S).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Frames own the real stdout; anything a library prints goes to stderr instead of into the protocol.
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [model process] %(message)s")
    _serve(sys.stdin.buffer, frames_out)


if __name__ == "__main__":
    main()
