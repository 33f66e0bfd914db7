"""The weight push of a sharded trainer group streams bucket by bucket (issue 10 item 5).

A real 2-process FSDP2 group (torch.distributed.run, gloo; tests/trainer/stream_worker.py) pushes to real replicas
(the rollout servicer over the ``hf`` engine with its data plane, tests/trainer/_hf_replica.py) over every
transport: the replica serves the group's policy bit for bit, the streamed bytes equal world 1's policy (bf16 cast
included), the push holds one bucket and one gathered tensor where ``pack_weights`` holds the whole policy, and a
replica killed -9 mid-push or a closed port fails alone while the other replica is updated and no rank hangs.
Below that, the streaming pieces on their own (rlhf.transport.weights: StreamedWeights, push_weights_streamed) with
in-process replicas.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rlhf.local_redis import free_port

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
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(HERE / "_hf_replica.py"), str(model), TOKEN, str(dump)], env=env,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    line = proc.stdout.readline()
    assert line.startswith("ready "), line
    return proc, line.split()[1]


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
        _run_worker(out, 2, "bf16=1", f"bucket={BUCKET}", f"token={TOKEN}", f"replica={addr}",
                    f"victim={victim_addr}", f"victim_pid={victim.pid}", f"dead=127.0.0.1:{free_port()}")  # fmt: skip
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
