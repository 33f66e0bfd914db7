"""Weight sync, trainer -> rollout replica: versioned, integrity-checked, all-or-nothing.

Wire format (``RolloutService.UpdateWeights``, a client stream of ``WeightUpdate``; proto/rlhf/v1/weights.proto):

1. one ``WeightHeader``: ``version`` (greater than the version the replica serves), ``parent_version`` (the version
   the trainer started this update from; smaller than ``version``), the manifest (per tensor: name, safetensors
   dtype, shape, bucket), the buckets (index 0..n-1, nbytes, sha256 hex), ``checksum`` = sha256 hex of the bucket
   digests (hex, ASCII) concatenated in index order, ``total_bytes`` = sum of nbytes, ``format = "safetensors"``;
2. then ``WeightChunk``s: bucket by bucket in index order, each bucket's bytes in order and without gaps
   (``offset`` = bytes of that bucket sent before), every chunk non-empty. A bucket is the ``safetensors.torch.save``
   of a group of whole tensors (at most ``bucket_bytes``, or one tensor alone when it is larger).

The same header and bucket bytes can also travel over the raw-TCP data plane (:mod:`rlhf.transport.dataplane`:
``OpenWeightsTransfer`` with the header, the buckets on one plain TCP connection, ``CommitWeights``), which
:func:`push_weights` uses by default when the replica offers it: Python gRPC streaming reaches well under half of
a raw socket's bandwidth. The checks and the errors below are the same on both.

Nothing is pickled and nothing is ``torch.load``-ed: the receiver checks each bucket's safetensors header (JSON) and
makes its tensors with ``torch.frombuffer`` on the received bytes (:func:`load_safetensors`; no copy).

Sender: :func:`pack_weights` (serialise once) then :func:`push_weights` / :func:`push_weights_many` (send the
same packed bytes to every replica: over the data plane, or streamed as pre-serialised messages,
:meth:`PackedWeights.encoded_updates`), or
:func:`weight_updates` for the message generator.
Receiver: :func:`receive_update` (or :class:`WeightReceiver`, which also serialises updates, keeps the served version
and reuses bucket buffers across versions through a :class:`BufferPool`) returns :class:`StagedWeights` only when
every check passed, else raises one of the errors below; the caller keeps serving its old weights either way until
it swaps the staged ones in. It takes ``WeightUpdate`` messages, or what :func:`decode_update` makes of the raw
request bytes (the rollout service's deserializer: chunk data stays where gRPC put it).

Errors and their gRPC codes (they subclass ``rlhf.serving.errors`` classes when available, so the serving layer's
table maps them automatically; each also carries ``grpc_code``):

=======================  ======================  ============================================================
error                    gRPC code               when
=======================  ======================  ============================================================
StaleVersion             FAILED_PRECONDITION     version <= the served version (versions never go backwards)
UpdateInProgress         FAILED_PRECONDITION     another update is being received by the same WeightReceiver
CorruptUpdate            INVALID_ARGUMENT        bad header, out-of-order/overlapping chunk, size or sha256
                                                 mismatch, bucket content that disagrees with the manifest
IncompleteUpdate         INVALID_ARGUMENT        the stream ended before every bucket arrived (cut stream)
IncompatibleUpdate       INVALID_ARGUMENT        the manifest does not fit the served model (``expected``)
UpdateTooLarge           RESOURCE_EXHAUSTED      over ``max_total_bytes`` / ``max_bucket_bytes``
=======================  ======================  ============================================================

A client that cancels the call mid-stream cancels the handler (``asyncio.CancelledError``): nothing is staged.
Authentication is the servicer's job (``rlhf.serving.require_grpc_token`` before calling the receiver): a wrong
token is refused with UNAUTHENTICATED before any weight byte is read; the client surfaces it as
``grpc.aio.AioRpcError``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import sys
import time
import warnings
from collections.abc import AsyncIterable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from safetensors.torch import save as st_save

from rlhf.v1 import weights_pb2

FORMAT = "safetensors"
UPDATE_WEIGHTS_METHOD = "/rlhf.v1.RolloutService/UpdateWeights"
OPEN_TRANSFER_METHOD = "/rlhf.v1.RolloutService/OpenWeightsTransfer"
COMMIT_WEIGHTS_METHOD = "/rlhf.v1.RolloutService/CommitWeights"
TRANSPORTS = ("auto", "grpc", "tcp")
MiB = 1 << 20
# Measured on loopback (bench.weight_sync, with pre-serialised messages): 0.5-4 MiB chunks stream alike, 16-32 MiB
# ones slower. 2 MiB plus the ~20-byte message prefix also fits gRPC's default 4 MiB receive limit.
DEFAULT_CHUNK_BYTES = 2 * MiB
DEFAULT_BUCKET_BYTES = 128 * MiB

# ------------------------------------------------------------------------------------------------------- errors

try:  # the serving layer's error table maps these to gRPC/HTTP codes automatically
    from rlhf.serving.errors import FailedPrecondition as _FailedPrecondition
    from rlhf.serving.errors import InvalidArgument as _InvalidArgument
    from rlhf.serving.errors import PayloadTooLarge as _PayloadTooLarge
    from rlhf.serving.errors import RLHFError as _Base
except ImportError:  # pragma: no cover - rlhf.serving absent

    class _Base(Exception):  # type: ignore[no-redef]
        def __init__(self, message: str, field: str | None = None):
            super().__init__(message)
            self.message = message
            self.field = field

    _FailedPrecondition = _InvalidArgument = _PayloadTooLarge = _Base  # type: ignore[misc]


class WeightSyncError(_Base):
    """Base of every weight-sync refusal; the replica keeps serving its current weights. Never raised itself."""

    grpc_code = grpc.StatusCode.INTERNAL


class StaleVersion(WeightSyncError, _FailedPrecondition):
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class UpdateInProgress(WeightSyncError, _FailedPrecondition):
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class CorruptUpdate(WeightSyncError, _InvalidArgument):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class IncompleteUpdate(WeightSyncError, _InvalidArgument):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class IncompatibleUpdate(WeightSyncError, _InvalidArgument):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT


class UpdateTooLarge(WeightSyncError, _PayloadTooLarge):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


# ------------------------------------------------------------------------------------------------------ helpers

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}

Manifest = dict[str, tuple[str, tuple[int, ...]]]  # name -> (safetensors dtype, shape)


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.bfloat16`` -> ``"BF16"``)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors name known to rlhf.transport") from None


def manifest_of(state_dict: Mapping[str, torch.Tensor]) -> Manifest:
    """name -> (dtype, shape) of a state dict: what a replica passes as ``expected`` to refuse foreign updates."""
    return {k: (dtype_name(v.dtype), tuple(v.shape)) for k, v in state_dict.items()}


def manifest_checksum(bucket_digests: Sequence[str]) -> str:
    """The header checksum: sha256 hex over the bucket sha256 hex digests (ASCII), concatenated in index order."""
    return hashlib.sha256("".join(bucket_digests).encode("ascii")).hexdigest()


def _safetensors_header(data: bytes | memoryview) -> dict[str, Any]:
    """The JSON header of a serialized safetensors buffer (8-byte little-endian length, then JSON)."""
    if len(data) < 8:
        raise CorruptUpdate(f"bucket of {len(data)} bytes is too short to be safetensors")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise CorruptUpdate(f"safetensors header length {n} exceeds the bucket size {len(data)}")
    try:
        meta = json.loads(bytes(data[8 : 8 + n]))
    except ValueError as err:
        raise CorruptUpdate(f"safetensors header is not JSON: {err}") from None
    if not isinstance(meta, dict):
        raise CorruptUpdate("safetensors header is not a JSON object")
    meta.pop("__metadata__", None)
    return meta


_TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_NAMES.items()}


def load_safetensors(data: bytes | bytearray | memoryview) -> dict[str, torch.Tensor]:
    """The tensors of a serialized safetensors buffer, as views into it (``torch.frombuffer``: no copy; a tensor
    keeps the buffer alive). Validates what ``safetensors.torch.load`` validates: known dtypes, sizes that match
    the shapes, offsets that tile the data area exactly (in bounds, no overlap, no gap). Raises CorruptUpdate.
    The tensors share the buffer's memory: writable when it is (bytearray), read-only bytes otherwise."""
    meta = _safetensors_header(data)
    view = memoryview(data).cast("B")
    hlen = int.from_bytes(view[:8], "little")
    start, size = 8 + hlen, len(view) - 8 - hlen
    spans: list[tuple[int, int, str]] = []
    specs: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
    for name, entry in meta.items():
        if not isinstance(entry, dict):
            raise CorruptUpdate(f"safetensors entry {name!r} is not an object")
        dtype = _TORCH_DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
        shape, offs = entry.get("shape"), entry.get("data_offsets")
        if dtype is None:
            raise CorruptUpdate(f"tensor {name!r} has an unknown dtype {entry.get('dtype')!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptUpdate(f"tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)):
            raise CorruptUpdate(f"tensor {name!r} has invalid data_offsets {offs!r}")
        begin, end = offs
        numel = 1
        for d in shape:
            numel *= d
        itemsize = dtype.itemsize
        if not 0 <= begin <= end <= size or end - begin != numel * itemsize:
            raise CorruptUpdate(f"tensor {name!r}: data_offsets {offs} do not fit {entry['dtype']}{shape} in the data")
        spans.append((begin, end, name))
        specs[name] = (dtype, tuple(shape), numel)
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise CorruptUpdate(f"tensor {name!r} starts at {begin}, expected {at}: tensor data overlap or leave a gap")
        at = end
    if at != size:
        raise CorruptUpdate(f"the tensors cover {at} of the {size} data bytes")
    readonly = view.readonly
    out: dict[str, torch.Tensor] = {}
    for begin, _end, name in spans:  # header order, like safetensors
        dtype, shape, numel = specs[name]
        if numel == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # read-only bytes: torch warns that writes would be undefined; we never write
            if readonly:
                warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(view, dtype=dtype, count=numel, offset=start + begin)
        if t.data_ptr() % t.element_size():  # misaligned (a sender's odd header): kernels expect aligned data
            t = t.clone()
        out[name] = t.view(shape)
    return out


