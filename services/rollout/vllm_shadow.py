"""Staged weight swaps inside a vLLM worker: an update loads into a second copy of the model while the live copy
keeps generating, and the two trade places between two engine steps.

vLLM's in-place ``reload_weights`` (0.32) cannot run while the model generates: its layer-wise reload moves each
serving layer's tensors to the meta device, materialises fresh ones, runs the checkpoint loader and the backend's
post-load processing (the CPU backend's oneDNN repacking), then copies the result back. Loading the 104M policy of
``bench.weight_sync`` that way kept generation stopped for 0.29 of the transfer time. Here the same loader runs on
a *shadow* model instead, outside the rollout service's swap gate:

- the shadow is a deep copy of the live model made at the first update, except for the layers that hold the KV
  cache (the values of ``compilation_config.static_forward_context``: attention, mamba), which stay where they are
  and are stood in for by empty placeholders; vLLM's per-layer reload records are copied with it, bound to the
  shadow's layers;
- :meth:`ShadowSwap.stage` loads an update (checkpoint format: Hugging Face names) into the shadow on a thread of
  its own: vLLM's layer-wise reload (``initialize_layerwise_reload`` / ``load_weights`` / ``finalize``) on the
  shadow's layers only, so the live model, its KV-cache layers and every in-flight request are untouched. An update
  that does not cover every parameter is refused (the shadow holds an older version for whatever it misses);
- :meth:`ShadowSwap.swap` (on the engine's own thread, between two steps, inside the gate) moves the KV-cache layers
  into the shadow's tree, points the model runner (and the weight-transfer engine) at it and keeps the old live
  model as the next shadow: O(layers), no tensor is copied.

The cost is a second copy of the weights in the worker's memory. The swap changes which module object the runner
calls, so it needs eager execution (CUDA graphs capture the live tensors' addresses: ``enforce_eager: false`` is
refused by the config) and no LoRA or speculative decoding (:func:`supported`).

Imported inside vLLM's worker (by the worker extension's methods), so vLLM itself is imported only in functions.
"""

from __future__ import annotations

import copy
import threading
import time
import types
from typing import Any

import torch


class StagingError(RuntimeError):
    """An update could not be loaded into the shadow; the live model is unchanged."""


class _Vacant(torch.nn.Module):
    """Stands in the shadow's tree for a KV-cache layer that stays with the live model until the swap."""


def supported(worker: Any) -> tuple[bool, str]:
    """Whether this worker can stage swaps, and why not."""
    cfg = getattr(worker, "vllm_config", None)
    if cfg is None or not hasattr(worker, "model_runner"):
        return False, "not a vLLM model worker"
    try:
        from vllm.model_executor.model_loader.reload import layerwise  # noqa: F401
    except ImportError:
        return False, "this vLLM has no layer-wise reload (model_loader.reload.layerwise)"
    if getattr(cfg, "lora_config", None) is not None:
        return False, "LoRA adapters wrap the model's layers"
    if getattr(cfg, "speculative_config", None) is not None:
        return False, "a speculative drafter shares the model"
    if not cfg.model_config.enforce_eager:
        return False, "CUDA graphs / compilation capture the live tensors (enforce_eager is off)"
    model = worker.model_runner.get_model()
    if not hasattr(model, "load_weights"):
        return False, f"{type(model).__name__} has no load_weights"
    return True, ""


def _kv_layer_names(model: Any, vllm_config: Any) -> list[str]:
    held = {id(m) for m in vllm_config.compilation_config.static_forward_context.values()}
    return [name for name, m in model.named_modules() if id(m) in held]


