"""The receiving end of bench.weight_sync's baselines, run as its own process (``python -m bench._sink``).

- ``--raw-port``: plain TCP. ``8-byte length`` then that many bytes, received into a preallocated buffer
  (``recv_into``; with ``--raw-buffer-bytes`` one of at most that size, reused round and round); answers ``b"K"``.
  The physical limit: one loopback stream, one copy.
- ``--grpc-port``: a ``RolloutService`` whose ``UpdateWeights`` reads every chunk and keeps nothing, with the
  services' gRPC options and the rollout service's request decoder
  (``rlhf.transport.weights.format.decode_update``): the ceiling of the same ``push_weights`` stream in Python gRPC,
  without copying, verification or swap.

Prints ``READY`` when both listen.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading

import grpc

from rlhf.serving import ServiceSettings, grpc_options
from rlhf.transport.weights import RawChunk
from rlhf.v1 import rollout_pb2_grpc, weights_pb2
from services.rollout.grpc_servicer import add_to_server


def raw_server(sock: socket.socket, cap: int = 0) -> None:
    """``cap`` > 0: receive into a buffer of at most ``cap`` bytes, reused round and round (bench.weight_sync
    --large: a multi-GB update that no side holds twice), else into one buffer of the whole length."""
    sink = bytearray()
    while True:
        conn, _ = sock.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                continue
            n = int.from_bytes(head, "little")
            size = min(n, cap) if cap > 0 else n
            if len(sink) != size:
                sink = bytearray(size)
            view = memoryview(sink)
            got = 0
            while got < n:
                at = got % size
                k = conn.recv_into(view[at:], min(n - got, size - at, 4 << 20))
                if k == 0:
                    break
                got += k
            conn.sendall(b"K")


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--raw-port", type=int, required=True)
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--raw-buffer-bytes", type=int, default=0, help="receive raw data into a reused buffer this big")
    args = p.parse_args()

    class Sink(rollout_pb2_grpc.RolloutServiceServicer):
        async def UpdateWeights(self, request_iterator, context):
            n = 0
            async for m in request_iterator:
                n += len(m.data) if isinstance(m, RawChunk) else len(m.chunk.data)
            return weights_pb2.UpdateWeightsResponse(bytes_received=n)

    server = grpc.aio.server(options=grpc_options(ServiceSettings()))
    add_to_server(Sink(), server)  # as the rollout service registers it
    server.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
    await server.start()
    sock = socket.create_server(("127.0.0.1", args.raw_port))
    threading.Thread(target=raw_server, args=(sock, args.raw_buffer_bytes), daemon=True).start()
    print("READY", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(main())
