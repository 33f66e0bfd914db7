"""Collective weight transfer: the trainer (rank 0) broadcasts the safetensors buckets to every replica at once.

The control stays the versioned, token-protected gRPC calls of the data plane: ``OpenWeightsTransfer`` with a
``group`` (the trainer's rendezvous store: address, port, a key unique to this push) checks the header, reserves the
replica's update slot and answers a ticket; the replica then joins the push's group in a thread and receives each
bucket into its own buffer by ``broadcast``; ``CommitWeights(ticket)`` verifies every bucket's sha256 and the
manifest (as every path does) and swaps. The group is formed afresh for each push from the replicas whose Open
succeeded, so replicas that join or leave between pushes are simply in the next group or not:

1. the trainer starts a ``TCPStore`` (its master) on a free port and sends Open to every replica;
2. it writes, under the push's key, ``world_size`` and ``rank/<ticket hex>`` for each replica that answered a
   ticket (ranks 1..n in that order): a replica learns its rank from its own ticket, so one that failed Open, or
   does not exist, is never waited for;
3. every member builds the push's process group on that store and the trainer broadcasts bucket by bucket.

The backend travels in the group (``CollectiveGroup.backend``), so every member builds the same one: ``gloo`` (the
buckets in host memory; any device), ``nccl`` (CUDA) or ``hccl`` (Ascend, torch_npu's ``ProcessGroupHCCL``). The
trainer picks it from its device (:func:`trainer_backend`); a replica whose engine cannot run it refuses Open
(:func:`check_backend`: ``CollectiveUnavailable``, FAILED_PRECONDITION) and is left out of the group. On nccl/hccl
each bucket travels as a uint8 tensor on the device: the trainer copies it host -> device, a replica receives it on
its device and copies it device -> host to check its sha256 and parse it (the install then copies it back).

Failure: a member that dies mid-broadcast (kill -9 closes its sockets; a hung one trips the group's timeout) makes
the broadcast raise on the trainer within ``timeout_s``, never hang; the trainer aborts every ticket of the push
(``AbortWeightsTransfer``), so the survivors free their slot at once and keep serving their version, and the next
push forms a group of the survivors. Bytes a replica received are never installed unless every digest matches.

The replica's side is an engine's: the ``hf`` engine receives in the service process (:func:`receive_buckets`);
the ``vllm`` engine inside its worker, through vLLM's own weight-transfer API (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights`` per bucket, ``finish_weight_update`` at the commit), with a backend
registered in vLLM's ``WeightTransferEngineFactory`` (``services/rollout/vllm_transfer.py``) that uses the helpers
here. The bytes are not encrypted (like the data plane): off under TLS.
"""

from __future__ import annotations

import datetime
import hashlib
import secrets
import socket
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlhf.transport.weights.errors import CollectiveUnavailable, IncompleteUpdate
from rlhf.transport.weights.format import Manifest
from rlhf.transport.weights.receive import finish_bucket
from rlhf.v1 import weights_pb2

DEFAULT_TIMEOUT_S = 60.0
BACKENDS = ("gloo", "nccl", "hccl")
DEVICE_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}  # what a trainer on each device type picks
_BACKEND_DEVICE = {"nccl": "cuda", "hccl": "npu"}  # gloo: any device (the buckets stay in host memory)


def backend_for(device_type: str) -> str:
    """The collective backend of a device type: gloo on cpu, nccl on cuda, hccl on npu."""
    if device_type not in DEVICE_BACKEND:
        raise ValueError(f"no collective backend for device type {device_type!r} (known: {', '.join(DEVICE_BACKEND)})")
    return DEVICE_BACKEND[device_type]


def _missing(backend: str, device_type: str) -> str | None:
    """Why a process whose model is on ``device_type`` cannot run ``backend`` here; None when it can."""
    if backend not in BACKENDS:
        return f"unknown backend (known: {', '.join(BACKENDS)})"
    want = _BACKEND_DEVICE.get(backend)
    if want is None:
        return None
    if device_type != want:
        return f"{backend} needs a {want} device and this model is on {device_type}"
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.is_available()):
        return f"this torch ({torch.__version__}) has no usable NCCL/CUDA"
    if backend == "hccl":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return "torch_npu is not installed"
    return None


