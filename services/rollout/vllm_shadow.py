"""Staged weight swaps inside a vLLM worker: an update loads into a second copy of the model (the shadow) while the
live copy keeps generating, and the two trade places between two engine steps.

:class:`ShadowSwap` holds the shadow, loads an update into it with vLLM's layer-wise reload
(:meth:`~ShadowSwap.begin` / :meth:`~ShadowSwap.add` / :meth:`~ShadowSwap.end`) and swaps (:meth:`ShadowSwap.swap`:
O(layers), no tensor copied); :func:`supported` says where it can run. Imported inside vLLM's worker, so vLLM itself
is imported only in functions.

Design, costs and measurements: docs/weight-sync.md#the-update ("Staged swap").
"""

from __future__ import annotations

import copy
import functools
import gc
import logging
import threading
import time
import types
from typing import Any

import torch

from services.rollout.vllm_ties import retie_shared_weights


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
    (vLLM binds them to its layer when it restores the layer, and the records are per layer).

    A layer that has been reloaded (in place, or as a shadow) keeps its record's loader wrapped in vLLM's
    ``online_process_loader``, a closure over that layer and its reload state, which vLLM does not wrap again: left
    in the copy, the copy's loads would go into ``src`` (the serving model). The copy gets the loader underneath."""
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    t = meta.data.to("meta")
    t.__class__ = meta.__class__
    attrs = dict(meta.__dict__)
    for key, value in attrs.items():
        while callable(value) and getattr(value, "__name__", "") == "online_process_loader":
            value = value.__wrapped__
        if isinstance(value, types.MethodType) and (value.__self__ is src or value.__self__ is layer_ref_sentinel):
            value = value.__func__.__get__(dst)
        attrs[key] = value
    t.__dict__ = attrs
    return t


def _copy_tensor_attrs(layer: Any, twin: Any) -> None:
    """Give the twin's own parameters and buffers the attributes vLLM set on the live ones (``weight_loader``,
    ``output_dim``...), methods of ``layer`` bound to ``twin``: deepcopy copies the tensors, not those attributes,
    and a parameter without its ``weight_loader`` gets vLLM's default loader, which takes no shard id (Qwen2's fused
    qkv bias: "TypeError: too many positional arguments" at the first load into the shadow)."""
    for kind in ("_parameters", "_buffers"):
        theirs = getattr(twin, kind)
        for key, tensor in getattr(layer, kind).items():
            copy_ = theirs.get(key)
            if tensor is None or copy_ is None:
                continue
            for attr, value in vars(tensor).items():
                if isinstance(value, types.MethodType) and value.__self__ is layer:
                    value = value.__func__.__get__(twin)
                if attr not in vars(copy_):
                    setattr(copy_, attr, value)


def _memo_parameter_subclasses(live: Any, memo: dict[int, Any]) -> None:
    """Copies of ``live``'s parameters whose class has a ``__new__`` of its own (vLLM's ``BasevLLMParameter``, kept
    where no CPU kernel repacks the weights, e.g. bf16 without AVX-512) put in ``memo``: ``Parameter.__deepcopy__``
    calls ``type(p)(data, requires_grad)``, which their ``__new__`` refuses. Their attributes follow in
    :func:`_copy_tensor_attrs`, as for any parameter."""
    for p in live.parameters():
        if id(p) not in memo and type(p).__new__ is not torch.nn.Parameter.__new__:
            memo[id(p)] = torch.Tensor._make_subclass(type(p), p.detach().clone(), p.requires_grad)


