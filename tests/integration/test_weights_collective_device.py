"""Collective pushes whose buckets stay on the accelerator (issue 27 item 7, ACCELERATOR-REVIEW D4).

Over nccl/hccl a single-process trainer packs its buckets on its device (``copy_weights(device=...)``) and sends
each with a device digest instead of its sha256; the replica checks the digest where the bucket landed and installs
views of the received buffer. Before, both sides staged every bucket through pageable host memory: the trainer
copied GPU -> host bucket -> GPU, the replica GPU -> host (for the sha256) -> GPU (the install).

No GPU here: the "device" is the CPU and the group is gloo, which runs the same code path (the device branch is
chosen by the digest, not the device type). What it shows: the digest is the documented arithmetic and catches
changed, moved or missing bytes; device-packed buckets carry device digests and go by broadcast only; a replica
receives them without computing any sha256 and installs tensors that are views of the received bucket, bit exact;
a bucket whose bytes differ from its digest is refused and the replica keeps its version; the header paths that
are not collective refuse device digests.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from functools import partial
from types import SimpleNamespace

import grpc
import pytest
import torch

import rlhf.transport.weights.checksum as checksum
import rlhf.transport.weights.collective as collective
import rlhf.transport.weights.verify as verify
from rlhf.serving import ServiceSettings
from rlhf.transport.weights import CorruptUpdate, check_header, copy_weights, push_weights, push_weights_many
from services.trainer.fleet import Fleet
from tests.support.replica import Replica as _Replica

TOKEN = "device-token"
Replica = partial(_Replica, TOKEN)
CPU = torch.device("cpu")


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 64, generator=g),
        "layer.0.weight": torch.randn(63, 65, generator=g).to(torch.bfloat16),  # odd sizes: alignment, odd bytes
        "norm.weight": torch.randn(7, generator=g).to(torch.float16),
        "big": torch.randn(300, 300, generator=g),
        "step": torch.tensor(seed),
    }


def device_pack(version: int, seed: int | None = None):
    sd = state_dict(version if seed is None else seed)
    return copy_weights(sd, version, version - 1, bucket_bytes=64 << 10, device=CPU).seal()


def assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), k


def reference_digest(data: bytes) -> str:
    """The module docstring's definition, in plain Python."""
    p = (1 << 31) - 1
    padded = data + b"\0" * (len(data) % 2)
    words = [padded[i] + 256 * padded[i + 1] for i in range(0, len(padded), 2)]
    lanes = [sum(w * ((a * i + b) % (p - 1) + 1) for i, w in enumerate(words)) % p for a, b in checksum._LANES]
    return f"wsum1:{len(data):x}:{lanes[0]:08x}{lanes[1]:08x}"


def digest(data: bytes) -> str:
    return checksum.device_digest(torch.frombuffer(bytearray(data), dtype=torch.uint8))


# ----------------------------------------------------------------------------------------------------- the digest


def test_the_device_digest_is_the_documented_arithmetic_across_chunk_boundaries(monkeypatch):
    monkeypatch.setattr(checksum, "_CHUNK", 5)  # words per pass: every length below crosses several passes
    rng = random.Random(0)
    for n in (1, 2, 9, 10, 11, 64, 257):
        data = bytes(rng.randrange(256) for _ in range(n))
        assert digest(data) == reference_digest(data), n
        assert checksum.is_device_digest(digest(data))


def test_the_device_digest_catches_a_changed_moved_or_missing_byte():
    rng = random.Random(1)
    data = bytearray(rng.randrange(256) for _ in range(4096))
    base = digest(bytes(data))
    flipped = bytearray(data)
    flipped[1234] ^= 0x01
    swapped = bytearray(data)
    swapped[10:12], swapped[3000:3002] = data[3000:3002], data[10:12]
    assert data[10:12] != data[3000:3002]
    zeros = bytearray(4096)
    for other in (bytes(flipped), bytes(swapped), bytes(data[:-1]), bytes(data) + b"\0"):
        assert digest(other) != base
    assert digest(bytes(zeros)) != digest(bytes(zeros[:-2]))  # the length is part of it: all-zero words add nothing
    assert not checksum.is_device_digest("0" * 64) and not checksum.is_device_digest("wsum1:10:xyz")


# ------------------------------------------------------------------------------------------------- the trainer


def test_buckets_packed_on_a_device_carry_device_digests_and_go_by_broadcast_only():
    packed = device_pack(1)
    assert packed.on_device and len(packed.buckets) > 1
    for b, data in zip(packed.header.buckets, packed.buckets, strict=True):
        assert isinstance(data, torch.Tensor) and data.dtype == torch.uint8
        assert not b.sha256 and b.device_digest == reference_digest(bytes(data.numpy()))
    host = copy_weights(state_dict(1), 1, 0, bucket_bytes=64 << 10).seal()  # the same bytes in host buckets
    assert [bytes(d.numpy()) for d in packed.buckets] == [bytes(d) for d in host.buckets]
    with pytest.raises(ValueError, match="collective broadcast only"):
        next(packed.updates())
    with pytest.raises(ValueError, match="collective broadcast only"):
        asyncio.run(push_weights("127.0.0.1:1", packed, transport="tcp"))


