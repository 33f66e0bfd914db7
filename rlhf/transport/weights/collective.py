"""Collective weight transfer: the trainer (rank 0) broadcasts the safetensors buckets to every replica at once.

The control stays the token-protected gRPC calls of the data plane (Open with a ``group``, then Commit); the group is
formed afresh for each push from the replicas whose Open succeeded, on the trainer's ``TCPStore``, with the backend
the trainer picks from its device (:func:`trainer_backend`: gloo, nccl, hccl) and a replica checks
(:func:`check_backend`). The trainer's side is :class:`TrainerGroup` (each step under a watchdog:
:class:`GroupTimeout`); a replica's is :func:`receive_buckets` (hf engine) or vLLM's worker
(``services/rollout/vllm_transfer.py``). Plaintext, like the data plane: off under TLS.
Design (ranks, backends, device digests, failure): docs/weight-sync.md#collective.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import math
import os
import secrets
import socket
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlhf.transport.weights.errors import CollectiveUnavailable, CorruptUpdate, IncompleteUpdate
from rlhf.transport.weights.format import Manifest
from rlhf.transport.weights.verify import finish_bucket, finish_device_bucket
from rlhf.v1 import weights_pb2

DEFAULT_TIMEOUT_S = 60.0
BACKENDS = ("gloo", "nccl", "hccl")
DEVICE_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}  # what a trainer on each device type picks
_BACKEND_DEVICE = {"nccl": "cuda", "hccl": "npu"}  # gloo: any device (the buckets stay in host memory)
# The trainer's watchdog fires this long after a step's ``timeout_s``: a backend that times out by itself (gloo, at
# ``timeout_s``) reports its own, more precise error first; the watchdog is for what no backend timeout covers.
WATCHDOG_GRACE_S = 2.0
# NCCL's own per-collective timeout is this much later than the watchdog's: its watchdog tears the process down by
# default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3), ours aborts the group and fails the push.
NCCL_TIMEOUT_GRACE_S = 30.0
MAX_RANKS_PER_REPLICA = 1024


class GroupTimeout(RuntimeError):
    """A step of the trainer's broadcast (forming the push's group, a bucket's broadcast) did not end within the
    group's timeout; the group was aborted."""


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
            import torch_npu  # noqa: F401, PLC0415 - optional dependency (Ascend images)
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
        return weights_pb2.CollectiveGroup(
            address=self.address, port=self.port, key=self.key, timeout_seconds=self.timeout_s, backend=self.backend
        )

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
        # Non-blocking communicator: NCCL's init (lazy, at the first collective) is then bounded by
        # TORCH_NCCL_NONBLOCKING_TIMEOUT (read once per process; default 30 min) and can be aborted
        # (NVIDIA/nccl#1677; a blocking init waits for a missing rank for ever, pytorch/pytorch#88103). Only this
        # group: the trainer's FSDP groups stay as they are. TORCH_NCCL_USE_COMM_NONBLOCKING=0 keeps it blocking
        # (pytorch/pytorch#153960: NCCL 2.26 could hang in non-blocking mode); the trainer's watchdog still bounds
        # the push.
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(math.ceil(spec.timeout_s)))
        nccl = dist.ProcessGroupNCCL.Options()
        nccl._timeout = datetime.timedelta(seconds=spec.timeout_s + WATCHDOG_GRACE_S + NCCL_TIMEOUT_GRACE_S)
        config = getattr(nccl, "config", None)
        blocking = os.environ.get("TORCH_NCCL_USE_COMM_NONBLOCKING", "").strip().lower() in ("0", "false", "no")
        if config is not None and hasattr(config, "blocking") and not blocking:
            config.blocking = 0
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, nccl)
    if spec.backend == "hccl":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # noqa: PLC0415 - torch_npu: Ascend images only

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


