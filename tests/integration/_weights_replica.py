"""A weight-sync replica in its own process (for kill -9 tests): the rollout servicer over a fake engine on a free
loopback port. Prints ``ready <addr>`` once it serves. Usage: ``python _weights_replica.py TOKEN``."""

from __future__ import annotations

import asyncio
import sys

import grpc

from rlhf.serving import ServiceMetrics, ServiceSettings
from rlhf.transport.weights import ServedVersion
from services.rollout.engine_types import SwapResult
from services.rollout.grpc_servicer import RolloutServicer, add_to_server


class Engine:
    def __init__(self) -> None:
        self.served = ServedVersion()
        self.model_name = "child"
        self.device_type = "cpu"  # the collective backends it can join: gloo only

    def weight_manifest(self) -> None:
        return None

    async def swap_weights(self, tensors, version, checksum, parent_version) -> SwapResult:
        self.served.advance(version, parent_version, checksum)
        return SwapResult(version, checksum, True, wait_seconds=0.0, swap_seconds=0.0)


async def main(token: str) -> None:
    servicer = RolloutServicer(Engine(), ServiceSettings(api_token=token), ServiceMetrics("rollout"))
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(f"ready 127.0.0.1:{port}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
