"""vLLM worker extension: loads a safetensors state dict (Hugging Face names) into the running model.

vLLM mixes :class:`WorkerExtension` into its worker (engine argument
``worker_extension_cls="services.rollout.vllm_ext.WorkerExtension"``) and the rollout engine calls it by name, e.g.
``engine.collective_rpc("rlhf_shadow_add", args=(update_id, safetensors_bytes))``: an update in parts of at most a
bucket, as safetensors bytes, or in-process as (name, tensor) pairs (the ``*_tensors`` methods). This module must
import nothing heavy at module level: vLLM imports it inside the worker.

Design (the paths into the model; bytes, never pickles): docs/weight-sync.md#the-update.
"""

from __future__ import annotations

import logging
import time

from services.rollout.vllm_ties import retie_shared_weights

try:  # vLLM imports this module inside its worker: add the collective backend to its weight-transfer factory
    from services.rollout.vllm_transfer import register as _register_transfer

    _register_transfer()
except ImportError:  # pragma: no cover - vLLM absent (imported for its docstring only)
    pass


class WorkerExtension:
    """Methods added to vLLM's worker; names start with ``rlhf_`` so they cannot clash with the worker's own."""

    # ---- a worker without vLLM's weight-transfer API: the update in parts (at most a bucket per call), gathered
    # here and loaded in one reload_weights at the end (what such a worker can do: its reload is one call)

    def rlhf_load_begin(self) -> None:
        self._rlhf_parts: list = []

    def rlhf_load_part(self, blob: bytes) -> None:
        """One part of the update as a safetensors file (the engine-core subprocess path); the tensors are views
        into ``blob``."""
        from rlhf.transport.weights.format import load_safetensors

        self._rlhf_parts.extend(load_safetensors(blob).items())

    def rlhf_load_part_tensors(self, items: list) -> None:
        """One part as (name, tensor) pairs. In-process engines only: the tensors must not cross a process."""
        self._rlhf_parts.extend(items)

    def rlhf_load_end(self) -> dict:
        """Load every part given since :meth:`rlhf_load_begin` (checkpoint format) into the model, in place."""
        items, self._rlhf_parts = self._rlhf_parts, []
        t0 = time.perf_counter()
        path = self._rlhf_load(items)
        return {"tensors": len(items), "seconds": time.perf_counter() - t0, "path": path}

    def _rlhf_load(self, items: list) -> str:
        """Load through what this worker has, decided by feature, not by version: vLLM's ``reload_weights`` (0.32+;
        it re-runs the post-load processing, which the CPU backend's repacked layers need), else the model's own
        checkpoint-format ``load_weights`` (vllm-ascend 0.23's worker has no ``reload_weights``; its weights stay in
        the ND layout the loader writes because the image sets VLLM_ASCEND_ENABLE_NZ=0)."""
        if hasattr(self, "reload_weights"):
            self._rlhf_quiet()
            self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)

            retie_shared_weights(self.model_runner.get_model())
            return "reload_weights"
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.load_weights(iter(items))
        return "model.load_weights"

    def _rlhf_quiet(self) -> None:
        """Once per worker, before any reload: every load path (in place, weight transfer, staged in the shadow) runs
        vLLM's layerwise reload, which warns for layers a checkpoint cannot fill (see the function below)."""
        if getattr(self, "_rlhf_quieted", False):
            return
        runner = getattr(self, "model_runner", None)
        model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
        if model is not None:
            _quiet_derived_buffer_warnings(model)
            self._rlhf_quieted = True

    # ---- staged swaps (services/rollout/vllm_shadow.py): load beside the live model, swap between two steps

    def _rlhf_shadow(self):
        from services.rollout.vllm_shadow import ShadowSwap

        if getattr(self, "_rlhf_shadow_swap", None) is None:
            self._rlhf_quiet()
            self._rlhf_shadow_swap = ShadowSwap(self)
        return self._rlhf_shadow_swap

    def rlhf_shadow_begin(self, update_id: str) -> None:
        """Start an update in the shadow model (a copy of the live one is made at the first); returns at once."""
        self._rlhf_shadow().begin(update_id)

    def rlhf_shadow_add(self, update_id: str, blob: bytes) -> None:
        """Start loading one part, the safetensors ``blob`` (checkpoint format), into the shadow; returns at once."""
        from rlhf.transport.weights.format import load_safetensors

        self._rlhf_shadow().add(update_id, list(load_safetensors(blob).items()), keep=blob)

    def rlhf_shadow_add_tensors(self, update_id: str, items: list) -> None:
        """As :meth:`rlhf_shadow_add` with (name, tensor) pairs. In-process engines only."""
        self._rlhf_shadow().add(update_id, items)

    def rlhf_shadow_end(self, update_id: str) -> None:
        """Finish the update in the shadow (every parameter must have been loaded); returns at once."""
        self._rlhf_shadow().end(update_id)

    def rlhf_shadow_drop(self) -> None:
        """Free the shadow model (an update loaded in place does without it)."""
        shadow = getattr(self, "_rlhf_shadow_swap", None)
        if shadow is not None:
            shadow.drop()

    def rlhf_shadow_stage_transfer(self, update_id: str) -> None:
        """Stage what the weight-transfer engine received for the open session (a collective push) into the shadow;
        the session is then ended with nothing left to install (see VllmEngine._load_weights)."""
        engine = self.weight_transfer_engine
        items, engine.staged = list(engine.staged.items()), {}
        self._rlhf_shadow().stage(update_id, items)

    def rlhf_shadow_poll(self) -> dict:
        return self._rlhf_shadow().poll()

    def rlhf_shadow_swap(self, update_id: str) -> dict:
        return self._rlhf_shadow().swap(update_id)

    def rlhf_features(self) -> dict:
        """What this worker offers for loading weights (the rollout engine asks once at start): vLLM's weight-transfer
        API (the engine configured, ``update_weights`` present), whether its transfer engine runs the update session
        (``engine_sessions``: it can stage while the model generates) and ``reload_weights``."""
        self._rlhf_quiet()  # asked once at start, before the first update whatever its path
        engine = getattr(self, "weight_transfer_engine", None)
        transfer = engine is not None and hasattr(self, "update_weights")
        sessions = False
        if transfer:
            from services.rollout.vllm_transfer import engine_sessions

            sessions = engine_sessions()
        from services.rollout.vllm_shadow import supported

        staged, why = supported(self)
        return {
            "weight_transfer": transfer,
            "engine_sessions": sessions,
            "reload_weights": hasattr(self, "reload_weights"),
            "staged_swap": staged,
            "staged_swap_unsupported": why,
            # the workers of this engine (tensor x pipeline parallel): each joins a collective push's group
            "parallel_world_size": int(getattr(getattr(self, "parallel_config", None), "world_size", 1) or 1),
        }

    def rlhf_ping(self) -> str:
        return "pong"


def _quiet_derived_buffer_warnings(model) -> None:
    """Drop vLLM's "<Layer>: Failed to load weights" for layers that hold nothing a checkpoint can fill.

    vLLM's layerwise reload (``model_loader/reload/layerwise.py``, 0.32) counts every parameter and buffer of a
    layer as loadable. A layer whose only tensors are non-persistent buffers derived from the config (the rotary
    embedding's ``cos_sin_cache``) therefore loads nothing on every reload, is warned about, and gets its current
    tensors back, which is correct. The warning stays for any layer class that has a parameter or a persistent
    buffer somewhere in the model."""
    derived, loadable = set(), set()
    for module in model.modules():
        buffers = {name for name, b in module._buffers.items() if b is not None}
        own_params = any(True for _ in module.parameters(recurse=False))
        if buffers and not own_params and buffers <= module._non_persistent_buffers_set:
            derived.add(type(module).__name__)
        elif own_params or buffers:
            loadable.add(type(module).__name__)
    quiet = derived - loadable
    if not quiet:
        return

    class _DerivedOnly(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in quiet)

    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_DerivedOnly())