def abort_group(pg: Any) -> None:
    """Abort ``pg`` (best effort, from any thread): NCCL/HCCL abort their communicators, which ends a collective or
    a non-blocking init waiting on a missing member; gloo's abort does nothing (its own timeout ends its waits)."""
    if pg is None:
        return
    try:
        pg.abort()
    except Exception as err:  # noqa: BLE001 - a group that cannot be aborted: its thread is left to its timeout
        warnings.warn(f"aborting the weight group: {type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)


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


class _Watchdog:
    """One deadline at a time (:meth:`arm` / :meth:`disarm`); when one passes, ``expire(what)`` is called once, in the
    watchdog's thread, and the watchdog stops."""

    def __init__(self, seconds: float, expire: Callable[[str], None]):
        self.seconds = seconds
        self._expire = expire
        self._cv = threading.Condition()
        self._what: str | None = None
        self._deadline = 0.0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="weights-group-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str) -> None:
        with self._cv:
            self._what, self._deadline = what, time.monotonic() + self.seconds
            self._cv.notify()

    def disarm(self) -> None:
        with self._cv:
            self._what = None
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while True:
                if self._stopped:
                    return
                if self._what is None:
                    self._cv.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cv.wait(left)
                    continue
                what, self._stopped = self._what, True
                break
        self._expire(what)


class TrainerGroup:
    """Rank 0 of one push: hosts the store, assigns ranks to the replicas that opened, broadcasts the buckets.

    Every step of :meth:`broadcast` (forming the group; each bucket's broadcast, the first of which forms NCCL's
    communicator) must end within ``timeout_s`` (+ :data:`WATCHDOG_GRACE_S`): else a watchdog aborts the group, and
    the broadcast raises :class:`GroupTimeout`. :meth:`run` runs it in a thread of its own and fails its future at
    that moment even when the blocked call does not return (a blocking communicator init ignores abort).
    """

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
        self.spec_store = dist.TCPStore(
            address, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.spec = GroupSpec(address, self.spec_store.port, f"rlhf-weights-{secrets.token_hex(8)}", timeout_s, backend)
        self._store = dist.PrefixStore(self.spec.key + "/", self.spec_store)
        self.pg: Any = None
        self.world = 0
        self.failure: GroupTimeout | None = None  # set by the watchdog
        self._lock = threading.Lock()
        self._watchdog: _Watchdog | None = None
        self._future: Future | None = None
        self._running = False  # run()'s thread is inside the broadcast

    def admit(self, tickets: Sequence[bytes], ranks: Sequence[int] | None = None) -> int:
        """Give the replicas holding ``tickets`` (those whose Open succeeded) their ranks, from 1 in that order:
        ``ranks[i]`` consecutive ones to the i-th (the processes it receives in, reported at Open; default one
        each). Returns the world size, 1 + the sum. Replicas wait for their rank on the store, so this releases
        them."""
        counts = [1] * len(tickets) if ranks is None else [int(n) for n in ranks]
        if len(counts) != len(tickets) or not all(1 <= n <= MAX_RANKS_PER_REPLICA for n in counts):
            raise ValueError(f"admit: one rank count in 1..{MAX_RANKS_PER_REPLICA} per ticket, not {list(counts)}")
        world = 1 + sum(counts)
        self._store.set("world_size", str(world))
        first = 1
        for ticket, n in zip(tickets, counts, strict=True):
            self._store.set(f"ranks/{ticket.hex()}", str(n))  # before the rank, which releases the replica
            self._store.set(f"rank/{ticket.hex()}", str(first))
            first += n
        self.world = world
        return world

    def broadcast(self, world: int, buckets: Iterable[bytes | memoryview]) -> None:
        """Blocking: form the group (every admitted replica joins within the timeout) and send every bucket (they
        may be made as they are asked for: a streamed push). Each step runs under the watchdog (the making of a
        bucket does not: it is the trainer's own work); one that overruns raises :class:`GroupTimeout`."""
        self.world = world
        with self._step("forming the group"):
            self.pg = _process_group(self.spec_store, 0, world, self.spec, self.spec.address)
        for i, data in enumerate(buckets):
            if isinstance(data, torch.Tensor):  # packed on the device (copy_weights(device=...)): sent as it is
                t = data
            else:
                with warnings.catch_warnings():  # read-only bytes: broadcast reads them on rank 0, never writes
                    warnings.simplefilter("ignore", UserWarning)
                    t = torch.frombuffer(memoryview(data), dtype=torch.uint8)
            # the first collective forms NCCL's communicator: every admitted rank must have joined by then
            with self._step("forming the communicator and broadcasting bucket 0" if i == 0 else f"bucket {i}"):
                if self.device is not None and t.device != self.device:
                    t = t.to(self.device)  # host -> device, one bucket at a time
                _broadcast(self.pg, t)
                _sync(self.device)

    @contextlib.contextmanager
    def _step(self, what: str) -> Iterator[None]:
        # a fresh exception each time: a raised one holds this frame (and the group, and its sockets) in its traceback
        if self.failure is not None:
            raise GroupTimeout(str(self.failure))
        if self._watchdog is None:
            self._watchdog = _Watchdog(self.spec.timeout_s + WATCHDOG_GRACE_S, self._expire)
        self._watchdog.arm(what)
        try:
            yield
        except GROUP_ERRORS as err:
            if self.failure is not None:  # the abort ended the blocked call: report why
                raise GroupTimeout(str(self.failure)) from err
            raise
        finally:
            self._watchdog.disarm()
        if self.failure is not None:
            raise GroupTimeout(str(self.failure))

    def _expire(self, what: str) -> None:
        """The watchdog: ``what`` overran. Record why, fail :meth:`run`'s future at once, abort the group."""
        self.failure = GroupTimeout(
            f"the {self.spec.backend} weight group (world {self.world}) did not finish {what} within "
            f"{self.spec.timeout_s:g} s (the push's group timeout): a replica that took a ticket never joined the "
            "group, or stopped receiving; the group was aborted"
        )
        self._settle(GroupTimeout(str(self.failure)))  # the failure itself is never raised: it holds no frames
        abort_group(self.pg)

    def _settle(self, error: BaseException | None) -> None:
        with self._lock:
            fut = self._future
            if fut is not None and not fut.done():
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)

    def run(self, work: Callable[[], None]) -> Future:
        """Run ``work`` (which calls :meth:`broadcast`) in a thread of its own. The future ends with it, or with
        :class:`GroupTimeout` as soon as the watchdog fires: a blocked call that the abort does not end (a blocking
        NCCL init) is left behind in its thread, and the push fails on time."""
        fut: Future = Future()
        self._future = fut

        def target() -> None:
            error: BaseException | None = None
            try:
                work()
            except BaseException as err:  # noqa: BLE001 - handed to the future
                # The broadcast's frames hold the group: without their locals, the group is freed at close() and
                # its gloo sockets close at once, so the members still receiving fail now, not at their timeout.
                traceback.clear_frames(err.__traceback__)
                error = err
            finally:
                self._running = False
            self._settle(GroupTimeout(str(self.failure)) if self.failure is not None else error)
            del error  # the future holds it (and its traceback) until close()

        self._running = True
        threading.Thread(target=target, name="weights-broadcast", daemon=True).start()
        return fut

    def close(self) -> None:
        """Free the group (abort it while the broadcast is still blocked) and the store. The future's error holds
        the broadcast's frames (the group's sockets among them) in its traceback: it is dropped here, so a failed
        group's sockets close now, and its surviving members' receives fail at once instead of at their timeout."""
        self._future = None
        if self._watchdog is not None:
            self._watchdog.stop()
        if self._running:  # the broadcast is still blocked (timed out, or the push was cancelled): end it
            abort_group(self.pg)  # shutting the group down could block as long as the broadcast
        else:
            close_group(self.pg, self.spec)
        self.pg = None
        self.spec_store = None


def join_group(spec: GroupSpec, ticket: bytes, local_rank: int = 0) -> Any:
    """Blocking: wait for the rank the trainer gave ``ticket`` on the push's store and join the group. A replica that
    receives in several processes (vLLM workers under tensor/pipeline parallelism: it reported how many at Open)
    joins from each with ``local_rank`` = the process's index (vLLM's ``parallel_config.rank``), taking the
    trainer's first rank for the ticket plus it."""
    client = dist.TCPStore(spec.address, spec.port, is_master=False, timeout=_timeout(spec))
    store = dist.PrefixStore(spec.key + "/", client)
    first = int(store.get(f"rank/{ticket.hex()}"))
    world = int(store.get("world_size"))
    if local_rank:
        key = f"ranks/{ticket.hex()}"  # written before rank/: present unless the trainer predates it (one rank)
        admitted = int(store.get(key)) if store.check([key]) else 1
        if not 0 < local_rank < admitted:
            raise ValueError(
                f"this process is rank {local_rank} of its replica and the trainer admitted {admitted} rank(s) for "
                "the replica's ticket: the replica's Open reported fewer processes than join, or the trainer "
                "predates multi-rank replicas (OpenWeightsTransferResponse.ranks)"
            )
    return _process_group(client, first + local_rank, world, spec, local_address_towards(spec.address))


def receive_bucket(
    pg: Any,
    index: int,
    nbytes: int,
    sha256: str,
    manifest: Manifest,
    device: torch.device | None = None,
    device_digest: str = "",
) -> dict[str, torch.Tensor]:
    """Blocking: receive bucket ``index`` by broadcast into a buffer of its own, verify and parse it. ``device``
    (nccl/hccl): the bucket arrives in a device tensor; with its ``device_digest`` (a trainer that packed it on its
    device) it is checked there and its tensors are views of it, never copied to the host; with a sha256 (a trainer
    that packed it in host memory) it is copied to the host for the sha256 and the parse."""
    if device_digest:
        t = torch.empty(nbytes, dtype=torch.uint8, device=device or "cpu")  # fresh, as below
        _broadcast(pg, t)
        _sync(device)
        return finish_device_bucket(index, t, device_digest, manifest)
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
    member died, the timeout passed) and the errors of :func:`~rlhf.transport.weights.verify.finish_bucket`."""
    pg = None
    try:
        pg = join_group(spec, ticket)
        tensors: dict[str, torch.Tensor] = {}
        refused: CorruptUpdate | None = None
        for i, b in enumerate(h.buckets):
            try:
                got = receive_bucket(pg, i, b.nbytes, b.sha256, per_bucket[i], device, b.device_digest)
            except CorruptUpdate as err:
                # keep receiving (and dropping) the rest: rank 0 sends every bucket to every member, and a member
                # that left would hold the whole push up until the group's timeout
                refused, tensors = refused or err, {}
                continue
            if refused is None:
                tensors.update(got)
        if refused is not None:
            raise refused
        return tensors, h.total_bytes
    except GROUP_ERRORS as err:
        raise IncompleteUpdate(
            f"the collective transfer failed ({type(err).__name__}: {err}); nothing was staged"
        ) from None
    finally:
        close_group(pg, spec)
