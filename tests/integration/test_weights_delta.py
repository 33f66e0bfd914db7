"""Delta pushes (rlhf.transport.weights.delta): a replica that holds the base update gets only the changed 16-bit words,
rebuilds every bucket and checks it against the full update's digests; it then serves exactly what a full push would
have given it. A replica without that base refuses before any byte is sent and the trainer pushes in full; a delta
that does not rebuild the announced bytes is refused and nothing is swapped."""

from __future__ import annotations

import asyncio
import hashlib
from functools import partial
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlhf.serving import ServiceSettings
from rlhf.transport.weights import (
    PackedWeights,
    WeightReceiver,
    pack_weights,
    push_weights,
    receive_update,
)
from rlhf.transport.weights.delta import RUNS, SPARSE, DeltaBase, apply_bucket, encode_bucket, make_delta
from rlhf.transport.weights.errors import CorruptUpdate, DeltaBaseMissing, refusal_type
from rlhf.transport.weights.format import load_safetensors
from rlhf.v1 import weights_pb2
from services.rollout.hf_engine import HFEngine
from services.rollout.options import SamplingOptions
from services.rollout.vllm_engine import VllmEngine
from services.trainer.fleet import Fleet
from tests.support.replica import FakeEngine
from tests.support.replica import Replica as _Replica

TOKEN = "delta-token"
Replica = partial(_Replica, TOKEN, data_plane=True)  # Replica(engine): the rollout servicer over it, on loopback
PROMPTS = [[2, 5, 6, 7], [2, 11, 12]]
GREEDY = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def state(tiny_models):
    return load_file(str(tiny_models.policy / "model.safetensors"))


