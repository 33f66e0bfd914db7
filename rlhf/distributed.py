"""The trainer's data-parallel group: torch.distributed set up from the torchrun environment, FSDP2 sharding, and the
few collectives the trainer needs (tensors only: nothing crosses processes by pickle).

World size 1 means no process group at all (:func:`init_from_env` returns None). A world-N update equals the world-1
update on the same batch: each rank runs its share of a minibatch's rows, :func:`gather_rows` gathers the per-token
outputs (its own share keeps its autograd graph), and the caller scales the loss by :func:`backward_scale`.

Design: docs/training.md#multi-process-training-fsdp2-under-torchrun.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger("rlhf.distributed")

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class Group:
    """This process's place in the trainer group."""

    rank: int
    world_size: int
    local_rank: int
    backend: str

    @property
    def is_driver(self) -> bool:
        """Rank 0 drives the ring (Redis, gRPC/HTTP, ledger, checkpoints); the others follow it."""
        return self.rank == 0


def world_size_from_env() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as err:
        raise ValueError(f"WORLD_SIZE must be an integer, got {os.environ['WORLD_SIZE']!r}") from err


def backend_for(device_type: str) -> str:
    try:
        return BACKENDS[device_type]
    except KeyError:
        raise ValueError(f"no distributed backend for device {device_type!r} (known: {sorted(BACKENDS)})") from None


RENDEZVOUS_TIMEOUT_S = 300.0  # how long the ranks wait for each other to join (torch's default store timeout)


def init_from_env(device: torch.device, timeout_s: float) -> Group | None:
    """Join the group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``), with the
    backend of ``device`` and a collective timeout of ``timeout_s`` (a rank that hangs in a collective fails instead
    of blocking the group forever). None at world size 1. Idempotent: a second call returns the same group.

    Joining is not a collective: a rank that starts late (importing torch on a loaded machine, loading a model) is
    waited for up to ``RENDEZVOUS_TIMEOUT_S`` even when ``timeout_s`` is shorter; ``timeout_s`` applies from then on."""
    world = world_size_from_env()
    if world <= 1:
        return None
    backend = backend_for(device.type)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        elif device.type == "npu":
            torch.npu.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S)))
        if timeout_s < RENDEZVOUS_TIMEOUT_S:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))
    return Group(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), backend)


def shard(model: torch.nn.Module, bf16: bool, device: torch.device) -> torch.nn.Module:
    """FSDP2 (``fully_shard``) over each decoder layer, then the whole model: parameters, gradients and the AdamW
    state built on them are split across ranks. With ``bf16`` FSDP2's mixed-precision policy computes in bf16 and
    reduces gradients in fp32 over the fp32 sharded master weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415 - seconds to import; trainer groups only

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kw = {"mp_policy": mp} if mp is not None else {}
    layers = getattr(getattr(model, "model", None), "layers", None)
    for layer in layers or []:
        fully_shard(layer, **kw)
    head = getattr(model, "score", None)
    if isinstance(head, torch.nn.Module):
        # a critic/reward model: models.score_head_outputs calls its backbone and its head directly, not the
        # model's forward, so each must be a unit of its own (a unit's parameters are gathered by its own forward)
        fully_shard(getattr(model, model.base_model_prefix), **kw)
        fully_shard(head, **kw)
    fully_shard(model, **kw)
    return model


def load_sharded(
    build_empty: Callable[[], torch.nn.Module],
    load_full: Callable[[], torch.nn.Module],
    prepare: Callable[[torch.nn.Module], None],
    bf16: bool,
    device: torch.device,
    group: Group,
) -> torch.nn.Module:
    """An FSDP2-sharded model whose whole weights only rank 0 ever holds, and in host memory: every rank builds the
    model on the meta device (``build_empty``: no memory), ``prepare``s it (train mode, dropout off, activation
    checkpointing) and shards it, then allocates its own shards on ``device``; rank 0 loads the checkpoint on the CPU
    (``load_full``) and torch's ``set_model_state_dict(broadcast_from_rank0=True)`` sends each tensor to every rank,
    which keeps its shard. A rank's device then holds its shards only, never the whole fp32 model (32 GB for 8B).
    Buffers outside the state dict (rotary ``inv_freq``, computed at init, left uninitialised by ``to_empty``) come
    from rank 0's model too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict  # noqa: PLC0415 - seconds to import; trainer groups only

    with torch.device("meta"):
        model = build_empty()
    prepare(model)
    shard(model, bf16, device)
    model.to_empty(device=device)
    full = load_full() if group.is_driver else None
    set_model_state_dict(
        model,
        full.state_dict() if full is not None else {},
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    persistent = set(model.state_dict())
    names = [name for name, _ in model.named_buffers() if name not in persistent]
    values = broadcast_tensors([full.get_buffer(n) for n in names] if full is not None else None, len(names), device)
    for name, value in zip(names, values, strict=True):
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner).register_buffer(attr, value.to(device), persistent=False)
    del full
    return model