def check_backend(backend: str, device_type: str) -> None:
    """A replica, at Open: raise :class:`CollectiveUnavailable` (FAILED_PRECONDITION) unless its engine, whose model
    is on ``device_type``, can join a ``backend`` group; before anything is reserved."""
    why = _missing(backend, device_type)
    if why is not None:
        raise CollectiveUnavailable(
            f"this replica cannot join a {backend} weight group: {why}; push with RLHF_WEIGHTS_COLLECTIVE_BACKEND=gloo "
            "or RLHF_WEIGHTS_TRANSPORT=auto",
            field="group.backend",
        )


def trainer_backend(requested: str, device: torch.device) -> tuple[str, torch.device | None]:
    """The trainer's (backend, device of its buckets) for ``RLHF_WEIGHTS_COLLECTIVE_BACKEND`` = ``requested``:
    ``auto`` picks by the trainer's device; gloo sends from host memory (device None). Raises ValueError naming the
    variable when this process cannot run the backend."""
    backend = backend_for(device.type) if requested == "auto" else requested
    why = _missing(backend, device.type)
    if why is not None:
        raise ValueError(f"RLHF_WEIGHTS_COLLECTIVE_BACKEND={requested}: the trainer cannot run {backend}: {why}")
    return backend, None if backend == "gloo" else device


@dataclass(frozen=True)
class GroupSpec:
    """Where a push's group meets: the trainer's store and the push's key (sent in ``OpenWeightsTransfer``)."""

    address: str
    port: int
    key: str
    timeout_s: float = DEFAULT_TIMEOUT_S
    backend: str = "gloo"

    def to_proto(self) -> weights_pb2.CollectiveGroup:
        return weights_pb2.CollectiveGroup(address=self.address, port=self.port, key=self.key,
                                           timeout_seconds=self.timeout_s, backend=self.backend)  # fmt: skip

    @classmethod
    def from_proto(cls, g: weights_pb2.CollectiveGroup) -> GroupSpec:
        if not g.address or not 0 < g.port < 65536 or not g.key:
            raise ValueError("group: address, port and key are required")
        backend = g.backend or "gloo"  # a trainer from before the field sent none: it built gloo groups
        if backend not in BACKENDS:
            raise ValueError(f"group.backend {g.backend!r} is not one of {', '.join(BACKENDS)}")
        timeout = g.timeout_seconds if g.timeout_seconds > 0 else DEFAULT_TIMEOUT_S
        return cls(g.address, g.port, g.key, min(timeout, 600.0), backend)


def _timeout(spec: GroupSpec) -> datetime.timedelta:
    return datetime.timedelta(seconds=spec.timeout_s)


def _process_group(store: Any, rank: int, world_size: int, spec: GroupSpec, host: str) -> Any:
    prefixed = dist.PrefixStore(spec.key + "/pg/", store)
    if spec.backend == "nccl":
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = _timeout(spec)
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl)
    if spec.backend == "hccl":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # registered by torch_npu (Ascend images only)

        return ProcessGroupHCCL(prefixed, rank, world_size, _timeout(spec))
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _timeout(spec)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)


def close_group(pg: Any, spec: GroupSpec) -> None:
    """Free a finished push's group. NCCL/HCCL communicators hold device memory and threads until shut down (one
    group per push would leak them); a gloo group is freed with its last reference, as before."""
    if pg is None or spec.backend == "gloo":
        return
    try:
        pg.shutdown()
    except (RuntimeError, AttributeError) as err:  # a group that already failed; nothing more to free
        warnings.warn(f"closing the {spec.backend} weight group: {err}", RuntimeWarning, stacklevel=2)


def _sync(device: torch.device | None) -> None:
    """Wait for the device's queued work: a NCCL/HCCL ``wait()`` only orders the current stream after the
    collective, so the host waits here before the next bucket (one bucket on the device at a time)."""
    if device is not None:
        getattr(torch, device.type).synchronize(device)


