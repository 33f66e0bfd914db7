"""The collective weight path inside vLLM's worker: ``rlhf_collective``, a backend of vLLM's own weight-transfer API
(``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``),
registered by :func:`register` when vLLM imports the worker extension. It joins the trainer's per-push group of
:mod:`rlhf.transport.weights.collective`, checks each bucket without touching the model and loads at the commit;
updates the service already holds take the same calls with the bucket inline. Only plain values and bytes cross
vLLM's RPC (msgpack), never a pickle. Imported inside vLLM's worker process.

Design: docs/weight-sync.md#the-update and docs/weight-sync.md#collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from services.rollout.vllm_ties import retie_shared_weights

BACKEND = "rlhf_collective"


def register() -> None:
    """Add ``rlhf_collective`` to vLLM's factory (lazily, by module path; idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RlhfCollectiveWeightTransferEngine")


@dataclass
class CollectiveInitInfo:
    address: str
    port: int
    key: str
    ticket: str  # hex
    timeout_s: float = 60.0
    backend: str = "gloo"


@dataclass
class CollectiveBucketInfo:
    index: int
    nbytes: int
    sha256: str
    tensors: list = field(default_factory=list)  # [[name, safetensors dtype, shape], ...]
    device_digest: str = ""  # set instead of sha256: the bucket is checked on the worker's device and stays there
    discard: bool = False  # drop what is staged (an update that was never committed), so finish installs nothing
    # One bucket of weights the rollout service already holds (received over the TCP data plane or the gRPC stream),
    # handed over inside the swap gate instead of by broadcast and loaded at once: a safetensors file (vLLM's RPC
    # carries bytes intact), or in-process, where nothing is serialised, the (name, tensor) pairs themselves.
    data: bytes = b""
    items: list = field(default_factory=list)
    update_kind: str = "dense"  # vLLM 0.23's worker reads it off every update info


