"""The collective weight path inside vLLM's worker: a backend of vLLM's own weight-transfer API.

vLLM drives weight updates through ``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` on an engine it builds from ``WeightTransferConfig(backend=...)`` with its
``WeightTransferEngineFactory``. vLLM 0.32 ships NCCL, IPC and other GPU backends; this module registers ``rlhf_gloo``
(:func:`register`, called when vLLM imports the worker extension), which joins the trainer's per-push gloo group of
:mod:`rlhf.transport.weights.collective`:

- ``init_weight_transfer_engine({"address", "port", "key", "timeout_s", "ticket"})``: join the push's group (the rank
  comes from the trainer's store, keyed by this replica's ticket);
- ``start_weight_update()``: forget anything staged before; the model is not touched;
- ``update_weights({"index", "nbytes", "sha256", "tensors": [[name, dtype, shape], ...]})`` per bucket: receive the
  bucket by broadcast into host memory and check its sha256 and content (the header was checked against the model
  by the service before Open answered); still nothing touches the model, so a broadcast that fails leaves it whole;
- ``finish_weight_update()`` (at CommitWeights, inside the engine's swap gate): load the staged tensors with vLLM's
  in-place ``reload_weights`` (checkpoint format: the CPU backend's repacked layers are rebuilt), then drop them.

Only plain values cross vLLM's RPC (msgpack); the bytes never do. Imported inside vLLM's worker process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BACKEND = "rlhf_gloo"


def register() -> None:
    """Add ``rlhf_gloo`` to vLLM's factory (lazily, by module path; idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "RlhfGlooWeightTransferEngine")


@dataclass
class GlooInitInfo:
    address: str
    port: int
    key: str
    ticket: str  # hex
    timeout_s: float = 60.0


@dataclass
class GlooBucketInfo:
    index: int
    nbytes: int
    sha256: str
    tensors: list = field(default_factory=list)  # [[name, safetensors dtype, shape], ...]
    discard: bool = False  # drop what is staged (an update that was never committed), so finish installs nothing


def _engine_base() -> type:
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    return WeightTransferEngine


class RlhfGlooWeightTransferEngine(_engine_base()):  # type: ignore[misc]
    init_info_cls = GlooInitInfo
    update_info_cls = GlooBucketInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.pg: Any = None
        self.staged: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        from rlhf.transport.weights.collective import GroupSpec, join_group

        spec = GroupSpec(init_info.address, int(init_info.port), init_info.key, float(init_info.timeout_s))
        self.pg = join_group(spec, bytes.fromhex(init_info.ticket))

    def start_weight_update(self) -> None:
        self.staged = {}

    def receive_weights(self, info: GlooBucketInfo) -> None:
        from rlhf.transport.weights.collective import receive_bucket

        if info.discard:
            self.staged = {}
            return
        if self.pg is None:
            raise RuntimeError("rlhf_gloo: init_weight_transfer_engine must join the push's group first")
        manifest = {name: (dtype, tuple(int(d) for d in shape)) for name, dtype, shape in info.tensors}
        self.staged.update(receive_bucket(self.pg, int(info.index), int(info.nbytes), info.sha256, manifest))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        staged, self.staged = self.staged, {}
        self.pg = None  # one group per push
        if not staged:  # a discarded update: nothing to install
            return
        reload_weights(self.vllm_config, self.model, iter(staged.items()), None, True)

    def shutdown(self) -> None:
        self.pg, self.staged = None, {}
