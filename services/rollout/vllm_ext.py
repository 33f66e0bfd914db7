"""vLLM worker extension: loads a safetensors state dict (Hugging Face names) into the running model.

vLLM mixes this class into its worker (engine argument
``worker_extension_cls="services.rollout.vllm_ext.WorkerExtension"``) and the rollout engine calls it by name::

    engine.collective_rpc("rlhf_reload_weights", args=(safetensors_bytes,))

The argument is the bytes of one safetensors file: bytes cross vLLM's msgpack RPC intact in both the in-process and
the engine-core-subprocess modes, and no pickle is involved (``collective_rpc`` with a Python callable would need
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``); the worker makes the tensors as views into them
(``rlhf.transport.weightsync.load_safetensors``, no copy). In-process, where ``collective_rpc`` calls the worker
directly and serialises nothing, the engine calls ``rlhf_load_tensors`` with the (name, tensor) pairs themselves.
Both run the worker's ``reload_weights(weights_iterator=..., is_checkpoint_format=True)``: the model's own checkpoint
loader, so the CPU backend's repacked linear layers are rebuilt correctly (calling ``model.load_weights`` again fails
there: the repacked parameters have size 0).

This module must import nothing heavy at module level: vLLM imports it inside the worker.
"""

from __future__ import annotations

import time


class WorkerExtension:
    """Methods added to vLLM's worker; names start with ``rlhf_`` so they cannot clash with the worker's own."""

    def rlhf_reload_weights(self, blob: bytes) -> dict:
        """Load every tensor of the safetensors ``blob`` (checkpoint format) into the model, in place."""
        from rlhf.transport.weightsync import load_safetensors

        t0 = time.perf_counter()
        tensors = load_safetensors(blob)
        self.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return {"tensors": len(tensors), "seconds": time.perf_counter() - t0}

    def rlhf_load_tensors(self, items: list) -> dict:
        """Load (name, tensor) pairs (checkpoint format) into the model, in place. In-process engines only: the
        tensors must not cross a process boundary."""
        t0 = time.perf_counter()
        self.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)
        return {"tensors": len(items), "seconds": time.perf_counter() - t0}

    def rlhf_ping(self) -> str:
        return "pong"
