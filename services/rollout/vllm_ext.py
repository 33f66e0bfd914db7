"""vLLM worker extension: loads a safetensors state dict (Hugging Face names) into the running model.

vLLM mixes this class into its worker (engine argument
``worker_extension_cls="services.rollout.vllm_ext.WorkerExtension"``) and the rollout engine calls it by name::

    engine.collective_rpc("rlhf_reload_weights", args=(safetensors_bytes,))

The argument is the bytes of one safetensors file: bytes cross vLLM's msgpack RPC intact in both the in-process and
the engine-core-subprocess modes, and no pickle is involved (``collective_rpc`` with a Python callable would need
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); the worker makes the tensors as views into them
(``rlhf.transport.weights.format.load_safetensors``, no copy). In-process, where ``collective_rpc`` calls the worker
directly and serialises nothing, the engine calls ``rlhf_load_tensors`` with the (name, tensor) pairs themselves.
Both run the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``: the model's own checkpoint
loader, so the CPU backend's repacked linear layers are rebuilt correctly (calling ``model.load_weights`` again fails
there: the repacked parameters have size 0). A worker without ``reload_weights`` (vllm-ascend 0.23) gets the model's
``load_weights`` instead (:meth:`WorkerExtension._rlhf_load`).

This module must import nothing heavy at module level: vLLM imports it inside the worker.
"""

from __future__ import annotations

import time

try:  # vLLM imports this module inside its worker: add the collective backend to its weight-transfer factory
    from services.rollout.vllm_transfer import register as _register_transfer

    _register_transfer()
except ImportError:  # pragma: no cover - vLLM absent (imported for its docstring only)
    pass


class WorkerExtension:
    """Methods added to vLLM's worker; names start with ``rlhf_`` so they cannot clash with the worker's own."""

    def rlhf_reload_weights(self, blob: bytes) -> dict:
        """Load every tensor of the safetensors ``blob`` (checkpoint format) into the model, in place."""
        from rlhf.transport.weights.format import load_safetensors

        t0 = time.perf_counter()
        tensors = load_safetensors(blob)
        path = self._rlhf_load(list(tensors.items()))
        return {"tensors": len(tensors), "seconds": time.perf_counter() - t0, "path": path}

    def rlhf_load_tensors(self, items: list) -> dict:
        """Load (name, tensor) pairs (checkpoint format) into the model, in place. In-process engines only: the
        tensors must not cross a process boundary."""
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

    def rlhf_shadow_stage(self, update_id: str, blob: bytes) -> None:
        """Start loading the safetensors ``blob`` (checkpoint format) into the shadow model; returns at once."""
        from rlhf.transport.weights.format import load_safetensors

        self._rlhf_shadow().stage(update_id, list(load_safetensors(blob).items()), keep=blob)

    def rlhf_shadow_stage_tensors(self, update_id: str, items: list) -> None:
        """As :meth:`rlhf_shadow_stage` with (name, tensor) pairs. In-process engines only."""
        self._rlhf_shadow().stage(update_id, items)

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
    import logging

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
