"""The weight push of a sharded trainer group streams bucket by bucket (issue 10 item 5).

A real 2-process FSDP2 group (torch.distributed.run, gloo; tests/trainer/stream_worker.py) pushes to real replicas
(the rollout servicer over the ``hf`` engine with its data plane, in processes of their own: tests/support/replica.py)
over every transport: the replica serves the group's policy bit for bit, the streamed bytes equal world 1's policy
(bf16 cast included), the push holds one bucket and one gathered tensor where ``pack_weights`` holds the whole policy,
and a replica killed -9 mid-push or a closed port fails alone while the other replica is updated and no rank hangs.
Below that, the streaming pieces on their own (rlhf.transport.weights: StreamedWeights, push_weights_streamed) with
in-process replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tracemalloc
import weakref
from pathlib import Path

import grpc
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlhf.procs import free_port
from rlhf.transport.weights import (
    StreamedWeights,
    check_header,
    load_safetensors,
    pack_weights,
    push_weights_streamed,
)
from tests.support.replica import Replica, start_child

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TOKEN = "stream-token"
BUCKET = 16 << 10  # much smaller than the tiny policy (~0.5 MiB): many buckets


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(_bits(got[k]), _bits(want[k])), k


# ------------------------------------------------------------------------------------------ a real trainer group


def _start_replica(model: Path, dump: Path) -> tuple[subprocess.Popen, str]:
    """The ``hf`` engine on ``model`` in a process of its own; on SIGTERM it writes what it serves to ``dump``."""
    args = ("--token", TOKEN, "--engine", "hf", "--model", str(model), "--dump", str(dump))
    return start_child(*args, env={"OMP_NUM_THREADS": "1"})


def _run_worker(out: Path, procs: int, *options: str) -> None:
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    worker = [str(HERE / "stream_worker.py"), str(out), *options]
    run = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"] if procs > 1 else []
    cmd = [sys.executable, *run, *worker]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def group_run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("stream")
    _run_worker(out, 1, "bf16=1")
    replica, addr = _start_replica(tiny_models.policy, out / "replica.safetensors")
    victim, victim_addr = _start_replica(tiny_models.policy, out / "victim.safetensors")
    try:
        _run_worker(
            out,
            2,
            "bf16=1",
            f"bucket={BUCKET}",
            f"token={TOKEN}",
            f"replica={addr}",
            f"victim={victim_addr}",
            f"victim_pid={victim.pid}",
            f"dead=127.0.0.1:{free_port()}",
        )
        replica.terminate()  # it writes what it serves
        assert replica.wait(60) == 0
    finally:
        for p in (replica, victim):
            if p.poll() is None:
                p.kill()
                p.wait()
    return out, json.loads((out / "report.json").read_text()), addr, victim_addr


def test_group_streams_world_1s_policy_bit_for_bit(group_run):
    out, report, _, _ = group_run
    m = report["measure"]
    assert m["digests_equal"], "the two passes made different bytes"
    assert m["gathers_per_pass"] == m["tensors"]  # one gather command per pass, every parameter once
    streamed = load_file(out / "streamed.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in streamed.values())  # training.bf16: pushed as bf16
    _assert_bit_equal(streamed, load_file(out / "world1.safetensors"))


def test_group_push_holds_one_bucket_where_pack_holds_the_policy(group_run):
    m = group_run[1]["measure"]
    assert m["buckets"] >= 10 and m["buffer_bytes"] == m["largest_bucket"] <= m["total_bytes"] / 3, m
    # gathered tensors alive at once: one (a push that gathered the whole policy first would hold them all)
    assert m["stream_max_live_gathered"] <= m["largest_gathered"] < m["gathered_total"] / 3, m
    # the Python heap: the bucket buffer and one gathered tensor (the gather's own transient copy), plus small
    # objects; today's pack holds every serialised bucket
    assert m["stream_heap_peak"] <= m["buffer_bytes"] + m["largest_gathered"] + (64 << 10) < m["total_bytes"], m
    assert m["pack_heap_peak"] >= m["pack_total_bytes"], m


def test_group_push_reaches_a_replica_over_every_transport(group_run):
    out, report, addr, _ = group_run
    for transport in ("grpc", "collective", "tcp", "auto"):
        r = report[transport]
        assert r["results"][addr] == {"version": r["version"], "checksum": r["checksum"], "swapped": True}, transport
    # the replica's weights after the last push: the group's policy, bit for bit (bf16 sent, the engine's fp32)
    with safe_open(str(out / "replica.safetensors"), "pt") as f:
        assert int(f.metadata()["version"]) == report["auto"]["version"]
    served, pushed = load_file(out / "replica.safetensors"), load_file(out / "pushed.safetensors")
    _assert_bit_equal(served, {k: v.to(served[k].dtype) for k, v in pushed.items()})


def test_a_replica_failing_mid_push_drops_out_alone(group_run):
    """tcp to the replica and a victim killed -9 half-way through the bytes; auto to the replica and a closed port.
    The other replica gets each update; the worker (both ranks) exited 0, so no follower hung in a gather."""
    _, report, addr, victim = group_run
    tcp, auto = report["tcp"], report["auto"]
    assert "error" in tcp["results"][victim] and tcp["results"][addr]["version"] == tcp["version"]
    assert "error" in next(v for k, v in auto["results"].items() if k != addr)
    assert auto["results"][addr]["version"] == auto["version"]
    n = report["measure"]["tensors"]
    assert tcp["gathers"] == auto["gathers"] == 2 * n  # both passes ran to the end on rank 0, as on the followers


# ------------------------------------------------------------------------------------------ the streaming pieces


def _state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(64, 32, generator=g)
    return {
        "embed": embed,
        "half": torch.randn(40, 32, generator=g).to(torch.float16),
        "bf16": torch.randn(128, 32, generator=g).to(torch.bfloat16),
        "transposed": torch.randn(16, 8, generator=g).t(),  # not contiguous
        "big": torch.randn(300, 100, generator=g),  # larger than a bucket
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(10, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "tied": embed,
    }


class Source:
    """Yields a state dict one fresh copy at a time (like a gather), counting passes, tensors and the copies alive."""

    def __init__(self, sd: dict[str, torch.Tensor]):
        self.sd, self.passes, self.yielded, self.live, self.max_live, self.drained = sd, 0, 0, 0, 0, 0

    def specs(self):
        return [(k, v.dtype, tuple(v.shape)) for k, v in self.sd.items()]

    def __call__(self):
        self.passes += 1
        n = 0
        try:
            for k, v in self.sd.items():
                t = v.clone()
                self.live += 1
                self.max_live = max(self.max_live, self.live)
                weakref.finalize(t, self._freed)
                n += 1
                yield k, t
                del t
        finally:  # as the trainer's gather pass: every tensor, even when closed early
            self.yielded += len(self.sd)
            self.drained = len(self.sd) - n

    def _freed(self):
        self.live -= 1


def test_streamed_buckets_parse_hash_alike_and_equal_the_source():
    sd = _state_dict()
    src = Source(sd)
    stream = StreamedWeights(src.specs(), src, 3, bucket_bytes=8 << 10)
    header = stream.seal()
    assert check_header(header, 2, None, None, None)  # what every receiver checks first
    got, digests = {}, []
    for b in stream.buckets():
        digests.append(hashlib.sha256(b).hexdigest())
        got.update({k: v.clone() for k, v in load_safetensors(bytes(b)).items()})
    assert digests == [b.sha256 for b in header.buckets] and len(digests) >= 5
    _assert_bit_equal(got, {k: v.contiguous() for k, v in sd.items()})
    assert src.passes == 2 and src.max_live == 1  # one tensor at a time, never the whole state dict


def test_packed_and_streamed_weights_are_the_same_bytes():
    """pack_weights and the streamed packer lay buckets out alike (one computed layout, each tensor copied once), so
    one state dict gives one checksum whichever way a trainer pushes it, and a safetensors reader loads it."""
    sd = _state_dict()
    src = Source(sd)
    stream = StreamedWeights(src.specs(), src, 3, bucket_bytes=8 << 10)
    header = stream.seal()
    packed = pack_weights(sd, 3, bucket_bytes=8 << 10)
    assert packed.header == header and len(packed.buckets) >= 5
    assert [bytes(b) for b in packed.buckets] == [bytes(b) for b in stream.buckets()]
    got = {}
    for b in packed.buckets:
        got.update({k: v.clone() for k, v in load_safetensors(bytes(b)).items()})
    _assert_bit_equal(got, {k: v.contiguous() for k, v in sd.items()})


def test_the_streamed_packer_holds_one_bucket_where_pack_weights_holds_all():
    sd = {f"layer.{i}": torch.randn(64, 256) for i in range(16)}  # 64 KiB each, 1 MiB in all
    src = Source(sd)
    stream = StreamedWeights(src.specs(), src, 1, bucket_bytes=128 << 10)
    tracemalloc.start()
    stream.seal()
    for _ in stream.buckets():
        pass
    streamed = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    packed = pack_weights(sd, 1, bucket_bytes=128 << 10)
    whole = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert stream.buffer_bytes < (129 << 10) and len(stream.header.buckets) == 8
    assert streamed <= stream.buffer_bytes + (32 << 10), streamed
    assert whole >= packed.total_bytes >= 8 * stream.buffer_bytes - (8 << 10)
    assert src.max_live == 1


def test_a_source_that_disagrees_with_its_specs_or_diverged_is_refused_before_any_replica():
    sd = _state_dict()
    src = Source(sd)
    specs = src.specs()
    with pytest.raises(ValueError, match="yielded 'embed' where its specs list 'half'"):
        StreamedWeights(specs[1:2] + specs[:1] + specs[2:], src, 1).seal()
    wrong = [(k, torch.float32 if k == "bf16" else dt, sh) for k, dt, sh in specs]
    with pytest.raises(ValueError, match="tensor 'bf16'"):
        StreamedWeights(wrong, src, 1).seal()
    nan = Source({**sd, "big": torch.full((300, 100), float("nan"))})
    with pytest.raises(ValueError, match="'big' has NaN"):
        asyncio.run(push_weights_streamed([f"127.0.0.1:{free_port()}"], StreamedWeights(nan.specs(), nan, 1)))
    with pytest.raises(RuntimeError, match="seal"):
        StreamedWeights(specs, src, 1).buckets()


@pytest.mark.parametrize("transport", ["tcp", "grpc", "auto"])
def test_one_producer_feeds_every_replica_and_a_dead_one_holds_no_one_back(transport):
    sd = _state_dict()

    async def main():
        async with contextlib.AsyncExitStack() as stack:
            replicas = [
                await stack.enter_async_context(Replica(TOKEN, data_plane=transport != "grpc")) for _ in range(2)
            ]
            dead = f"127.0.0.1:{free_port()}"  # picked after the replicas bound theirs
            targets = [replicas[0].addr, dead, replicas[1].addr]
            src = Source(sd)
            stream = StreamedWeights(src.specs(), src, 1, bucket_bytes=8 << 10)
            out = await push_weights_streamed(
                targets, stream, token=TOKEN, timeout=30, transport=transport, chunk_bytes=4096
            )
            assert isinstance(out[dead], grpc.aio.AioRpcError)
            for engine in (r.engine for r in replicas):
                assert engine.served.version == 1 and engine.served.checksum == stream.checksum
                _assert_bit_equal(engine.tensors, {k: v.contiguous() for k, v in sd.items()})
            assert src.passes == 2 and src.max_live == 1  # each bucket made once for both replicas
            # nobody left to send to: the second pass still runs to its end (a trainer group's followers gather)
            src2 = Source(sd)
            stream2 = StreamedWeights(src2.specs(), src2, 2, bucket_bytes=8 << 10)
            out = await push_weights_streamed([dead], stream2, token=TOKEN, timeout=30, transport=transport)
            assert isinstance(out[dead], Exception) and src2.passes == 2 and src2.drained > 0

    asyncio.run(main())