# ------------------------------------------------------------------------------------------------------ sending


@dataclass
class PackedWeights:
    """A state dict serialised once: the header and the safetensors buckets, ready to stream to many replicas.

    Holds one serialised copy of the weights (about the state dict's size) in host memory."""

    header: weights_pb2.WeightHeader
    buckets: list[bytes]

    @property
    def version(self) -> int:
        return self.header.version

    @property
    def checksum(self) -> str:
        return self.header.checksum

    @property
    def total_bytes(self) -> int:
        return self.header.total_bytes

    def updates(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[weights_pb2.WeightUpdate]:
        """The ``UpdateWeights`` request stream: the header, then every bucket in chunks of ``chunk_bytes``."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        yield weights_pb2.WeightUpdate(header=self.header)
        for index, data in enumerate(self.buckets):
            view = memoryview(data)
            for off in range(0, len(data), chunk_bytes):
                chunk = weights_pb2.WeightChunk(bucket=index, offset=off, data=bytes(view[off : off + chunk_bytes]))
                yield weights_pb2.WeightUpdate(chunk=chunk)

    def encoded_updates(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
        """:meth:`updates` already serialised (the same bytes ``SerializeToString`` gives): each chunk message is
        its ~30-byte prefix joined to a slice of the bucket, one copy, instead of a slice copy, a protobuf message
        and its serialisation (what :func:`push_weights` streams)."""
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        yield weights_pb2.WeightUpdate(header=self.header).SerializeToString()
        for index, data in enumerate(self.buckets):
            view = memoryview(data)
            for off in range(0, len(data), chunk_bytes):
                yield encode_chunk(index, off, view[off : off + chunk_bytes])


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_chunk(bucket: int, offset: int, data: bytes | memoryview) -> bytes:
    """``WeightUpdate(chunk=WeightChunk(bucket, offset, data)).SerializeToString()`` with one copy of ``data``
    (protobuf wire format: WeightUpdate.chunk = field 2; WeightChunk bucket = 1, offset = 2, data = 3)."""
    if bucket < 0 or offset < 0:
        raise ValueError("bucket and offset must be >= 0")
    n = len(data)
    inner = b"".join(
        (
            b"\x08" + _varint(bucket) if bucket else b"",  # proto3 leaves zero scalars out
            b"\x10" + _varint(offset) if offset else b"",
            b"\x1a" + _varint(n) if n else b"",
        )
    )
    return b"".join((b"\x12", _varint(len(inner) + n), inner, data))


def _plan_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    plan: list[list[str]] = []
    size = 0
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise ValueError(f"state_dict[{name!r}] is not a dense tensor ({t.layout}); call .to_dense() first")
        n = t.numel() * t.element_size()
        if plan and plan[-1] and size + n <= bucket_bytes:
            plan[-1].append(name)
            size += n
        else:
            plan.append([name])
            size = n
    return plan


def _serialise_bucket(state_dict: Mapping[str, torch.Tensor], names: Sequence[str]) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name in names:
        t = state_dict[name].detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages:  # tied or sliced weights: safetensors refuses tensors sharing memory in one file
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            storages.add(ptr)
        tensors[name] = t
    return st_save(tensors)


def pack_weights(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    parent_version: int | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> PackedWeights:
    """Serialise ``state_dict`` (any device; copied to host bucket by bucket) into safetensors buckets and the
    header. ``parent_version`` defaults to ``version - 1``. Tensors sharing memory (tied weights) are each sent
    in full. Do not modify the tensors while this runs (take it between optimizer steps)."""
    if parent_version is None:
        parent_version = version - 1
    if parent_version >= version:
        raise ValueError(f"parent_version ({parent_version}) must be smaller than version ({version})")
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    if not state_dict:
        raise ValueError("state_dict is empty")
    bad = next((name for name, t in state_dict.items() if not all_finite(t)), None)
    if bad is not None:  # a diverged update must never reach a replica (it would serve garbage, and stay ready)
        raise ValueError(f"refusing to pack weights: tensor {bad!r} has NaN or infinite values")
    header = weights_pb2.WeightHeader(version=version, parent_version=parent_version, format=FORMAT)
    buckets: list[bytes] = []
    for index, names in enumerate(_plan_buckets(state_dict, bucket_bytes)):
        data = _serialise_bucket(state_dict, names)
        meta = _safetensors_header(data)
        for name in names:
            entry = meta[name]
            header.tensors.add(name=name, dtype=entry["dtype"], shape=entry["shape"], bucket=index)
        header.buckets.add(index=index, nbytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        buckets.append(data)
    header.checksum = manifest_checksum([b.sha256 for b in header.buckets])
    header.total_bytes = sum(len(b) for b in buckets)
    return PackedWeights(header, buckets)


def weight_updates(
    state_dict: Mapping[str, torch.Tensor],
    version: int,
    parent_version: int | None = None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Iterator[weights_pb2.WeightUpdate]:
    """The ``WeightUpdate`` stream of a state dict (header, then chunks)."""
    return pack_weights(state_dict, version, parent_version, bucket_bytes=bucket_bytes).updates(chunk_bytes)


def _credentials(tls: bool | str | Path | bytes | grpc.ChannelCredentials) -> grpc.ChannelCredentials | None:
    if tls is False or tls is None:
        return None
    if tls is True:
        return grpc.ssl_channel_credentials()
    if isinstance(tls, grpc.ChannelCredentials):
        return tls
    roots = tls if isinstance(tls, bytes) else Path(tls).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=roots)


async def push_weights(
    target: str,
    weights: Mapping[str, torch.Tensor] | PackedWeights,
    version: int | None = None,
    parent_version: int | None = None,
    *,
    token: str | None = None,
    timeout: float | None = 600.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    tls: bool | str | Path | bytes | grpc.ChannelCredentials = False,
    channel: grpc.aio.Channel | None = None,
    options: Sequence[tuple[str, Any]] = (),
    transport: str = "auto",
) -> weights_pb2.UpdateWeightsResponse:
    """Send weights to one replica and return its ``UpdateWeightsResponse``.

    ``transport``: ``"tcp"``, the raw-TCP data plane (``OpenWeightsTransfer``, the buckets on the replica's data
    port at ``target``'s host, ``CommitWeights``; :mod:`rlhf.transport.dataplane`); ``"grpc"``, the
    ``UpdateWeights`` stream; ``"auto"`` (default), the data plane when the replica offers one (Open answers a port),
    else the stream (a replica without the data plane, or UNIMPLEMENTED from an older one). ``"tcp"`` against a
    replica without it raises ``RuntimeError``. The data connection goes to ``target``'s host: name one replica
    (an address, or a name that resolves to one; the trainer expands service names to one address per replica).
    A data port the client cannot reach fails the push, and the replica frees the update after its ticket's ttl.

    ``weights``: a state dict (then ``version`` is required; it is packed in a worker thread) or a
    :class:`PackedWeights` (``version``/``parent_version`` must then be None or agree with it). ``token`` goes out
    as ``authorization: Bearer <token>``. ``tls``: False (plaintext), True (system roots), a CA bundle path or
    bytes, or ready ``grpc.ChannelCredentials``. ``channel``: reuse an open channel (``target``/``tls``/``options``
    are then ignored). A refusal comes back as ``grpc.aio.AioRpcError`` (see the module docstring for the codes);
    ``timeout`` bounds the whole update.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, not {transport!r}")
    if isinstance(weights, PackedWeights):
        if version is not None and version != weights.version:
            raise ValueError(f"version {version} disagrees with the packed weights' version {weights.version}")
        if parent_version is not None and parent_version != weights.header.parent_version:
            raise ValueError("parent_version disagrees with the packed weights")
        packed = weights
    else:
        if version is None:
            raise ValueError("version is required when pushing a state dict")
        packed = await asyncio.to_thread(pack_weights, weights, version, parent_version, bucket_bytes=bucket_bytes)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    own = channel is None
    if own:
        opts = [("grpc.max_send_message_length", chunk_bytes + MiB), *options]
        creds = _credentials(tls)
        channel = (
            grpc.aio.secure_channel(target, creds, options=opts)
            if creds is not None
            else grpc.aio.insecure_channel(target, options=opts)
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        if transport != "grpc":
            resp = await _push_over_data_plane(channel, target, packed, deadline, metadata, required=transport == "tcp")
            if resp is not None:
                return resp
        # Messages go out pre-serialised (PackedWeights.encoded_updates): the stub's serializer would build and
        # encode a protobuf message per chunk, the largest cost of the sender in Python.
        call = channel.stream_unary(
            UPDATE_WEIGHTS_METHOD,
            request_serializer=None,
            response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
        )
        return await call(packed.encoded_updates(chunk_bytes), timeout=_left(deadline), metadata=metadata)
    finally:
        if own:
            await channel.close()


def _left(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("push_weights: deadline exceeded")
    return left


def _host_of(target: str) -> str:
    """The host of a gRPC target (``host:port``, ``[v6]:port``, ``dns:///host:port``, ``ipv4:host:port``)."""
    for prefix in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(prefix):
            target = target[len(prefix) :]
            break
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    return host.strip("[]")


async def _push_over_data_plane(
    channel: grpc.aio.Channel,
    target: str,
    packed: PackedWeights,
    deadline: float | None,
    metadata: Any,
    *,
    required: bool,
) -> weights_pb2.UpdateWeightsResponse | None:
    """Open, send the buckets on the data port, commit. None: the replica has no data plane (and not ``required``)."""
    from rlhf.transport.dataplane import send_buckets

    open_call = channel.unary_unary(
        OPEN_TRANSFER_METHOD,
        request_serializer=weights_pb2.OpenWeightsTransferRequest.SerializeToString,
        response_deserializer=weights_pb2.OpenWeightsTransferResponse.FromString,
    )
    try:
        opened = await open_call(
            weights_pb2.OpenWeightsTransferRequest(header=packed.header), timeout=_left(deadline), metadata=metadata
        )
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED and not required:
            return None  # a replica from before the data plane
        raise
    if not opened.data_port:
        if required:
            raise RuntimeError(f"{target} offers no weights data port (RLHF_WEIGHTS_DATA_PORT unset, or TLS)")
        return None
    commit_call = channel.unary_unary(
        COMMIT_WEIGHTS_METHOD,
        request_serializer=weights_pb2.CommitWeightsRequest.SerializeToString,
        response_deserializer=weights_pb2.UpdateWeightsResponse.FromString,
    )
    host = _host_of(target)
    # The commit goes out with the data (it waits on the replica until every byte is verified): its answer comes
    # back as soon as the swap is done, without a round trip after the send.
    commit = asyncio.ensure_future(
        commit_call(weights_pb2.CommitWeightsRequest(ticket=opened.ticket), timeout=_left(deadline), metadata=metadata)
    )
    try:
        await asyncio.to_thread(send_buckets, host, opened.data_port, opened.ticket, packed.buckets, _left(deadline))
    except Exception as err:
        # the replica's answer says more (short data: IncompleteUpdate), when it comes quickly; a data port it
        # cannot reach leaves its transfer to expire (its ttl), and this raises the connection error
        try:
            return await asyncio.wait_for(asyncio.shield(commit), timeout=5.0)
        except TimeoutError:
            commit.cancel()
            raise err from None
    except BaseException:
        commit.cancel()
        raise
    return await commit


async def push_weights_many(
    targets: Iterable[str],
    packed: PackedWeights,
    *,
    server_names: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> dict[str, weights_pb2.UpdateWeightsResponse | BaseException]:
    """:func:`push_weights` of one packed update to several replicas concurrently; per target the response or
    the exception (a failed replica does not stop the others). ``server_names``: per target, the name its TLS
    certificate is checked against when that is not the target's host (a service name the caller resolved to one
    address per replica: the certificate names the service, not the pod's address)."""
    targets = list(targets)

    def one(target: str):
        name = (server_names or {}).get(target)
        if name is None:
            return push_weights(target, packed, **kwargs)
        options = [*kwargs.get("options", ()), ("grpc.ssl_target_name_override", name)]
        return push_weights(target, packed, **{**kwargs, "options": options})

    results = await asyncio.gather(*(one(t) for t in targets), return_exceptions=True)
    return dict(zip(targets, results, strict=True))


# ---------------------------------------------------------------------------------------------------- receiving


@dataclass(slots=True)
class RawChunk:
    """A ``WeightChunk`` decoded by :func:`decode_update` without protobuf: ``data`` is a view into the message."""

    bucket: int
    offset: int
    data: memoryview


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    raise ValueError("bad varint")


def decode_update(raw: bytes) -> weights_pb2.WeightUpdate | RawChunk:
    """The server's request deserializer for ``UpdateWeights``: a chunk in the layout :func:`encode_chunk` writes
    becomes a :class:`RawChunk` whose data is a view into ``raw`` (protobuf would copy it twice: into its message,
    then into a new bytes object on ``.data``); anything else (the header, other valid encodings) goes through
    ``WeightUpdate.FromString``. :func:`receive_update` takes both."""
    view = memoryview(raw)
    end = len(view)
    try:
        if end and view[0] == 0x12:
            n, pos = _read_varint(view, 1, end)
            if pos + n == end:
                bucket = offset = size = 0
                if pos < end and view[pos] == 0x08:
                    bucket, pos = _read_varint(view, pos + 1, end)
                if pos < end and view[pos] == 0x10:
                    offset, pos = _read_varint(view, pos + 1, end)
                if pos < end and view[pos] == 0x1A:
                    size, pos = _read_varint(view, pos + 1, end)
                if pos + size == end and bucket < 2**31:
                    return RawChunk(bucket, offset, view[pos:end])
    except (ValueError, IndexError):
        pass
    return weights_pb2.WeightUpdate.FromString(raw)


@dataclass
class StagedWeights:
    """A verified update, not yet serving: swap ``tensors`` in, then :meth:`WeightReceiver.commit`."""

    version: int
    parent_version: int
    checksum: str
    tensors: dict[str, torch.Tensor]
    nbytes: int  # serialized bytes received
    seconds: float  # receiving and verifying
    manifest: Manifest = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return self.nbytes


def _check_header(
    h: weights_pb2.WeightHeader,
    current_version: int,
    max_total_bytes: int | None,
    max_bucket_bytes: int | None,
    expected: Mapping[str, tuple[str, Sequence[int]]] | None,
) -> list[Manifest]:
    """Validate a header; returns per bucket the manifest of its tensors."""
    if h.format != FORMAT:
        raise CorruptUpdate(f"header.format is {h.format!r}; only {FORMAT!r} is supported")
    if h.version <= current_version:
        raise StaleVersion(
            f"update version {h.version} is not newer than the served version {current_version}: "
            "versions never go backwards; publish under a higher version",
            field="header.version",
        )
    if h.parent_version >= h.version:
        raise CorruptUpdate(f"header.parent_version {h.parent_version} must be smaller than version {h.version}")
    if not h.buckets:
        raise CorruptUpdate("header lists no buckets")
    for i, b in enumerate(h.buckets):
        if b.index != i:
            raise CorruptUpdate(f"header.buckets[{i}].index is {b.index}: buckets must be listed in index order")
        if b.nbytes < 8:
            raise CorruptUpdate(f"header.buckets[{i}].nbytes is {b.nbytes}: too small for a safetensors buffer")
        if len(b.sha256) != 64 or any(c not in "0123456789abcdef" for c in b.sha256):
            raise CorruptUpdate(f"header.buckets[{i}].sha256 is not a lowercase sha256 hex digest")
        if max_bucket_bytes is not None and b.nbytes > max_bucket_bytes:
            raise UpdateTooLarge(f"bucket {i} has {b.nbytes} bytes; this replica accepts at most {max_bucket_bytes}")
    total = sum(b.nbytes for b in h.buckets)
    if h.total_bytes != total:
        raise CorruptUpdate(f"header.total_bytes is {h.total_bytes} but the buckets add up to {total}")
    if max_total_bytes is not None and total > max_total_bytes:
        raise UpdateTooLarge(f"update has {total} bytes; this replica accepts at most {max_total_bytes}")
    if h.checksum != manifest_checksum([b.sha256 for b in h.buckets]):
        raise CorruptUpdate("header.checksum does not match the bucket digests")
    per_bucket: list[Manifest] = [{} for _ in h.buckets]
    for t in h.tensors:
        if not t.name:
            raise CorruptUpdate("header lists a tensor without a name")
        if not 0 <= t.bucket < len(h.buckets):
            raise CorruptUpdate(f"tensor {t.name!r} is in bucket {t.bucket}, but there are {len(h.buckets)} buckets")
        if any(t.name in m for m in per_bucket):
            raise CorruptUpdate(f"tensor {t.name!r} is listed twice")
        if any(d < 0 for d in t.shape):
            raise CorruptUpdate(f"tensor {t.name!r} has a negative dimension")
        if t.dtype not in _TORCH_DTYPES:
            raise CorruptUpdate(f"tensor {t.name!r} has an unknown dtype {t.dtype!r}")
        per_bucket[t.bucket][t.name] = (t.dtype, tuple(t.shape))
    for i, m in enumerate(per_bucket):
        if not m:
            raise CorruptUpdate(f"bucket {i} holds no tensor")
    if expected is not None:
        got = {k: v for m in per_bucket for k, v in m.items()}
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        if missing or extra:
            raise IncompatibleUpdate(
                f"update does not fit the served model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unknown {extra[:5]}{'...' if len(extra) > 5 else ''}"
            )
        for name, (dt, shape) in got.items():
            edt, eshape = expected[name]
            if (edt is not None and dt != edt) or tuple(shape) != tuple(eshape):
                raise IncompatibleUpdate(
                    f"tensor {name!r} is {dt}{list(shape)} in the update but {edt or ''}{list(eshape)} in the "
                    "served model"
                )
    # Every bucket's size follows from its tensors' dtypes and shapes (plus its JSON header): an announced size
    # is checked before a buffer is allocated for it, so a header cannot make the replica allocate more than the
    # tensors it lists (and, with ``expected``, than the served model's tensors) need.
    for i, (b, m) in enumerate(zip(h.buckets, per_bucket, strict=True)):
        data = sum(_TORCH_DTYPES[dt].itemsize * math.prod(shape) for dt, shape in m.values())
        slack = _bucket_header_allowance(m)
        if not 8 + data <= b.nbytes <= 8 + data + slack:
            raise CorruptUpdate(
                f"header.buckets[{i}].nbytes is {b.nbytes}, but its tensors need {data} bytes of data plus a "
                f"safetensors header of at most {slack} bytes",
                field=f"header.buckets[{i}].nbytes",
            )
    return per_bucket


def _bucket_header_allowance(manifest: Manifest) -> int:
    """The largest safetensors JSON header a bucket of these tensors can have: per tensor its name (JSON-escaped,
    up to 6 characters per character), dtype, shape and offsets; plus room for ``__metadata__`` and padding."""
    per_tensor = sum(6 * len(name) + 80 + 21 * (len(shape) + 2) for name, (_, shape) in manifest.items())
    return 64 * 1024 + per_tensor


class BufferPool:
    """Bucket buffers kept from one update to the next. Fresh memory costs a page fault per 4 KiB on first touch
    (about 1 GB/s here, as slow as the transfer itself); a replica that receives an update every training step
    reuses the buffers of an update whose tensors are gone (a double-buffering engine: the update before last).

    A buffer is free when nothing but the pool refers to it: the staged tensors hold it through the memoryview
    ``torch.frombuffer`` was given, so a buffer some served tensor still uses is never handed out."""

    def __init__(self) -> None:
        self._bufs: list[bytearray] = []

    def take(self, nbytes: int) -> bytearray:
        bufs = self._bufs
        for i in range(len(bufs)):
            # references: the list and getrefcount's argument; any tensor or memoryview adds one
            if len(bufs[i]) == nbytes and sys.getrefcount(bufs[i]) == 2:
                bufs.append(bufs.pop(i))  # most recently used last
                return bufs[-1]
        bufs.append(bytearray(nbytes))
        return bufs[-1]

    def trim(self, keep_bytes: int) -> None:
        """Forget the least recently used free buffers beyond ``keep_bytes`` held in all."""
        bufs = self._bufs
        total = sum(len(b) for b in bufs)
        i = 0
        while total > keep_bytes and i < len(bufs):
            if sys.getrefcount(bufs[i]) == 2:  # the list and the argument
                total -= len(bufs.pop(i))
            else:
                i += 1

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self._bufs)


def _finish_bucket(
    index: int, data: bytearray, digest: str, sha256: str, manifest: Manifest
) -> dict[str, torch.Tensor]:
    """Check a received bucket's digest and content against the manifest; its tensors are views into ``data``."""
    if digest != sha256:
        raise CorruptUpdate(f"bucket {index}: sha256 {digest} does not match the header's {sha256}")
    meta = _safetensors_header(data)
    for name, (dt, shape) in manifest.items():
        entry = meta.get(name)
        if entry is None:
            raise CorruptUpdate(f"bucket {index} does not contain tensor {name!r} listed in the manifest")
        if entry.get("dtype") != dt or tuple(entry.get("shape", ())) != shape:
            raise CorruptUpdate(
                f"tensor {name!r}: bucket {index} holds {entry.get('dtype')}{entry.get('shape')}, "
                f"the manifest says {dt}{list(shape)}"
            )
    if len(meta) != len(manifest):
        extra = sorted(set(meta) - set(manifest))
        raise CorruptUpdate(f"bucket {index} holds tensors not in the manifest: {extra[:5]}")
    try:
        tensors = load_safetensors(data)
    except CorruptUpdate as err:  # passed the digest but does not parse: the sender's packing is broken
        raise CorruptUpdate(f"bucket {index} is not a valid safetensors buffer: {err}") from None
    bad = next((name for name, t in tensors.items() if not all_finite(t)), None)
    if bad is not None:  # the digest only proves the bytes are the sender's; NaN weights are refused, old ones kept
        raise CorruptUpdate(f"tensor {bad!r} has NaN or infinite values; the update is refused", field="tensors")
    return tensors


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``. A float32 sum is finite exactly when every term is, unless finite terms overflow it
    (only then is the exact, slower per-element check needed); one pass, no tensor-sized mask."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    if math.isfinite(float(t.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(t).all())


async def _aiter(requests: AsyncIterable | Iterable):
    if hasattr(requests, "__aiter__"):
        async for m in requests:
            yield m
    else:
        for m in requests:
            yield m


async def receive_update(
    request_iterator: AsyncIterable[weights_pb2.WeightUpdate | RawChunk]
    | Iterable[weights_pb2.WeightUpdate | RawChunk],
    current_version: int,
    *,
    max_total_bytes: int | None = None,
    max_bucket_bytes: int | None = None,
    expected: Mapping[str, tuple[str, Sequence[int]]] | None = None,
    pool: BufferPool | None = None,
) -> StagedWeights:
    """Receive and verify one update stream (the servicer's ``request_iterator``) against the served
    ``current_version``; return the staged tensors (host memory) or raise a :class:`WeightSyncError`.

    Memory: the staged tensors (views into the received buckets: each bucket is one buffer allocated from the header's
    size and filled chunk by chunk, no join, no parse copy) plus the chunk being hashed. The sha256 of each bucket is
    computed chunk by chunk in a worker thread (hashlib releases the GIL) while the next chunks arrive. Nothing is
    staged unless every bucket and the manifest check out.
    ``expected`` (see :func:`manifest_of`): refuse updates whose names/dtypes/shapes differ from the served model
    (a dtype of None accepts any dtype for that tensor: the engine converts it). Bucket sizes are checked against the
    listed tensors before anything is allocated.
    ``pool``: take the bucket buffers from it (see :class:`BufferPool`), else allocate them.
    """
    t0 = time.perf_counter()
    stream = _aiter(request_iterator)
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        raise IncompleteUpdate("empty stream: send a WeightUpdate with the header first") from None
    if isinstance(first, RawChunk) or first.WhichOneof("part") != "header":
        raise CorruptUpdate("the first WeightUpdate must carry the header", field="header")
    h = first.header
    per_bucket = _check_header(h, current_version, max_total_bytes, max_bucket_bytes, expected)
    nb = len(h.buckets)
    if pool is not None:  # keep about two updates' buffers: the one serving (double buffering) and the next
        pool.trim(2 * h.total_bytes)
    staged: dict[str, torch.Tensor] = {}
    loop = asyncio.get_running_loop()
    # One worker thread, FIFO: it hashes each chunk from the bucket buffer (hashlib releases the GIL) and then checks
    # and parses the finished bucket, while the event loop goes on receiving; the loop never waits for it mid-stream
    # (queued work refers to the bucket buffers, which exist anyway, so the queue costs no memory).
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-verify")
    finishing: list[asyncio.Future] = []  # per bucket: its digest checked and its tensors made
    index, filled, received = 0, 0, 0
    buf: bytearray | None = None
    view: memoryview | None = None
    hasher = hashlib.sha256()

    def finish(i: int, data: bytearray, h: Any, spec: weights_pb2.BucketEntry) -> dict[str, torch.Tensor]:
        return _finish_bucket(i, data, h.hexdigest(), spec.sha256, per_bucket[i])

    try:
        async for msg in stream:
            if isinstance(msg, RawChunk):
                c = msg
            elif msg.WhichOneof("part") != "chunk":
                raise CorruptUpdate("a second header in the stream; send one header, then chunks")
            else:
                c = msg.chunk
            if index >= nb:
                raise CorruptUpdate(f"chunk for bucket {c.bucket} after the last bucket ({nb - 1}) was complete")
            if c.bucket != index or c.offset != filled:
                raise CorruptUpdate(
                    f"chunk for bucket {c.bucket} at offset {c.offset}: expected bucket {index} at offset {filled} "
                    "(buckets in index order, chunks contiguous)"
                )
            data = c.data
            size = len(data)
            bucket = h.buckets[index]
            if size == 0:
                raise CorruptUpdate(f"empty chunk in bucket {index} at offset {filled}")
            if filled + size > bucket.nbytes:
                raise CorruptUpdate(f"bucket {index} overruns its {bucket.nbytes} bytes (chunk at {filled}+{size})")
            if buf is None:  # sized by the header (already checked against the limits), so never regrown
                buf = pool.take(bucket.nbytes) if pool is not None else bytearray(bucket.nbytes)
                view = memoryview(buf)
            assert view is not None
            view[filled : filled + size] = data
            del data, msg, c
            worker.submit(hasher.update, view[filled : filled + size])
            filled += size
            received += size
            if filled == bucket.nbytes:
                finishing.append(loop.run_in_executor(worker, finish, index, buf, hasher, bucket))
                index, filled, buf, view, hasher = index + 1, 0, None, None, hashlib.sha256()
            if finishing and finishing[0].done():  # refuse a corrupt bucket as soon as it is known
                staged.update(finishing.pop(0).result())
        for f in finishing:
            staged.update(await f)
        finishing.clear()
    finally:
        if finishing:  # failed or cancelled: let the worker finish its queue, drop the results
            await asyncio.gather(*finishing, return_exceptions=True)
        worker.shutdown(wait=False)
    if index < nb:
        raise IncompleteUpdate(
            f"stream ended after {received} of {h.total_bytes} bytes (bucket {index} of {nb} at byte {filled}): "
            "the update was cut; nothing was staged"
        )
    manifest = {name: spec for m in per_bucket for name, spec in m.items()}
    ordered = {t.name: staged[t.name] for t in h.tensors}
    return StagedWeights(
        version=h.version,
        parent_version=h.parent_version,
        checksum=h.checksum,
        tensors=ordered,
        nbytes=received,
        seconds=time.perf_counter() - t0,
        manifest=manifest,
    )


class WeightReceiver:
    """A replica's side of weight sync: one update at a time, versions only forward.

    ::

        receiver = WeightReceiver(current_version=0, expected=manifest_of(model.state_dict()))

        async def UpdateWeights(self, request_iterator, context):   # inside rlhf.serving.grpc_errors
            require_grpc_token(context, settings)
            staged = await receiver.receive(request_iterator)      # raises WeightSyncError: old weights keep serving
            swap_seconds = await engine.swap(staged.tensors)       # between generation steps
            receiver.commit(staged)
            return UpdateWeightsResponse(version=staged.version, swapped=True, ...)
    """

    def __init__(
        self,
        current_version: int = 0,
        *,
        checksum: str = "",
        max_total_bytes: int | None = None,
        max_bucket_bytes: int | None = None,
        expected: Mapping[str, tuple[str, Sequence[int]]] | None = None,
    ):
        self.current_version = current_version
        self.checksum = checksum
        self.max_total_bytes = max_total_bytes
        self.max_bucket_bytes = max_bucket_bytes
        self.expected = expected
        self.pool = BufferPool()
        self._busy = False

    @property
    def busy(self) -> bool:
        return self._busy

    def reserve(self) -> None:
        """Take the one-update slot (raises UpdateInProgress); :meth:`receive` and the data plane's Open do."""
        if self._busy:
            raise UpdateInProgress("another weight update is being received; retry when it has finished")
        self._busy = True

    def release(self) -> None:
        self._busy = False

    async def receive(self, request_iterator: AsyncIterable | Iterable) -> StagedWeights:
        self.reserve()
        try:
            return await receive_update(
                request_iterator,
                self.current_version,
                max_total_bytes=self.max_total_bytes,
                max_bucket_bytes=self.max_bucket_bytes,
                expected=self.expected,
                pool=self.pool,
            )
        finally:
            self.release()

    def commit(self, staged: StagedWeights) -> None:
        """Record that ``staged`` now serves (call after the swap). Refuses to go backwards."""
        if staged.version <= self.current_version:
            raise StaleVersion(f"cannot commit version {staged.version}: version {self.current_version} already serves")
        self.current_version = staged.version
        self.checksum = staged.checksum
