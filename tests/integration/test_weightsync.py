"""Weight sync: the packer, the receiver's checks, and a round trip over a real grpc.aio server on loopback.

The test servicer does what the rollout service does: check the bearer token (constant time) before reading a
byte, hand the stream to :class:`WeightReceiver`, swap, commit, and map a WeightSyncError to its gRPC code.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import hashlib
import hmac
import json

import grpc
import pytest
import torch
from safetensors.torch import save
from safetensors.torch import save as st_save

from rlhf.serving.errors import status_for
from rlhf.transport.weights import (
    CorruptUpdate,
    IncompatibleUpdate,
    IncompleteUpdate,
    RawChunk,
    StaleVersion,
    UpdateInProgress,
    UpdateTooLarge,
    WeightReceiver,
    WeightSyncError,
    decode_update,
    encode_chunk,
    load_safetensors,
    manifest_checksum,
    manifest_of,
    pack_weights,
    push_weights,
    push_weights_many,
    receive_update,
    weight_updates,
)
from rlhf.v1 import rollout_pb2_grpc, weights_pb2

TOKEN = "s3cret-token"


def state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, 32, generator=g)
    qkv = torch.randn(96, 32, generator=g)
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.q_proj.weight": qkv[:32],  # views into one storage
        "model.layers.0.k_proj.weight": qkv[32:64],
        "model.layers.0.v_proj.weight": qkv[64:],
        "model.layers.0.mlp.weight": torch.randn(128, 32, generator=g).to(torch.bfloat16),
        "model.layers.0.norm.weight": torch.randn(32, generator=g).to(torch.float16),
        "model.layers.0.transposed": torch.randn(16, 8, generator=g).t(),  # not contiguous
        "model.big": torch.randn(300, 100, generator=g),  # larger than the small test buckets
        "model.step": torch.tensor(7, dtype=torch.int64),  # scalar
        "model.mask": torch.rand(10, generator=g) > 0.5,
        "model.empty": torch.empty(0, 4),
        "lm_head.weight": embed,  # tied to the embedding
    }


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(raw(got[k]), raw(v)), k  # bit-identical, NaN payloads and -0.0 included


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class Servicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, receiver: WeightReceiver):
        self.receiver = receiver
        self.weights: dict[str, torch.Tensor] = {}
        self.reads = 0

    async def UpdateWeights(self, request_iterator, context):
        presented = dict(context.invocation_metadata()).get("authorization", "")
        if not hmac.compare_digest(presented.encode(), f"Bearer {TOKEN}".encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid token")
        self.reads += 1
        try:
            staged = await self.receiver.receive(request_iterator)
        except WeightSyncError as err:
            await context.abort(status_for(err)[0], str(err))
        self.weights = staged.tensors  # the swap
        self.receiver.commit(staged)
        return weights_pb2.UpdateWeightsResponse(
            version=staged.version,
            swapped=True,
            bytes_received=staged.bytes,
            checksum=staged.checksum,
            stage_seconds=staged.seconds,
        )

    async def GetWeightsVersion(self, request, context):
        return weights_pb2.WeightsVersion(version=self.receiver.current_version, checksum=self.receiver.checksum)


async def start_server(receiver: WeightReceiver) -> tuple[grpc.aio.Server, str, Servicer]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 8 << 20)])
    servicer = Servicer(receiver)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", servicer


def messages(sd=None, version=1, parent=0, chunk_bytes=4096, bucket_bytes=64 << 10) -> list:
    return list(weight_updates(sd or state_dict(), version, parent, chunk_bytes=chunk_bytes, bucket_bytes=bucket_bytes))


def receive(msgs, current=0, **kw):
    return asyncio.run(receive_update(msgs, current, **kw))


# ------------------------------------------------------------------------------------------- packer + receiver


def test_pack_layout_and_checksum():
    sd = state_dict()
    packed = pack_weights(sd, 5, 4, bucket_bytes=64 << 10)
    h = packed.header
    assert (h.version, h.parent_version, h.format) == (5, 4, "safetensors")
    assert [t.name for t in h.tensors] == list(sd)
    assert len(h.buckets) == len(packed.buckets) >= 3
    assert [b.index for b in h.buckets] == list(range(len(h.buckets)))
    assert all(b.nbytes <= (64 << 10) + 4096 for b in h.buckets if sum(t.bucket == b.index for t in h.tensors) > 1)
    assert h.total_bytes == sum(len(b) for b in packed.buckets)
    assert h.checksum == manifest_checksum([b.sha256 for b in h.buckets])
    spec = {t.name: (t.dtype, tuple(t.shape)) for t in h.tensors}
    assert spec == manifest_of(sd)
    assert spec["model.layers.0.mlp.weight"] == ("BF16", (128, 32)) and spec["model.step"] == ("I64", ())
    # deterministic: same weights, same bytes
    assert pack_weights(sd, 5, 4, bucket_bytes=64 << 10).checksum == packed.checksum
    with pytest.raises(ValueError):
        pack_weights(sd, 3, 3)


def test_receive_round_trip_is_bit_identical():
    sd = state_dict()
    staged = receive(messages(sd), current=0, expected=manifest_of(sd))
    assert (staged.version, staged.parent_version) == (1, 0)
    assert staged.bytes == sum(len(m.chunk.data) for m in messages(sd)[1:])
    assert_identical(staged.tensors, sd)
    staged.tensors["model.big"].add_(1)  # staged tensors are ordinary writable tensors
    assert staged.manifest == manifest_of(sd)


def test_versions_never_go_backwards():
    with pytest.raises(StaleVersion, match="not newer"):
        receive(messages(version=3, parent=2), current=3)  # same version
    with pytest.raises(StaleVersion):
        receive(messages(version=2, parent=1), current=3)  # older


def test_corrupt_chunk_is_refused():
    msgs = messages()
    bad = copy.deepcopy(msgs)
    data = bytearray(bad[3].chunk.data)
    data[100] ^= 0x01
    bad[3].chunk.data = bytes(data)
    with pytest.raises(CorruptUpdate, match="sha256"):
        receive(bad)


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda m: m.pop(0), CorruptUpdate, "first WeightUpdate must carry the header"),
        (lambda m: m.insert(2, m[0]), CorruptUpdate, "second header"),
        (lambda m: m.__setitem__(slice(2, 4), [m[3], m[2]]), CorruptUpdate, "expected bucket 0 at offset 4096"),
        (lambda m: m.pop(2), CorruptUpdate, "expected bucket 0 at offset 4096"),
        (lambda m: m.append(m[-1]), CorruptUpdate, "after the last bucket"),
        (lambda m: m[1].chunk.__setattr__("data", m[1].chunk.data + b"x"), CorruptUpdate, "offset 4097"),
        (lambda m: m[0].header.__setattr__("checksum", "0" * 64), CorruptUpdate, "checksum"),
        (lambda m: m[0].header.__setattr__("total_bytes", 1), CorruptUpdate, "total_bytes"),
        (lambda m: m[0].header.__setattr__("format", "pickle"), CorruptUpdate, "format"),
        (lambda m: m[0].header.tensors[0].__setattr__("dtype", "F16"), CorruptUpdate, "the manifest says F16"),
        (lambda m: m[0].header.tensors[1].shape.__setitem__(0, 31), CorruptUpdate, "the manifest says"),
        (lambda m: m[0].header.tensors[0].__setattr__("bucket", 99), CorruptUpdate, "bucket 99"),
        (lambda m: m[0].header.tensors.add(name="ghost", dtype="F32", bucket=0), CorruptUpdate, "ghost"),
        (lambda m: m[0].header.__setattr__("parent_version", 1), CorruptUpdate, "parent_version"),
        (lambda m: m.__delitem__(slice(1, None)), IncompleteUpdate, "stream ended after 0"),
        (lambda m: m.__delitem__(slice(-3, None)), IncompleteUpdate, "was cut"),
        (lambda m: m.clear(), IncompleteUpdate, "empty stream"),
    ],
)
def test_malformed_streams_are_refused(mutate, error, match):
    msgs = copy.deepcopy(messages())
    mutate(msgs)
    with pytest.raises(error, match=match):
        receive(msgs)


def test_size_limits_and_expected_manifest():
    msgs = messages()
    total = msgs[0].header.total_bytes
    with pytest.raises(UpdateTooLarge):
        receive(msgs, max_total_bytes=total - 1)
    with pytest.raises(UpdateTooLarge):
        receive(msgs, max_bucket_bytes=1000)
    expected = manifest_of(state_dict())
    expected["model.big"] = ("F32", (300, 101))
    with pytest.raises(IncompatibleUpdate, match="model.big"):
        receive(msgs, expected=expected)
    del expected["model.big"]
    with pytest.raises(IncompatibleUpdate, match="unknown"):
        receive(msgs, expected=expected)


def _announce(msgs, bucket: int, nbytes: int) -> None:
    """Make the header claim ``nbytes`` for ``bucket`` (checksum and total kept consistent)."""
    h = msgs[0].header
    h.buckets[bucket].nbytes = nbytes
    h.total_bytes = sum(b.nbytes for b in h.buckets)


def test_announced_sizes_are_bounded_by_the_tensors_before_allocating():
    """A header announcing 2^40 bytes raised MemoryError (smaller sizes were allocated at once): each bucket's size
    must follow from its tensors' dtypes and shapes, and with ``expected`` those shapes are the served model's."""
    sd = state_dict()
    for nbytes in (1 << 40, 1 << 30, 7):
        msgs = copy.deepcopy(messages(sd))
        _announce(msgs, 0, nbytes)
        with pytest.raises(CorruptUpdate, match=r"buckets\[0\].nbytes"):
            receive(msgs)
    # a tensor announced far larger than the model's: refused against the served model's shapes, any dtype allowed
    msgs = copy.deepcopy(messages(sd))
    h = msgs[0].header
    big = next(t for t in h.tensors if t.name == "model.big")
    big.shape[:] = [1 << 20, 1 << 20]
    shapes = {k: (None, tuple(v.shape)) for k, v in sd.items()}
    with pytest.raises(IncompatibleUpdate, match="model.big"):
        receive(msgs, expected=shapes)
    with pytest.raises(CorruptUpdate, match="unknown dtype"):
        bad = copy.deepcopy(messages(sd))
        bad[0].header.tensors[0].dtype = "F128"
        receive(bad)
    # what pack_weights makes passes, with dtype-free expectations too
    assert_identical(receive(messages(sd), expected=shapes).tensors, sd)


def test_receiver_takes_one_update_at_a_time():
    async def body():
        receiver = WeightReceiver(0)
        gate = asyncio.Event()

        async def slow():
            msgs = messages()
            yield msgs[0]
            await gate.wait()
            for m in msgs[1:]:
                yield m

        first = asyncio.create_task(receiver.receive(slow()))
        await asyncio.sleep(0.05)
        with pytest.raises(UpdateInProgress):
            await receiver.receive(messages(version=2, parent=1))
        gate.set()
        staged = await first
        receiver.commit(staged)
        assert receiver.current_version == 1 and not receiver.busy
        with pytest.raises(StaleVersion):
            receiver.commit(staged)

    asyncio.run(body())


def test_errors_map_to_grpc_codes_through_the_serving_table():
    for cls, code in [
        (StaleVersion, grpc.StatusCode.FAILED_PRECONDITION),
        (UpdateInProgress, grpc.StatusCode.FAILED_PRECONDITION),
        (CorruptUpdate, grpc.StatusCode.INVALID_ARGUMENT),
        (IncompleteUpdate, grpc.StatusCode.INVALID_ARGUMENT),
        (IncompatibleUpdate, grpc.StatusCode.INVALID_ARGUMENT),
        (UpdateTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    ]:
        assert not hasattr(cls, "grpc_code")  # one table: rlhf.serving.errors
        assert status_for(cls("x"))[0] == code, cls


# ------------------------------------------------------------------------------------------------ over gRPC


def test_push_over_grpc_round_trip_and_refusals():
    async def body():
        receiver = WeightReceiver(0, expected=manifest_of(state_dict()))
        server, target, servicer = await start_server(receiver)
        try:
            sd1 = state_dict(1)
            resp = await push_weights(target, sd1, 1, token=TOKEN, chunk_bytes=8192, bucket_bytes=64 << 10)
            assert (resp.version, resp.swapped) == (1, True)
            assert_identical(servicer.weights, sd1)
            packed = pack_weights(state_dict(2), 2, 1, bucket_bytes=1 << 20)
            assert resp.checksum != packed.checksum
            resp = await push_weights(target, packed, token=TOKEN)
            assert (resp.version, resp.bytes_received, resp.checksum) == (2, packed.total_bytes, packed.checksum)
            assert_identical(servicer.weights, state_dict(2))

            # old version: refused, version 2 keeps serving
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await push_weights(target, state_dict(3), 2, token=TOKEN)
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "versions never go backwards" in exc.value.details()

            # wrong or missing token: refused before a byte is read
            reads = servicer.reads
            for token in ("wrong", None):
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await push_weights(target, state_dict(3), 3, token=token)
                assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert servicer.reads == reads

            # corrupt chunk: refused, old weights keep serving
            bad = list(pack_weights(state_dict(3), 3, 2).updates(4096))
            bad[5].chunk.data = b"\x00" * len(bad[5].chunk.data)
            async with grpc.aio.insecure_channel(target) as ch:
                stub = rollout_pb2_grpc.RolloutServiceStub(ch)
                md = (("authorization", f"Bearer {TOKEN}"),)
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.UpdateWeights(iter(bad), metadata=md)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sha256" in exc.value.details()

                # cut stream (the client half-closes early): refused
                good = list(pack_weights(state_dict(3), 3, 2).updates(4096))
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.UpdateWeights(iter(good[: len(good) // 2]), metadata=md)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cut" in exc.value.details()

                # cut stream (the client goes away mid-stream): nothing staged, the receiver is free again
                async def then_hang():
                    for m in good[: len(good) // 2]:
                        yield m
                    await asyncio.sleep(3600)

                call = stub.UpdateWeights(then_hang(), metadata=md)
                await asyncio.sleep(0.2)
                assert receiver.busy
                call.cancel()
                for _ in range(100):
                    if not receiver.busy:
                        break
                    await asyncio.sleep(0.02)
                assert not receiver.busy
                version = await stub.GetWeightsVersion(weights_pb2.GetWeightsVersionRequest())
                assert version.version == 2 and version.checksum == packed.checksum
            assert_identical(servicer.weights, state_dict(2))

            # the same update, complete, goes through afterwards
            resp = await push_weights(target, state_dict(3), 3, token=TOKEN)
            assert resp.version == 3
            assert_identical(servicer.weights, state_dict(3))
        finally:
            await server.stop(None)

    asyncio.run(body())


def test_push_to_many_replicas_reports_each():
    async def body():
        servers = [await start_server(WeightReceiver(v)) for v in (0, 0, 5)]
        try:
            packed = pack_weights(state_dict(), 4, 3)
            results = await push_weights_many([t for _, t, _ in servers], packed, token=TOKEN)
            r0, r1, r2 = (results[t] for _, t, _ in servers)
            assert r0.version == r1.version == 4
            assert isinstance(r2, grpc.aio.AioRpcError) and r2.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert_identical(servers[0][2].weights, state_dict())
        finally:
            for server, _, _ in servers:
                await server.stop(None)

    asyncio.run(body())


def _self_signed(tmp_path):
    from cryptography import x509  # noqa: PLC0415 - cryptography: not a dependency, its test importorskips it
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415 - cryptography: not a dependency, its test importorskips it
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415 - cryptography: not a dependency, its test importorskips it
    from cryptography.x509.oid import NameOID  # noqa: PLC0415 - cryptography: not a dependency, its test importorskips it

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    (tmp_path / "ca.pem").write_bytes(cert_pem)
    return cert_pem, key_pem, tmp_path / "ca.pem"


def test_push_over_tls(tmp_path):
    pytest.importorskip("cryptography")
    cert_pem, key_pem, ca_path = _self_signed(tmp_path)

    async def body():
        server = grpc.aio.server()
        servicer = Servicer(WeightReceiver(0))
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
        port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key_pem, cert_pem)]))
        await server.start()
        try:
            resp = await push_weights(f"localhost:{port}", state_dict(), 1, token=TOKEN, tls=ca_path)
            assert resp.version == 1
            assert_identical(servicer.weights, state_dict())
            with pytest.raises(grpc.aio.AioRpcError) as exc:  # plaintext against a TLS port
                await push_weights(f"localhost:{port}", state_dict(), 2, token=TOKEN, timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)

    asyncio.run(body())


# ------------------------------------------------------------------------- fast paths: wire, buffers, parsing


def test_encoded_updates_are_the_protobuf_bytes_and_decode_back():
    packed = pack_weights(state_dict(), 1, bucket_bytes=64 << 10)
    for chunk_bytes in (4096, 5000, 1 << 20):
        encoded = list(packed.encoded_updates(chunk_bytes))
        assert encoded == [m.SerializeToString() for m in packed.updates(chunk_bytes)]
        decoded = [decode_update(b) for b in encoded]
        assert isinstance(decoded[0], weights_pb2.WeightUpdate) and decoded[0].header == packed.header
        assert all(isinstance(d, RawChunk) for d in decoded[1:])
        for d, m in zip(decoded[1:], list(packed.updates(chunk_bytes))[1:], strict=True):
            assert (d.bucket, d.offset, bytes(d.data)) == (m.chunk.bucket, m.chunk.offset, m.chunk.data)
    assert (
        encode_chunk(3, 1 << 40, b"xyz")
        == weights_pb2.WeightUpdate(
            chunk=weights_pb2.WeightChunk(bucket=3, offset=1 << 40, data=b"xyz")
        ).SerializeToString()
    )
    # another valid encoding (fields out of order) still decodes, through protobuf
    odd = b"\x12\x09" + b"\x1a\x03xyz" + b"\x10\x05" + b"\x08\x02"
    m = decode_update(odd)
    assert isinstance(m, weights_pb2.WeightUpdate) and (m.chunk.bucket, m.chunk.offset, m.chunk.data) == (2, 5, b"xyz")


def test_receive_raw_chunks_round_trip_and_refusals():
    packed = pack_weights(state_dict(), 1, bucket_bytes=64 << 10)
    encoded = list(packed.encoded_updates(4096))
    staged = receive([decode_update(b) for b in encoded])
    assert_identical(staged.tensors, state_dict())
    bad = list(encoded)
    flipped = bytearray(bad[3])
    flipped[-10] ^= 0x01
    bad[3] = bytes(flipped)
    with pytest.raises(CorruptUpdate, match="sha256"):
        receive([decode_update(b) for b in bad])
    with pytest.raises(IncompleteUpdate, match="was cut"):
        receive([decode_update(b) for b in encoded[:-2]])
    with pytest.raises(CorruptUpdate, match="first WeightUpdate must carry the header"):
        receive([decode_update(b) for b in encoded[1:]])


def test_staged_tensors_are_writable_views_of_one_buffer_per_bucket():
    staged = receive(messages())
    big = staged.tensors["model.big"]
    assert big.is_contiguous() and not big.is_inference()
    assert torch.equal(big, state_dict()["model.big"])
    big[0, 0] = 5.0  # a writable buffer (the hf engine serves from it)
    assert big[0, 0].item() == 5.0


def test_buffer_pool_never_reuses_memory_that_staged_tensors_hold():
    async def body():
        receiver = WeightReceiver(0)
        sds = [state_dict(i) for i in range(4)]
        first = await receiver.receive(messages(sds[1], 1, 0))
        receiver.commit(first)
        second = await receiver.receive(messages(sds[2], 2, 1))  # `first` is alive: fresh buffers
        receiver.commit(second)
        assert_identical(first.tensors, sds[1])
        ptr_first = first.tensors["model.big"].data_ptr()
        held = receiver.pool.nbytes
        del first
        third = await receiver.receive(messages(sds[3], 3, 2))  # reuses the buffers `first` held
        receiver.commit(third)
        assert_identical(second.tensors, sds[2])
        assert_identical(third.tensors, sds[3])
        assert third.tensors["model.big"].data_ptr() == ptr_first
        assert receiver.pool.nbytes == held

    asyncio.run(body())


def _bucket_with_header(meta: dict, data: bytes) -> bytes:
    head = json.dumps(meta).encode()
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + data


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, "expected 0"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, "do not fit"),
        ({"a": {"dtype": "F32", "shape": [6], "data_offsets": [0, 24]}}, "do not fit"),  # past the end
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, "cover 4 of the 16"),
        ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, "unknown dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, "invalid shape"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, "invalid data_offsets"),
    ],
)
def test_load_safetensors_refuses_what_safetensors_refuses(meta, match):
    with pytest.raises(CorruptUpdate, match=match):
        load_safetensors(_bucket_with_header(meta, bytes(16)))


def test_load_safetensors_matches_safetensors():
    sd = {k: v.contiguous().clone() for k, v in state_dict().items()}
    blob = save(sd)
    got = load_safetensors(blob)  # read-only bytes: views all the same
    assert_identical(got, {k: sd[k] for k in got})
    assert set(got) == set(sd)


def _replace_only_bucket(packed, bucket: bytes) -> None:
    """Swap a one-bucket update's bytes, with digests and sizes that match them (a sender that hashed what it sent)."""
    packed.buckets[0] = bucket
    b = packed.header.buckets[0]
    b.nbytes, b.sha256 = len(bucket), hashlib.sha256(bucket).hexdigest()
    packed.header.checksum = manifest_checksum([b.sha256])
    packed.header.total_bytes = len(bucket)


def test_a_bucket_with_a_valid_digest_but_bad_layout_is_refused():
    """A sender that hashed a broken bucket: the digests match, the safetensors layout does not."""
    packed = pack_weights({"w": torch.ones(4)}, 1)
    bucket = _bucket_with_header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, bytes(16))
    _replace_only_bucket(packed, bucket)
    with pytest.raises(CorruptUpdate, match="not a valid safetensors buffer"):
        receive(list(packed.updates()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_never_packed_nor_accepted(bad):
    """A diverged update is refused on both ends: the packer will not send it, and a replica that gets one anyway
    (an older or foreign sender; the digests are the sender's) refuses it and keeps serving its weights."""
    sd = {"w": torch.ones(4), "b": torch.zeros(2, dtype=torch.bfloat16)}
    sd_bad = {**sd, "b": torch.tensor([0.0, bad], dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="'b' has NaN or infinite values"):
        pack_weights(sd_bad, 1)
    packed = pack_weights(sd, 1)
    bucket = st_save(sd_bad)  # the same layout, finite digests of non-finite numbers
    _replace_only_bucket(packed, bucket)
    with pytest.raises(CorruptUpdate, match="'b' has NaN or infinite values"):
        receive(list(packed.updates()))
