"""An in-process weight-sync replica for the collective push tests: the real rollout servicer (gRPC on a free
loopback port) over a fake engine that owns the served version and keeps what it is sent."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from rlhf.serving import ServiceMetrics, ServiceSettings
from rlhf.transport.weights import ServedVersion
from services.rollout.engine_types import SwapResult
from services.rollout.grpc_servicer import RolloutServicer, add_to_server


@dataclass
class FakeEngine:
    """The served version's owner and a swap that keeps the tensors; receives in this process (one rank)."""

    served: ServedVersion = field(default_factory=ServedVersion)
    model_name: str = "fake"
    tensors: dict | None = None
    history: list[int] = field(default_factory=list)  # every version swapped in, in order
    device_type: str = "cpu"  # the backends it can join: gloo only

    def weight_manifest(self) -> None:
        return None

    async def swap_weights(self, tensors, version, checksum, parent_version) -> SwapResult:
        self.served.advance(version, parent_version, checksum)
        self.tensors = tensors
        self.history.append(version)
        return SwapResult(version, checksum, True, wait_seconds=0.0, swap_seconds=0.001)


class Replica:
    """``async with Replica(token) as r``: serving on ``r.addr`` until the block ends."""

    def __init__(self, token: str, engine: FakeEngine | None = None):
        self.engine = engine or FakeEngine()
        self.servicer = RolloutServicer(self.engine, ServiceSettings(api_token=token), ServiceMetrics("rollout"))

    async def __aenter__(self) -> Replica:
        self.server = grpc.aio.server()
        add_to_server(self.servicer, self.server)
        self.addr = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.servicer.close_data_plane()
        await self.server.stop(None)

    @property
    def busy(self) -> bool:
        return self.servicer.receiver.busy