def test_paths_that_are_not_collective_refuse_device_digests():
    h = device_pack(1).header
    with pytest.raises(CorruptUpdate, match="only a collective push"):
        check_header(h, 0, None, None, None)
    assert len(check_header(h, 0, None, None, None, device_digests=True)) == len(h.buckets)
    h.buckets[0].sha256 = "0" * 64  # both digests: refused too (which one would count?)
    with pytest.raises(CorruptUpdate, match="only a collective push"):
        check_header(h, 0, None, None, None, device_digests=True)


# ------------------------------------------------------------------------------------------------- the replica


def test_a_replica_installs_views_of_the_received_buckets_without_hashing_them(monkeypatch):
    def no_host_hash(*a, **kw):
        raise AssertionError("a device-digest bucket went through the host sha256 path")

    monkeypatch.setattr(collective, "finish_bucket", no_host_hash)
    received: list[torch.Tensor] = []
    real = verify.finish_device_bucket

    def spy(index, buf, expected, manifest):
        received.append(buf)
        return real(index, buf, expected, manifest)

    monkeypatch.setattr(collective, "finish_device_bucket", spy)

    async def main():
        async with Replica() as a, Replica() as b:
            packed = device_pack(1)
            out = await push_weights_many([a.addr, b.addr], packed, token=TOKEN, transport="collective", timeout=60)
            for r in (a, b):
                resp = out[r.addr]
                assert not isinstance(resp, BaseException), resp
                assert resp.swapped and resp.version == 1 and resp.checksum == packed.checksum
                assert_bits(r.engine.tensors, state_dict(1))
            assert len(received) == 2 * len(packed.buckets)
            buffers = {buf.untyped_storage().data_ptr() for buf in received}
            for t in a.engine.tensors.values():  # views of the received buckets: no copy was made to install them
                assert t.numel() == 0 or t.untyped_storage().data_ptr() in buffers

    asyncio.run(main())


def test_a_bucket_that_does_not_match_its_device_digest_is_refused_and_the_replica_keeps_its_version():
    async def main():
        async with Replica() as r:
            good = device_pack(1)
            out = await push_weights_many([r.addr], good, token=TOKEN, transport="collective", timeout=60)
            assert not isinstance(out[r.addr], BaseException)
            bad = device_pack(2)
            bad.buckets[1][-1] ^= 0xFF  # changed after sealing: the broadcast carries other bytes than the digest
            assert len(bad.buckets) > 2  # the replica keeps receiving (and dropping) the buckets after the bad one
            began = time.monotonic()
            out = await push_weights_many(
                [r.addr], bad, token=TOKEN, transport="collective", timeout=60, group_timeout_s=30
            )
            assert time.monotonic() - began < 30, "the push waited out the group timeout"
            err = out[r.addr]
            assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert "device digest" in err.details()
            assert r.engine.history == [1] and r.engine.served.version == 1 and not r.busy
            assert_bits(r.engine.tensors, state_dict(1))

    asyncio.run(main())


def test_a_host_packed_bucket_received_on_a_device_still_takes_the_sha256_path():
    """A trainer group's streamed buckets (host, sha256) into a replica that receives on its device: the old path."""
    packed = copy_weights(state_dict(3), 3, 2, bucket_bytes=64 << 10).seal()
    group = collective.TrainerGroup("127.0.0.1", 10.0)
    world = group.admit([b"t" * 32], [1])
    got: dict = {}
    errors: list[BaseException] = []

    def replica() -> None:
        try:
            pg = collective.join_group(group.spec, b"t" * 32)
            for i, b in enumerate(packed.header.buckets):
                manifest = {t.name: (t.dtype, tuple(t.shape)) for t in packed.header.tensors if t.bucket == i}
                got.update(collective.receive_bucket(pg, i, b.nbytes, b.sha256, manifest, CPU, b.device_digest))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    thread = threading.Thread(target=replica, daemon=True)
    thread.start()
    try:
        group.run(lambda: group.broadcast(world, packed.buckets)).result(timeout=30)
    finally:
        thread.join(30)
        group.close()
    assert not errors, errors
    assert_bits(got, state_dict(3))


def test_the_trainer_packs_on_its_device_only_for_a_collective_push_over_a_device_backend(tmp_path):
    sd = state_dict(4)
    engine = SimpleNamespace(policy_version=4, group=None, policy_state_dict=lambda on_device=False: sd)

    def fleet(collective: dict) -> Fleet:
        return Fleet(ServiceSettings(), engine, None, asyncio.Lock(), tmp_path / "events.jsonl", print, collective)

    on_device = fleet({"backend": "nccl", "device": CPU})._copy_policy(4).seal()  # what collective_backend gives
    assert on_device.on_device and all(b.device_digest and not b.sha256 for b in on_device.header.buckets)
    for spec in ({}, {"backend": "gloo", "device": None}):  # tcp/grpc, and gloo: host buckets with sha256
        host = fleet(spec)._copy_policy(4).seal()
        assert not host.on_device and all(b.sha256 and not b.device_digest for b in host.header.buckets)
        assert host.checksum != on_device.checksum  # the digests differ, the bytes do not
        assert [bytes(b) for b in host.buckets] == [bytes(b.numpy()) for b in on_device.buckets]