def _broadcast(pg: Any, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (what a replica there can connect back to). A UDP
    ``connect`` sends nothing; it only picks the interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class TrainerGroup:
    """Rank 0 of one push: hosts the store, assigns ranks to the replicas that opened, broadcasts the buckets."""

    def __init__(
        self,
        address: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        backend: str = "gloo",
        device: torch.device | None = None,
    ):
        """``backend``: every member's process group (:data:`BACKENDS`); ``device``: where each bucket is copied
        before the broadcast (required for nccl/hccl, None for gloo: host memory)."""
        if (device is None) != (backend == "gloo"):
            raise ValueError(f"backend {backend} needs {'no device' if backend == 'gloo' else 'a device'}")
        self.device = device
        self.spec_store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
        self.spec = GroupSpec(address, self.spec_store.port, f"rlhf-weights-{secrets.token_hex(8)}", timeout_s,
                              backend)  # fmt: skip
        self._store = dist.PrefixStore(self.spec.key + "/", self.spec_store)
        self.pg: Any = None

    def admit(self, tickets: Sequence[bytes]) -> int:
        """Give ranks 1..n to the replicas holding ``tickets`` (those whose Open succeeded); returns the world
        size. Replicas wait for their rank on the store, so this releases them."""
        world = len(tickets) + 1
        self._store.set("world_size", str(world))
        for rank, ticket in enumerate(tickets, start=1):
            self._store.set(f"rank/{ticket.hex()}", str(rank))
        return world

    def broadcast(self, world: int, buckets: Iterable[bytes | memoryview]) -> None:
        """Blocking: form the group (every admitted replica joins within the timeout) and send every bucket (they
        may be made as they are asked for: a streamed push)."""
        self.pg = _process_group(self.spec_store, 0, world, self.spec, self.spec.address)
        for data in buckets:
            with warnings.catch_warnings():  # read-only bytes: broadcast reads them on rank 0, never writes
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(memoryview(data), dtype=torch.uint8)
            if self.device is not None:
                t = t.to(self.device)  # host -> device, one bucket at a time
            _broadcast(self.pg, t)
            _sync(self.device)

    def close(self) -> None:
        close_group(self.pg, self.spec)
        self.pg = None
        self.spec_store = None


def join_group(spec: GroupSpec, ticket: bytes) -> Any:
    """Blocking: wait for the rank the trainer gave ``ticket`` on the push's store and join the group."""
    client = dist.TCPStore(spec.address, spec.port, is_master=False, timeout=_timeout(spec))
    store = dist.PrefixStore(spec.key + "/", client)
    rank = int(store.get(f"rank/{ticket.hex()}"))
    world = int(store.get("world_size"))
    return _process_group(client, rank, world, spec, local_address_towards(spec.address))


def receive_bucket(
    pg: Any, index: int, nbytes: int, sha256: str, manifest: Manifest, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """Blocking: receive bucket ``index`` by broadcast into a buffer of its own, verify and parse it. ``device``
    (nccl/hccl): the bucket arrives in a device tensor and is copied to host memory for the sha256 and the parse."""
    buf = bytearray(nbytes)  # fresh: a thread cut off by a timeout never writes into reused memory
    host = torch.frombuffer(buf, dtype=torch.uint8)
    if device is None:
        _broadcast(pg, host)
    else:
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        _broadcast(pg, t)
        host.copy_(t)  # ordered after the collective on the current stream; a pageable copy waits for it
        del t
    return finish_bucket(index, buf, hashlib.sha256(buf).hexdigest(), sha256, manifest)


GROUP_ERRORS = (RuntimeError, ValueError, OSError, dist.DistError)


def receive_buckets(
    spec: GroupSpec,
    ticket: bytes,
    h: weights_pb2.WeightHeader,
    per_bucket: list,
    device: torch.device | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """Blocking (a replica's thread): join the push's group with the rank the trainer gave ``ticket``, receive every
    bucket (on ``device`` for nccl/hccl), verify and parse them. Raises IncompleteUpdate when the group fails (a
    member died, the timeout passed) and the errors of :func:`~rlhf.transport.weights.receive.finish_bucket`."""
    pg = None
    try:
        pg = join_group(spec, ticket)
        tensors: dict[str, torch.Tensor] = {}
        for i, b in enumerate(h.buckets):
            tensors.update(receive_bucket(pg, i, b.nbytes, b.sha256, per_bucket[i], device))
        return tensors, h.total_bytes
    except GROUP_ERRORS as err:
        raise IncompleteUpdate(
            f"the collective transfer failed ({type(err).__name__}: {err}); nothing was staged"
        ) from None
    finally:
        close_group(pg, spec)
