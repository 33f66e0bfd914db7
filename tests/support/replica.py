"""A rollout replica for weight-push tests and bench.device_check: the real rollout servicer (gRPC, and the TCP data
plane where asked) over a fake engine or the ``hf`` engine. Its servers bind port 0 and report the port the OS gave
them, so no port is picked before it is bound (the race cc7eb34 fixed for two-port services cannot happen here).

In this process::

    async with Replica(token) as r:             # a FakeEngine: keeps what it is sent
        await push_weights(r.addr, packed, token=token)
        r.engine.served.version, r.engine.tensors

    await engine.start()                        # a real engine (hf, vLLM) the test inspects
    async with Replica(token, engine, data_plane=True, close_engine=True) as r:
        r.servicer.receiver.busy, r.port        # the servicer's state, the data plane's port; then engine.close()

In a child process (to kill -9 or SIGSTOP it, or to give its model a process of its own)::

    proc, addr = start_child("--token", token, "--engine", "hf", "--model", model_dir, "--dump", path)
    proc.terminate()                            # SIGTERM: it stops (writing what it serves to --dump first)

The child is ``python -m tests.support.replica --token T [--engine fake|hf] [--model DIR] [--name N] [--device D]
[--dtype T] [--dump FILE]``: it prints ``ready <addr>`` once it serves. Nothing here imports pytest: bench.device_check
uses it on a GPU host that has no test dependencies.
"""

from __future__ import annotations

import argparse
import asyncio
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from safetensors.torch import save_file

from rlhf.procs import REPO, service_env
from rlhf.serving import ServiceMetrics, ServiceSettings
from rlhf.serving.runner import grpc_options
from rlhf.transport.weights import ServedVersion
from services.rollout.engine_types import SwapResult
from services.rollout.grpc_servicer import RolloutServicer, add_to_server

HOST = "127.0.0.1"


@dataclass
class FakeEngine:
    """The served version's owner and a swap that keeps the tensors; receives in this process (one rank)."""

    served: ServedVersion = field(default_factory=ServedVersion)
    model_name: str = "fake"
    tensors: dict | None = None
    history: list[int] = field(default_factory=list)  # every version swapped in, in order
    device_type: str = "cpu"  # the backends it can join: gloo only
    manifest: dict | None = None  # what updates must match (None: anything)

    @property
    def swaps(self) -> int:
        return len(self.history)

    def weight_manifest(self) -> dict | None:
        return self.manifest

    async def swap_weights(self, tensors, version, checksum, parent_version) -> SwapResult:
        self.served.advance(version, parent_version, checksum)
        self.tensors = tensors
        self.history.append(version)
        return SwapResult(version, checksum, True, wait_seconds=0.0, swap_seconds=0.001)


class Replica:
    """``async with Replica(token) as r``: ``engine`` (a new FakeEngine by default) behind the rollout servicer on
    ``r.addr`` (and its TCP data plane with ``data_plane``) until the block ends; with ``close_engine`` the block
    owns the (started) engine and closes it once the servers have stopped. The gRPC server has the rollout
    service's options (message sizes, keepalive)."""

    def __init__(self, token: str, engine: Any = None, *, data_plane: bool = False, close_engine: bool = False):
        self.engine = engine if engine is not None else FakeEngine()
        self.data_plane, self.close_engine = data_plane, close_engine
        self.settings = ServiceSettings(api_token=token)
        self.servicer = RolloutServicer(self.engine, self.settings, ServiceMetrics("rollout"))

    async def __aenter__(self) -> Replica:
        self.server = grpc.aio.server(options=grpc_options(self.settings))
        add_to_server(self.servicer, self.server)
        self.addr = f"{HOST}:{self.server.add_insecure_port(f'{HOST}:0')}"
        await self.server.start()
        if self.data_plane:
            await self.servicer.start_data_plane(HOST, 0)
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.servicer.close_data_plane()
            await self.server.stop(None)
        finally:
            if self.close_engine:
                await self.engine.close()

    @property
    def busy(self) -> bool:
        return self.servicer.receiver.busy

    @property
    def port(self) -> int:
        """The data plane's TCP port (with ``data_plane``)."""
        return self.servicer.data.port


# ------------------------------------------------------------------------------------------------ in a child process


def start_child(
    *args: str, stderr: Path | None = None, env: dict[str, str] | None = None, timeout: float = 120
) -> tuple[subprocess.Popen, str]:
    """Start ``python -m tests.support.replica ARGS`` from the repository (``env`` over :func:`rlhf.procs.service_env`;
    its stderr to the file ``stderr``, else this process's) and wait for it to serve: (the process, its gRPC
    address). A child that exits or says nothing within ``timeout`` is killed: RuntimeError."""
    cmd = [sys.executable, "-m", "tests.support.replica", *args]
    log = open(stderr, "wb") if stderr is not None else None  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(cmd, cwd=REPO, env=service_env(env), stdout=subprocess.PIPE, stderr=log, text=True)
    if log is not None:
        log.close()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if line.startswith("ready "):
                return proc, line.split()[1]
            if not line and proc.poll() is not None:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    where = f"; see {stderr.name}" if stderr is not None else ""
    raise RuntimeError(f"the replica did not start within {timeout:.0f}s (exit {proc.poll()}){where}")


def _dump(engine: Any, path: str) -> None:
    """The weights ``engine`` serves, and their version, as one safetensors file."""
    weights = {k: v.detach().contiguous().clone() for k, v in engine.model.state_dict().items()}
    save_file(weights, path, metadata={"version": str(engine.served.version)})


async def serve(args: argparse.Namespace) -> None:
    """The child's life: serve (gRPC and the data plane), print ``ready <addr>``, stop on SIGTERM."""
    if args.engine == "hf":
        from services.rollout.hf_engine import HFEngine  # noqa: PLC0415 - transformers: the hf child alone needs it

        engine = HFEngine(args.model, args.name, dtype=args.dtype, device=args.device)
        await engine.start()
    else:
        engine = FakeEngine(model_name=args.name)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with Replica(args.token, engine, data_plane=True, close_engine=args.engine == "hf") as replica:
        print(f"ready {replica.addr}", flush=True)
        await stop.wait()
        if args.dump:
            _dump(engine, args.dump)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="A rollout replica on free loopback ports; prints 'ready <addr>'.")
    ap.add_argument("--token", required=True, help="the API token pushes must carry")
    ap.add_argument("--engine", choices=("fake", "hf"), default="fake")
    ap.add_argument("--model", help="the hf engine's model folder")
    ap.add_argument("--name", default="replica", help="the model name it reports")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--dump", help="on SIGTERM, write the served weights and version here (safetensors; hf engine)")
    asyncio.run(serve(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