def shares(n: int, world: int) -> list[tuple[int, int]]:
    """Contiguous, balanced [start, stop) row ranges of ``n`` rows, one per rank (the first ``n % world`` ranks get
    one row more)."""
    base, extra = divmod(n, world)
    out, start = [], 0
    for r in range(world):
        stop = start + base + (1 if r < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def local_rows(n: int, group: Group) -> slice:
    """This rank's rows of an ``n``-row minibatch. A rank whose share is empty still runs the model on one row (FSDP2
    needs every rank in every forward and backward): :func:`gather_rows` drops it."""
    start, stop = shares(n, group.world_size)[group.rank]
    return slice(start, stop) if stop > start else slice(0, min(n, 1))


def gather_rows(local: torch.Tensor, n: int, group: Group) -> torch.Tensor:
    """The ``n`` rows of a minibatch from each rank's share (``local``: this rank's rows, as :func:`local_rows` gave
    them). Other ranks' rows arrive detached; this rank's rows keep their graph, so backward through the result
    reaches only this rank's forward."""
    sh = shares(n, group.world_size)
    width = max(stop - start for start, stop in sh)
    placeholder = sh[group.rank][0] == sh[group.rank][1]
    own = local[:0] if placeholder else local
    buf = torch.zeros((width, *local.shape[1:]), dtype=local.dtype, device=local.device)
    buf[: own.shape[0]] = own.detach()
    parts = [torch.empty_like(buf) for _ in range(group.world_size)]
    dist.all_gather(parts, buf)
    pieces = [own if r == group.rank else parts[r][: stop - start] for r, (start, stop) in enumerate(sh)]
    return torch.cat(pieces, dim=0)


def backward_scale(group: Group | None) -> int:
    """The factor on the loss before backward: FSDP2 averages gradients over ranks, the parts must be summed."""
    return 1 if group is None else group.world_size


def full_value(x) -> torch.Tensor:
    """A DTensor's full value (a gathered norm, a parameter); a plain tensor as is."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


# ------------------------------------------------------------------ rank 0 -> followers, tensors only
_DTYPES = [torch.int64, torch.float32, torch.bool, torch.bfloat16, torch.uint8, torch.int32]


def broadcast_ints(values: list[int] | None, count: int, device: torch.device) -> list[int]:
    """``count`` integers from rank 0 (``values`` there, None elsewhere) to every rank."""
    t = torch.tensor(values, dtype=torch.int64) if values is not None else torch.zeros(count, dtype=torch.int64)
    t = t.to(device)
    dist.broadcast(t, src=0)
    return t.tolist()


def broadcast_tensors(tensors: list[torch.Tensor] | None, count: int, device: torch.device) -> list[torch.Tensor]:
    """``count`` tensors of any shape from rank 0 to every rank: a header of (dtype, ndim, shape) integers, then
    each tensor's data."""
    max_dims = 4
    header = None
    if tensors is not None:
        header = []
        for t in tensors:
            if t.dim() > max_dims:
                raise ValueError(f"broadcast_tensors: {t.dim()} dimensions, at most {max_dims}")
            header += [_DTYPES.index(t.dtype), t.dim(), *t.shape, *([0] * (max_dims - t.dim()))]
    header = broadcast_ints(header, count * (2 + max_dims), device)
    out = []
    for i in range(count):
        code, ndim, *shape = header[i * (2 + max_dims) : (i + 1) * (2 + max_dims)]
        dtype = _DTYPES[code]
        wire = torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool collectives
        if tensors is not None:
            t = tensors[i].to(device=device, dtype=wire).contiguous()
        else:
            t = torch.empty(shape[:ndim], dtype=wire, device=device)
        if t.numel():
            dist.broadcast(t, src=0)
        out.append(t.to(dtype))
    return out


def broadcast_text(text: str | None, device: torch.device) -> str:
    """A string (a checkpoint path) from rank 0 to every rank, as UTF-8 bytes in a tensor."""
    data = None if text is None else torch.tensor(list(text.encode()), dtype=torch.uint8)
    (n,) = broadcast_ints(None if data is None else [data.numel()], 1, device)
    if data is None:
        data = torch.zeros(n, dtype=torch.uint8)
    data = data.to(device)
    if n:
        dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).decode()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def destroy(wait_for_peers: bool = False) -> None:
    """Leave the group. With ``wait_for_peers`` (only where every rank calls it) first wait for the other ranks, so
    none tears gloo down while a peer is still in a collective (bounded by the group's timeout; a peer that is gone
    does not stop the teardown). Garbage that still holds collective work is freed while the interpreter is fully
    alive: gloo work objects left to interpreter finalization can abort the process (pytorch#179291); a test group
    died once in CI with "terminate called without an active exception"."""
    if not dist.is_initialized():
        return

    if wait_for_peers:
        try:
            dist.barrier()
        except RuntimeError as err:
            log.warning("leaving the group without the other ranks: %s", err)
    gc.collect()
    dist.destroy_process_group()