def _engine_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class RlhfCollectiveWeightTransferEngine(_engine_base()):  # type: ignore[misc]
    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveBucketInfo
    supports_draft_weight_update = False

    # The trainer side of vLLM's engines. vLLM 0.23's base (vllm-ascend's version set) declares both abstract, so a
    # class without them cannot be built and the Ascend worker's load_model fails; this backend is sent by the rlhf
    # trainer (rlhf.transport.weights.collective), never through vLLM's trainer API.
    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        raise NotImplementedError("rlhf_collective is sent by the rlhf trainer (rlhf.transport.weights.collective)")

    @staticmethod
    def trainer_init(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("rlhf_collective is sent by the rlhf trainer (rlhf.transport.weights.collective)")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM 0.32+: (config, vllm_config, device, model); 0.23: (config, parallel_config, model)
        super().__init__(*args, **kwargs)
        self.pg: Any = None
        self.spec: Any = None
        self.staged: dict[str, Any] = {}
        self.inplace = False  # a layer-wise load into the model is open (buckets handed over inline)

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        from rlhf.transport.weights.collective import GroupSpec, join_group

        self._close()  # a group left by an update that was never finished
        self.spec = GroupSpec(
            init_info.address, int(init_info.port), init_info.key, float(init_info.timeout_s), init_info.backend
        )
        self.pg = join_group(self.spec, bytes.fromhex(init_info.ticket), self._local_rank())

    def _local_rank(self) -> int:
        """This worker's index in its replica (tensor x pipeline parallel; vLLM's own NCCL engine offsets the
        trainer group's rank by the same); 0 where the engine has no parallel config."""
        return int(getattr(getattr(self, "parallel_config", None), "rank", 0) or 0)

    def start_weight_update(self) -> None:
        self._end_inplace()  # a load a failed session left open: end it, so the model runs and the next one starts
        self.staged = {}

    def receive_weights(self, info: CollectiveBucketInfo, load_weights: Any = None) -> None:
        """One bucket: broadcast from the push's group and staged (the model untouched until finish), or handed over
        inline (``data`` / ``items``) and loaded into the model now (inside the service's swap gate).

        ``load_weights`` is passed by vLLM 0.23's worker, which runs its own layer-wise reload around the update
        (``start_weight_update`` / ``finish_weight_update`` never reach the engine there): the weights go straight
        into it. The service only calls update_weights inside its swap gate on such a worker (see
        ``VllmEngine.receive_collective``)."""
        from rlhf.transport.weights.collective import receive_bucket
        from rlhf.transport.weights.format import load_safetensors

        if info.discard:
            self.staged = {}
            return
        if info.data or info.items:
            items = list(info.items) or list(load_safetensors(info.data).items())
            if load_weights is not None:
                load_weights(items)
            else:
                self._load_inplace(items)
            return
        if self.pg is None:
            raise RuntimeError("rlhf_collective: init_weight_transfer_engine must join the push's group first")
        manifest = {name: (dtype, tuple(int(d) for d in shape)) for name, dtype, shape in info.tensors}
        device = None if self.spec.backend == "gloo" else getattr(self, "device", None)  # the worker's own device
        tensors = receive_bucket(
            self.pg, int(info.index), int(info.nbytes), info.sha256, manifest, device, info.device_digest
        )
        if load_weights is not None:
            load_weights(list(tensors.items()))
            return
        self.staged.update(tensors)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        staged, self.staged = self.staged, {}
        self._close()  # one group per push

        loaded_inplace = self.inplace
        self._end_inplace()
        if not staged:  # loaded as it came, or a discarded update: nothing to install
            if loaded_inplace:
                retie_shared_weights(self.model)
            return
        reload_weights(self.vllm_config, self.model, iter(staged.items()), None, True)
        retie_shared_weights(self.model)  # a tied head's packed copy (services/rollout/vllm_ties.py)

    def _load_inplace(self, items: list) -> None:
        """Load one bucket into the model now (vLLM's layer-wise reload, opened at the session's first bucket)."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        from rlhf.transport.weights.pack import release_freed_memory

        with torch.no_grad():
            if not self.inplace:
                initialize_layerwise_reload(self.model)
                self.inplace = True
            self.model.load_weights(iter(items))
            _own_pending(self.model, items)
        del items
        release_freed_memory()  # the layers just processed freed their load-time copies: give them back now

    def _end_inplace(self) -> None:
        """Process the layers still waiting (and give layers that got nothing their tensors back): the model runs."""
        if not self.inplace:
            return
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        from rlhf.transport.weights.pack import release_freed_memory

        self.inplace = False
        with torch.no_grad():
            finalize_layerwise_reload(self.model, self.model_config)
        release_freed_memory()

    def _close(self) -> None:
        from rlhf.transport.weights.collective import close_group

        if self.pg is not None:
            close_group(self.pg, self.spec)
        self.pg = None

    def shutdown(self) -> None:
        self._close()
        self.staged = {}


def _own_pending(model: Any, items: list) -> None:
    """Layers still waiting for tensors of a later bucket (vLLM's layer-wise reload buffers a layer's loader calls
    until all its tensors are in) hold views of this bucket's buffer: give them copies, so the receiver can reuse
    the buffer as soon as this bucket is installed (else a layer spanning two buckets keeps a third buffer alive on
    the replica). Only the parts of unfinished layers are copied (a few tens of MB at most)."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for _, t in items if t.numel()]
    if not spans:
        return
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # pragma: no cover - a vLLM without layer-wise reload
        return
    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        for _, bound in getattr(info, "loaded_weights", None) or ():
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and not value.is_meta and lo <= value.data_ptr() < hi:
                    bound.arguments[key] = value.clone()


def engine_sessions() -> bool:
    """Whether vLLM's worker hands ``start_weight_update`` / ``finish_weight_update`` to the transfer engine (0.32+):
    then the engine can stage an update while the model generates and install it at the commit. vLLM 0.23's worker
    keeps the session to itself (its own layer-wise reload around every update_weights) and loads each update into
    the model as it arrives, so there every update call must run inside the swap gate. Decided by feature."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return "start_weight_update" in vars(WeightTransferEngine)
