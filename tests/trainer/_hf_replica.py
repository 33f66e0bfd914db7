"""A rollout replica in its own process for the trainer group's push tests (tests/trainer/test_stream_push.py): the
rollout servicer over the ``hf`` engine with the TCP data plane, on free loopback ports. Prints ``ready <addr>``
once it serves; on SIGTERM writes the weights it serves (and their version) to DUMP as safetensors and exits.
Usage: ``python _hf_replica.py MODEL_DIR TOKEN DUMP``."""

from __future__ import annotations

import asyncio
import signal
import sys

import grpc
from safetensors.torch import save_file

from rlhf.serving import ServiceMetrics, ServiceSettings
from services.rollout.grpc_servicer import RolloutServicer, add_to_server
from services.rollout.hf_engine import HFEngine


async def main(model: str, token: str, dump: str) -> None:
    engine = HFEngine(model, "tiny:policy", device="cpu")
    await engine.start()
    servicer = RolloutServicer(engine, ServiceSettings(api_token=token), ServiceMetrics("rollout"))
    server = grpc.aio.server()
    add_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.start_data_plane("127.0.0.1", 0)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(f"ready 127.0.0.1:{port}", flush=True)
    await stop.wait()
    weights = {k: v.detach().contiguous().clone() for k, v in engine.model.state_dict().items()}
    save_file(weights, dump, metadata={"version": str(engine.served.version)})
    await servicer.close_data_plane()
    await server.stop(None)
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
