"""The collective weight path inside vLLM's worker: a backend of vLLM's own weight-transfer API.

vLLM drives weight updates through ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` on an engine it builds from ``WeightTransferConfig(backend=...)`` with its
``WeightTransferEngineFactory``. vLLM 0.32 ships NCCL, IPC and other GPU backends; this module registers
``rlhf_collective`` (:func:`register`, called when vLLM imports the worker extension), which joins the trainer's
per-push group of :mod:`rlhf.transport.weights.collective` with the backend the push names (gloo, nccl, hccl):

- ``init_weight_transfer_engine({"address", "port", "key", "timeout_s", "ticket", "backend"})``: join the push's
  group (the rank comes from the trainer's store, keyed by this replica's ticket); nccl/hccl on the worker's device;
- ``start_weight_update()``: forget anything staged before; the model is not touched;
- ``update_weights({"index", "nbytes", "sha256", "tensors": [[name, dtype, shape], ...]})`` per bucket: receive the
  bucket by broadcast (on the device for nccl/hccl, then copied to host memory) and check its sha256 and content
  (the header was checked against the model by the service before Open answered); still nothing touches the model,
  so a broadcast that fails leaves it whole;
- ``finish_weight_update()`` (at CommitWeights, inside the engine's swap gate): load the staged tensors with vLLM's
  in-place ``reload_weights`` (checkpoint format: the CPU backend's repacked layers are rebuilt), then drop them.

Weights the service already holds (the TCP data plane, the gRPC stream) take the same calls inside the swap gate,
the update's bytes inline (``update_weights({"index": 0, ..., "data": <safetensors bytes>})``). vLLM 0.23's worker
(vllm-ascend's version set) runs the session itself and hands each update's ``load_weights`` to the engine, which
then loads at once (:func:`engine_sessions` tells the two apart; the service keeps every call of such a worker
inside the gate).

Why not vLLM's own ``nccl`` engine on CUDA: it broadcasts tensor by tensor straight into the model's load path, so
a broadcast cut half-way leaves the model half updated, and it checks no digest; this path keeps the replica's
rule (every bucket's sha256 against the header sent over authenticated gRPC, the old weights serve on any failure)
on every backend, and the trainer's group is the same for hf and vLLM replicas.

Only plain values and bytes cross vLLM's RPC (msgpack), never a pickle. Imported inside vLLM's worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    discard: bool = False  # drop what is staged (an update that was never committed), so finish installs nothing
    # Weights the rollout service already holds (received over the TCP data plane or the gRPC stream), handed over
    # inside the swap gate instead of by broadcast, as one safetensors file (vLLM's RPC carries bytes intact).
    data: bytes = b""
    update_kind: str = "dense"  # vLLM 0.23's worker reads it off every update info


def _engine_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class RlhfCollectiveWeightTransferEngine(_engine_base()):  # type: ignore[misc]
    init_info_cls = CollectiveInitInfo
    update_info_cls = CollectiveBucketInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM 0.32+: (config, vllm_config, device, model); 0.23: (config, parallel_config, model)
        super().__init__(*args, **kwargs)
        self.pg: Any = None
        self.spec: Any = None
        self.staged: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: CollectiveInitInfo) -> None:
        from rlhf.transport.weights.collective import GroupSpec, join_group

        self._close()  # a group left by an update that was never finished
        self.spec = GroupSpec(init_info.address, int(init_info.port), init_info.key, float(init_info.timeout_s),
                              init_info.backend)  # fmt: skip
        self.pg = join_group(self.spec, bytes.fromhex(init_info.ticket))

    def start_weight_update(self) -> None:
        self.staged = {}

    def receive_weights(self, info: CollectiveBucketInfo, load_weights: Any = None) -> None:
        """Stage one bucket: broadcast from the push's group, or handed over whole (``data``).

        ``load_weights`` is passed by vLLM 0.23's worker, which runs its own layer-wise reload around the update
        (``start_weight_update`` / ``finish_weight_update`` never reach the engine there): the weights go straight
        into it. The service only calls update_weights inside its swap gate on such a worker (see
        ``VllmEngine.receive_collective``)."""
        from rlhf.transport.weights.collective import receive_bucket
        from rlhf.transport.weights.format import load_safetensors

        if info.discard:
            self.staged = {}
            return
        if info.data:
            tensors = load_safetensors(info.data)
        else:
            if self.pg is None:
                raise RuntimeError("rlhf_collective: init_weight_transfer_engine must join the push's group first")
            manifest = {name: (dtype, tuple(int(d) for d in shape)) for name, dtype, shape in info.tensors}
            device = None if self.spec.backend == "gloo" else getattr(self, "device", None)  # the worker's own device
            tensors = receive_bucket(self.pg, int(info.index), int(info.nbytes), info.sha256, manifest, device)
        if load_weights is not None:
            load_weights(list(tensors.items()))
            return
        self.staged.update(tensors)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        staged, self.staged = self.staged, {}
        self._close()  # one group per push
        if not staged:  # a discarded update: nothing to install
            return
        reload_weights(self.vllm_config, self.model, iter(staged.items()), None, True)

    def _close(self) -> None:
        from rlhf.transport.weights.collective import close_group

        if self.pg is not None:
            close_group(self.pg, self.spec)
        self.pg = None

    def shutdown(self) -> None:
        self._close()
        self.staged = {}


def engine_sessions() -> bool:
    """Whether vLLM's worker hands ``start_weight_update`` / ``finish_weight_update`` to the transfer engine (0.32+):
    then the engine can stage an update while the model generates and install it at the commit. vLLM 0.23's worker
    keeps the session to itself (its own layer-wise reload around every update_weights) and loads each update into
    the model as it arrives, so there every update call must run inside the swap gate. Decided by feature."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return "start_weight_update" in vars(WeightTransferEngine)