def _parent(model: Any, name: str) -> tuple[Any, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _retarget(meta: Any, src: Any, dst: Any) -> Any:
    """A copy of a reload record's meta tensor whose weight-loader methods are bound to ``dst`` instead of ``src``
    (vLLM binds them to its layer when it restores the layer, and the records are per layer)."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    t = meta.data.to("meta")
    t.__class__ = meta.__class__
    attrs = dict(meta.__dict__)
    for key, value in attrs.items():
        if isinstance(value, types.MethodType) and (value.__self__ is src or value.__self__ is layer_ref_sentinel):
            attrs[key] = value.__func__.__get__(dst)
    t.__dict__ = attrs
    return t


class ShadowSwap:
    """One worker's shadow model and the update staged in it (see the module docstring)."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.shadow: Any = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._staged: str | None = None  # the id of the update the shadow holds, once fully loaded
        self._seconds = 0.0

    # ------------------------------------------------------------------ making the shadow

    def _make_shadow(self, live: Any) -> Any:
        from vllm.distributed import parallel_state
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

        cfg = self.worker.vllm_config
        kv_names = set(_kv_layer_names(live, cfg))
        memo: dict[int, Any] = {id(cfg): cfg}  # the config and the process groups are shared, never copied
        for group in vars(parallel_state).values():
            if isinstance(group, parallel_state.GroupCoordinator):
                memo[id(group)] = group
        for name in kv_names:
            memo[id(live.get_submodule(name))] = _Vacant()
        with torch.no_grad():
            shadow = copy.deepcopy(live, memo)
        shadow_modules = dict(shadow.named_modules())
        for name, layer in live.named_modules():
            info = LAYERWISE_INFO.get(layer)
            twin = shadow_modules.get(name)
            if info is None or twin is None or name in kv_names:
                continue
            params, buffers = info.restore_metadata
            LAYERWISE_INFO[twin] = LayerReloadingInfo(
                restore_metadata=(
                    {k: _retarget(v, layer, twin) for k, v in params.items()},
                    {k: _retarget(v, layer, twin) for k, v in buffers.items()},
                ),
                restore_device=info.restore_device,
            )
        return shadow

    # ------------------------------------------------------------------ staging

    def stage(self, update_id: str, items: list, keep: Any = None) -> None:
        """Start loading ``items`` ((name, tensor) pairs, checkpoint format) into the shadow on a thread; returns at
        once. ``keep`` is held until loading ends (the buffer the tensors are views of)."""
        if self._thread is not None and self._thread.is_alive():
            raise StagingError("an update is already being staged")
        self._error, self._staged = None, None
        self._thread = threading.Thread(target=self._load, args=(update_id, items, keep), name="rlhf-stage",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def _load(self, update_id: str, items: list, keep: Any) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        t0 = time.perf_counter()
        try:
            if self.shadow is None:
                self.shadow = self._make_shadow(self.worker.model_runner.get_model())
            shadow = self.shadow
            expected = {name for name, _ in shadow.named_parameters()}
            with torch.no_grad():
                initialize_layerwise_reload(shadow)
                loaded = shadow.load_weights(iter(items))
                finalize_layerwise_reload(shadow, self.worker.vllm_config.model_config)
            missing = expected - set(loaded or ())
            if missing:
                raise StagingError(f"the update does not cover {len(missing)} of the model's parameters "
                                   f"(e.g. {sorted(missing)[:3]})")  # fmt: skip
            self._seconds = time.perf_counter() - t0
            self._staged = update_id
        except BaseException as err:  # noqa: BLE001 - reported by poll(); the shadow is reloaded whole next time
            self._error = f"{type(err).__name__}: {err}"
        finally:
            del items, keep

    def poll(self) -> dict:
        """{"done", "error", "seconds"} of the last :meth:`stage`."""
        busy = self._thread is not None and self._thread.is_alive()
        return {"done": not busy, "error": None if busy else self._error, "seconds": self._seconds,
                "staged": self._staged}  # fmt: skip

    # ------------------------------------------------------------------ swapping

    def swap(self, update_id: str) -> dict:
        """Serve the shadow (it must hold ``update_id``, fully loaded) and keep the old model as the next shadow.
        Runs on the engine's thread between two steps."""
        if self._thread is not None and self._thread.is_alive():
            raise StagingError("the update is still being staged")
        if self._staged != update_id:
            raise StagingError(f"the shadow holds update {self._staged!r}, not {update_id!r}")
        t0 = time.perf_counter()
        runner = self.worker.model_runner
        live, shadow = runner.get_model(), self.shadow
        for name in _kv_layer_names(live, self.worker.vllm_config):
            live_parent, leaf = _parent(live, name)
            shadow_parent, _ = _parent(shadow, name)
            kv_layer, vacant = live_parent._modules[leaf], shadow_parent._modules[leaf]
            shadow_parent._modules[leaf], live_parent._modules[leaf] = kv_layer, vacant
        runner.model = shadow
        engine = getattr(self.worker, "weight_transfer_engine", None)
        if engine is not None:  # it loads into "its" model: keep it on the served one
            engine.model = shadow
            if hasattr(engine, "_default_model"):
                engine._default_model = shadow
        self.shadow, self._staged = live, None
        return {"seconds": time.perf_counter() - t0, "staged_seconds": self._seconds}