def nudged(state: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """``state`` with about ``fraction`` of every tensor's elements changed (a training step's scattered changes),
    and one tensor changed as a whole (run-length territory)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (name, t) in enumerate(state.items()):
        t = t.clone()
        if t.is_floating_point():
            mask = torch.rand(t.shape, generator=g) < (1.0 if i == 1 else fraction)
            t[mask] = (t[mask].float() * 1.01 + 1e-3).to(t.dtype)
        out[name] = t
    return out


def packed(sd: dict[str, torch.Tensor], version: int, bucket_bytes: int = 64 << 10) -> PackedWeights:
    p = pack_weights(sd, version, bucket_bytes=bucket_bytes)
    p.header.keep_base = True  # what the trainer sets with RLHF_WEIGHTS_DELTA=auto
    return p


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


# ------------------------------------------------------------------------------------------------ encoding


def test_encodings_rebuild_the_bucket_bit_for_bit_and_fall_back_to_full():
    rng = np.random.default_rng(0)
    old = rng.integers(0, 1 << 16, 50_000, dtype=np.uint16)
    scattered, block, most = old.copy(), old.copy(), old.copy()
    scattered[rng.choice(old.size, 500, replace=False)] ^= 1
    block[1000:9000] += 3
    most[rng.random(old.size) < 0.5] ^= 2
    for new, encoding in ((scattered, SPARSE), (block, RUNS), (old.copy(), SPARSE)):
        enc = encode_bucket(old.tobytes(), new.tobytes())
        assert enc is not None and enc[0] == encoding
        assert len(enc[1]) < old.nbytes
        assert bytes(apply_bucket(old.tobytes(), enc[1], enc[0], old.nbytes)) == new.tobytes()
    assert encode_bucket(old.tobytes(), most.tobytes()) is None  # half changed: the full bucket is smaller
    assert encode_bucket(old.tobytes(), old.tobytes()[:-2]) is None  # another layout


@pytest.mark.parametrize(
    "mutate",
    [
        lambda p: p[:-1],  # cut
        lambda p: p + b"\0\0",  # extra
        lambda p: p[:8] + (2**31).to_bytes(4, "little") + p[12:],  # an index outside the bucket
        lambda p: (10**9).to_bytes(8, "little") + p[8:],  # a count larger than the bucket
    ],
)
def test_malformed_payloads_are_refused(mutate):
    old = np.arange(1000, dtype=np.uint16)
    new = old.copy()
    new[[3, 500, 999]] += 1
    encoding, payload, _ = encode_bucket(old.tobytes(), new.tobytes())
    with pytest.raises(CorruptUpdate):
        apply_bucket(old.tobytes(), mutate(payload), encoding, old.nbytes)


def test_make_delta_keeps_the_full_updates_digests(state):
    base, new = packed(state, 1), packed(nudged(state, 0.02, 1), 2)
    delta, stats = make_delta(base, new)
    assert delta is not None and stats.delta_buckets > 0
    assert delta.header.checksum == new.header.checksum  # the same checksum the replica will report
    assert delta.total_bytes < new.total_bytes and delta.total_bytes == stats.wire_bytes
    for b, full in zip(delta.header.buckets, new.header.buckets, strict=True):
        assert (b.full_sha256 or b.sha256) == full.sha256
    assert make_delta(base, packed(state, 3))[1].changed_words == 0  # nothing changed: every bucket a few bytes


# ------------------------------------------------------------------------------------------------ replicas


def test_delta_push_serves_what_a_full_push_serves_on_the_hf_engine(tiny_models, state):
    """Two hf replicas: one gets versions 1 (full), 2 (delta over tcp), 3 (delta over the gRPC stream), the other
    gets them all in full; both serve the same bytes and checksums, and the delta replica received fewer bytes."""
    second = nudged(state, 0.01, 2)
    v = [packed(state, 1), packed(second, 2), packed(nudged(second, 0.01, 3), 3)]

    async def main():
        engines = [HFEngine(tiny_models.policy, "tiny:policy", device="cpu") for _ in range(2)]
        for e in engines:
            await e.start()
        async with Replica(engines[0], close_engine=True) as a, Replica(engines[1], close_engine=True) as b:
            delta_addr, delta_svc, full_addr = a.addr, a.servicer, b.addr  # a gets deltas, b full updates
            for p in v:
                await push_weights(full_addr, p, token=TOKEN, transport="tcp")
            first = await push_weights(delta_addr, v[0], token=TOKEN, transport="tcp")
            assert first.bytes_received == v[0].total_bytes
            for p, base, transport in ((v[1], v[0], "tcp"), (v[2], v[1], "grpc")):
                delta, _ = make_delta(base, p)
                resp = await push_weights(delta_addr, p, token=TOKEN, transport=transport, delta=delta)
                assert resp.swapped and resp.version == p.version and resp.checksum == p.checksum
                assert resp.bytes_received == delta.total_bytes < p.total_bytes  # the delta went, not the fallback
                assert delta_svc.receiver.base.version == p.version
            want = engines[1].model.state_dict()
            got = engines[0].model.state_dict()
            assert list(got) == list(want)
            for name in want:
                assert bits(got[name]) == bits(want[name]), name
            for name, t in _tensors(v[2]).items():  # and both are the pushed bytes exactly
                assert bits(got[name]) == bits(t), name
            assert engines[0].weights_checksum == engines[1].weights_checksum == v[2].checksum
            outs = [[s.token_ids for r in await e.generate(PROMPTS, GREEDY) for s in r.samples] for e in engines]
            assert outs[0] == outs[1]

    asyncio.run(main())


def _tensors(p: PackedWeights) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for b in p.buckets:
        out.update(load_safetensors(bytes(b)))
    return {t.name: out[t.name] for t in p.header.tensors}


def test_a_replica_without_the_base_gets_the_full_push(tiny_models, state):
    """A late joiner (no base), and a replica whose base is another version: the delta is refused at Open
    (DeltaBaseMissing, nothing sent) and push_weights sends the full update; a replica that took an update of a
    trainer without deltas (no keep_base) holds no base either."""
    v1, v2 = packed(state, 1), packed(nudged(state, 0.01, 4), 2)
    delta, _ = make_delta(v1, v2)

    async def main():
        engine = HFEngine(tiny_models.policy, "tiny:policy", device="cpu")
        await engine.start()
        async with Replica(engine, close_engine=True) as replica:
            addr, servicer = replica.addr, replica.servicer
            with pytest.raises(grpc.aio.AioRpcError) as err:  # without the fallback: the refusal itself
                await push_weights(addr, delta, token=TOKEN, transport="tcp")
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert refusal_type(err.value) == "DeltaBaseMissing"
            assert servicer.receiver.busy is False and engine.weights_version == 0
            resp = await push_weights(addr, v2, token=TOKEN, transport="grpc", delta=delta)
            assert resp.version == 2 and resp.bytes_received == v2.total_bytes  # the full push
            # deltas off on the trainer (no keep_base): the replica keeps nothing for them
            plain = pack_weights(state, 3)
            await push_weights(addr, plain, token=TOKEN, transport="tcp")
            assert servicer.receiver.base is None

    asyncio.run(main())


@pytest.mark.parametrize("how", ["rebuilds-other-bytes", "wire-bytes-flipped"])
def test_a_corrupt_delta_is_refused_and_nothing_is_swapped(tiny_models, state, how):
    """A delta whose rebuilt bucket is not the announced one (its wire digest recomputed, as a sender with a wrong
    base or encoder would make it): refused by the full update's digest; one whose bytes changed on the way: by its
    wire digest. Either way the replica keeps serving version 1, its base stays, the next delta goes through."""
    v1, v2 = packed(state, 1), packed(nudged(state, 0.01, 5), 2)
    delta, _ = make_delta(v1, v2)
    i = next(b.index for b in delta.header.buckets if b.encoding)
    payload = bytearray(delta.buckets[i])
    payload[-1] ^= 0x01  # the last changed word's new value
    bad_header = weights_pb2.WeightHeader()
    bad_header.CopyFrom(delta.header)
    if how == "rebuilds-other-bytes":
        bad_header.buckets[i].sha256 = hashlib.sha256(payload).hexdigest()
    bad = PackedWeights(bad_header, [payload if k == i else b for k, b in enumerate(delta.buckets)])

    async def main():
        engine = HFEngine(tiny_models.policy, "tiny:policy", device="cpu")
        await engine.start()
        async with Replica(engine, close_engine=True) as replica:
            addr, servicer = replica.addr, replica.servicer
            await push_weights(addr, v1, token=TOKEN, transport="tcp")
            before = {k: bits(t) for k, t in engine.model.state_dict().items()}
            for transport in ("tcp", "grpc"):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await push_weights(addr, bad, token=TOKEN, transport=transport)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert refusal_type(err.value) == "CorruptUpdate" and "sha256" in err.value.details()
                assert engine.weights_version == 1 and engine.weights_checksum == v1.checksum
                assert {k: bits(t) for k, t in engine.model.state_dict().items()} == before
                assert servicer.receiver.base.version == 1 and not servicer.receiver.busy
            # the trainer's fallback on a refused delta: the full update goes
            resp = await push_weights(addr, v2, token=TOKEN, transport="tcp", delta=bad)
            assert resp.version == 2 and resp.bytes_received == v2.total_bytes

    asyncio.run(main())


@pytest.mark.slow
def test_delta_push_into_vllm_serves_what_the_full_push_serves(tiny_models, state, monkeypatch):
    """The vLLM engine behind the same servicer: version 2 as a delta, then the same bytes in full as version 3;
    its greedy tokens and log-probs are the same after both, and its checksum is the full update's."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")

    new = nudged(state, 0.05, 6)
    v1, v2, v3 = packed(state, 1), packed(new, 2), packed(new, 3)
    delta, _ = make_delta(v1, v2)

    async def main():
        vl = VllmEngine(tiny_models.policy, "tiny:policy", mode="inproc", max_model_len=256)
        await vl.start()
        async with Replica(vl, close_engine=True) as replica:
            addr = replica.addr
            await push_weights(addr, v1, token=TOKEN, transport="tcp")
            start = await vl.generate(PROMPTS, GREEDY)
            resp = await push_weights(addr, v2, token=TOKEN, transport="tcp", delta=delta)
            assert resp.bytes_received == delta.total_bytes and resp.checksum == v2.checksum
            after_delta = await vl.generate(PROMPTS, GREEDY)
            await push_weights(addr, v3, token=TOKEN, transport="tcp")
            after_full = await vl.generate(PROMPTS, GREEDY)

            def out(rs):
                return [(s.token_ids, s.logprobs) for r in rs for s in r.samples]

            assert out(after_delta) == out(after_full) != out(start)

    asyncio.run(main())


def test_an_update_installed_as_it_arrives_or_by_broadcast_takes_no_delta(state):
    """vLLM's large updates (installed bucket by bucket as they arrive) and collective pushes keep no base buckets to
    rebuild on: a delta header is refused before a byte is read, so the trainer sends those in full."""
    v1, v2 = packed(state, 1), packed(nudged(state, 0.01, 7), 2)
    delta, _ = make_delta(v1, v2)
    receiver = WeightReceiver(1)
    receiver.base = None
    with pytest.raises(DeltaBaseMissing):
        receiver.delta_base(delta.header, whole=False)

    base = DeltaBase(1, v1.checksum, v1.buckets)
    with pytest.raises(DeltaBaseMissing, match="as it arrives"):
        asyncio.run(receive_update(delta.updates(), 1, install=lambda h: object(), base=base))
    staged = asyncio.run(receive_update(delta.updates(), 1, base=base))  # received whole: rebuilt and checked
    assert staged.checksum == v2.checksum and staged.buckets is not None
    assert [bytes(b) for b in staged.buckets] == [bytes(b) for b in v2.buckets]


def test_the_trainers_fleet_sends_deltas_when_asked_and_full_pushes_otherwise(tmp_path, state):
    """``RLHF_WEIGHTS_DELTA=auto``: the trainer's per-step push sends each replica only what changed since the last
    push it took; the catch-up push (replicas that fell behind) goes in full; ``off`` (the default) never keeps a
    base. The replicas: the rollout servicer over an engine that keeps what it is given."""

    weights = [state, nudged(state, 0.01, 8), nudged(state, 0.02, 9)]

    async def main(mode: str):
        engine = FakeEngine()
        async with Replica(engine) as replica:
            addr, servicer = replica.addr, replica.servicer
            sent: list[int] = []
            trainer = SimpleNamespace(policy_version=0, group=None)
            settings = ServiceSettings(api_token=TOKEN, rollout_addrs=[addr], weights_delta=mode)
            fleet = Fleet(settings, trainer, None, asyncio.Lock(), tmp_path / "events.jsonl", print, {})
            receive = servicer.data.take

            async def counting(ticket):
                staged = await receive(ticket)
                sent.append(staged.nbytes)
                return staged

            servicer.data.take = counting
            for version, sd in enumerate(weights, start=1):
                p = pack_weights(sd, version)
                await fleet._push_to([addr], p, delta_ok=version != 3)  # version 3: as the catch-up pushes
                assert engine.served.version == version and engine.served.checksum == p.checksum
                assert {k: bits(t) for k, t in engine.tensors.items()} == {k: bits(t) for k, t in _tensors(p).items()}
            return sent, weights_total(), servicer.receiver.base

    def weights_total() -> int:
        return pack_weights(state, 1).total_bytes

    sent, full, base = asyncio.run(main("auto"))
    assert sent[0] == full and sent[1] < full / 2 and sent[2] == full and base.version == 3
    sent, full, base = asyncio.run(main("off"))
    assert sent == [full] * 3 and base is None