class ShadowSwap:
    """One worker's shadow model and the update staged in it (see the module docstring)."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.shadow: Any = None
        self._thread: threading.Thread | None = None
        self._error: str | None = None
        self._staged: str | None = None  # the id of the update the shadow holds, once fully loaded
        self._loading: str | None = None  # the id of the update going in (begin .. end)
        self._loaded: set[str] = set()  # the shadow's parameters its parts have loaded so far
        self._seconds = 0.0
        self._t0 = 0.0

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
            _memo_parameter_subclasses(live, memo)
            shadow = copy.deepcopy(live, memo)
        shadow_modules = dict(shadow.named_modules())
        for name, layer in live.named_modules():
            twin = shadow_modules.get(name)
            if twin is not None and name not in kv_names:
                _copy_tensor_attrs(layer, twin)
            info = LAYERWISE_INFO.get(layer)
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
    #
    # An update goes in as begin (vLLM's layer-wise reload opened on the shadow), add per part (the model's loader on
    # that part: a layer is processed as soon as all its tensors are in) and end (the layers left, the check that
    # every parameter was loaded). Each step runs on a thread of its own and returns at once; the engine polls
    # (poll()) and sends the next part when the last is in, so the worker holds one part of the update at a time.
    # A step that fails refuses the update: later steps of it do nothing, and the shadow is dropped (a fresh copy
    # is made for the next update: no half-loaded layer-wise state is carried over).

    def begin(self, update_id: str) -> None:
        self._step(update_id, [self._begin], fresh=True)

    def add(self, update_id: str, items: list, keep: Any = None) -> None:
        """Load ``items`` ((name, tensor) pairs, checkpoint format) into the shadow. ``keep`` is held until they are
        loaded (the buffer the tensors are views of)."""
        self._step(update_id, [functools.partial(self._load_part, items, keep)])

    def end(self, update_id: str) -> None:
        self._step(update_id, [self._end])

    def stage(self, update_id: str, items: list, keep: Any = None) -> None:
        """begin, add and end in one step (an update the worker holds already: a collective push's buckets)."""
        self._step(update_id, [self._begin, functools.partial(self._load_part, items, keep), self._end], fresh=True)

    def drop(self) -> None:
        """Give the shadow's memory back (an update loaded in place instead); a fresh copy is made when needed."""
        if self._thread is not None and self._thread.is_alive():
            raise StagingError("an update is being staged")
        self.shadow, self._staged, self._loading = None, None, None
        gc.collect()  # the module tree holds reference cycles (weight loaders bound to their layers)

    def _step(self, update_id: str, work: list, fresh: bool = False) -> None:
        if self._thread is not None and self._thread.is_alive():
            raise StagingError("an update is already being staged")
        if fresh:
            self._error, self._staged, self._loading, self._loaded = None, None, update_id, set()
            self._t0 = time.perf_counter()
        elif self._loading != update_id:
            raise StagingError(f"update {update_id!r} is not being staged (the shadow is on {self._loading!r})")
        self._thread = threading.Thread(target=self._guard, args=(work,), name="rlhf-stage", daemon=True)
        self._thread.start()

    def _guard(self, work: list) -> None:
        try:
            while work and self._error is None:  # after a step of this update failed, it is refused already
                work.pop(0)()  # each step's arguments (a part's tensors) go as soon as it is done
        except BaseException as err:  # reported by poll()
            logging.getLogger("rlhf.rollout.vllm").exception("staging an update in the shadow model failed")
            self._error = f"{type(err).__name__}: {err}"
            self.shadow, self._loading = None, None
        finally:
            work.clear()

    def _begin(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        if self.shadow is None:
            self.shadow = self._make_shadow(self.worker.model_runner.get_model())
        with torch.no_grad():
            initialize_layerwise_reload(self.shadow)

    def _load_part(self, items: list, keep: Any) -> None:
        with torch.no_grad():
            loaded = self.shadow.load_weights(iter(items))
        self._loaded |= set(loaded or ())
        del items, keep

    def _end(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        shadow = self.shadow

        with torch.no_grad():
            finalize_layerwise_reload(shadow, self.worker.vllm_config.model_config)
            retie_shared_weights(shadow)  # a tied head's packed copy (see there)
        missing = {name for name, _ in shadow.named_parameters()} - self._loaded
        if missing:
            raise StagingError(
                f"the update does not cover {len(missing)} of the model's parameters (e.g. {sorted(missing)[:3]})"
            )
        self._seconds = time.perf_counter() - self._t0
        self._staged = self._loading

    def poll(self) -> dict:
        """{"done", "error", "seconds"} of the last :meth:`stage`."""
        busy = self._thread is not None and self._thread.is_alive()
        return {
            "done": not busy,
            "error": None if busy else self._error,
            "seconds": self._seconds,
            "staged": self._staged,
        }

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
