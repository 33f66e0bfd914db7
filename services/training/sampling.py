"""Token sampling for the training service's sampling clients (the tinker SDK's ``SamplingClient.sample``).

One prompt, ``num_samples`` continuations drawn together (the prompt is repeated, so no padding), with a KV cache.
The log-prob returned for each sampled token is under the model's own next-token distribution (temperature 1, no
top-k / top-p truncation), the quantity a training forward of the same tokens gives; temperature, top-k and top-p
shape only which token is drawn. Design: docs/tinker.md (Sampling).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlhf.serving import InvalidArgument
from rlhf.v1 import tinker_pb2 as pb

MAX_SAMPLES = 128  # num_samples per request


@dataclass
class SampleSpec:
    prompt: torch.Tensor  # [P] int64
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_tokens: set[int] | None = None  # None: the model's EOS ids
    stop_strings: list[str] = field(default_factory=list)
    prompt_logprobs: bool = False
    prompt_logprobs_last_n: int | None = None


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def parse_sample_request(body: dict, vocab_size: int, max_length: int) -> SampleSpec:
    """The JSON body of ``POST /api/v1/asample`` (tinker's SampleRequest) -> a SampleSpec; every field this service
    does not implement is refused with a 400 naming it."""
    unbuilt = {
        "topk_prompt_logprobs": body.get("topk_prompt_logprobs", 0),
        "topk_sample_logprobs": body.get("topk_sample_logprobs", 0),
        "prompt_alt_tokens_k": body.get("prompt_alt_tokens_k", 0),
        "target_prompt_logprobs": body.get("target_prompt_logprobs"),
        "record_stability_info": body.get("record_stability_info"),
    }
    for name, value in unbuilt.items():
        if value:
            raise InvalidArgument(f"{name} is not supported by this service's sampler (send 0 / null)", field=name)
    prompt = _prompt(body.get("prompt"), vocab_size)
    n = body.get("num_samples", 1)
    if not isinstance(n, int) or not 1 <= n <= MAX_SAMPLES:
        raise InvalidArgument(f"num_samples {n!r} must be 1..{MAX_SAMPLES}", field="num_samples")
    params = body.get("sampling_params")
    max_tokens, temperature, top_p, top_k, seed = _sampling_params(params, prompt.numel(), max_length)
    stop_tokens, stop_strings = _stop(params.get("stop"), vocab_size)
    spec = SampleSpec(
        prompt, n, max_tokens, temperature, top_p, top_k, seed, stop_tokens, stop_strings,
        bool(body.get("prompt_logprobs")), body.get("prompt_logprobs_last_n"),
    )  # fmt: skip
    last_n = spec.prompt_logprobs_last_n
    if last_n is not None:
        if not spec.prompt_logprobs:
            raise InvalidArgument("prompt_logprobs_last_n needs prompt_logprobs", field="prompt_logprobs_last_n")
        if not isinstance(last_n, int) or not 1 <= last_n <= prompt.numel() - 1:
            raise InvalidArgument(
                f"prompt_logprobs_last_n {last_n!r} must be 1..len(prompt) - 1 ({prompt.numel() - 1})",
                field="prompt_logprobs_last_n",
            )
    return spec


def _sampling_params(params: Any, prompt_len: int, max_length: int) -> tuple[int, float, float, int, int | None]:
    """``sampling_params`` checked: (max_tokens, temperature, top_p, top_k, seed); ``stop`` is read by
    :func:`_stop`. Any other key is refused, naming it."""
    if not isinstance(params, dict):
        raise InvalidArgument("sampling_params is required", field="sampling_params")
    known = {"max_tokens", "seed", "stop", "temperature", "top_k", "top_p"}
    for name in params:
        if name not in known:
            raise InvalidArgument(f"sampling_params.{name} is not supported here", field=f"sampling_params.{name}")
    max_tokens = params.get("max_tokens")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidArgument(
            f"sampling_params.max_tokens {max_tokens!r}: give a positive number of tokens to generate",
            field="sampling_params.max_tokens",
        )
    if max_length and prompt_len + max_tokens > max_length:
        raise InvalidArgument(
            f"prompt ({prompt_len} tokens) + sampling_params.max_tokens ({max_tokens}) exceeds the model's "
            f"context of {max_length}",
            field="sampling_params.max_tokens",
        )
    temperature = _number(params, "temperature", 1.0)
    top_p = _number(params, "top_p", 1.0)
    top_k = params.get("top_k", -1)
    seed = params.get("seed")
    if temperature < 0 or not math.isfinite(temperature):
        raise InvalidArgument(
            f"sampling_params.temperature {temperature} must be >= 0", field="sampling_params.temperature"
        )
    if not 0 < top_p <= 1:
        raise InvalidArgument(f"sampling_params.top_p {top_p} must be in (0, 1]", field="sampling_params.top_p")
    if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise InvalidArgument(
            f"sampling_params.top_k {top_k!r} must be -1 (no limit) or >= 1", field="sampling_params.top_k"
        )
    if seed is not None and not isinstance(seed, int):
        raise InvalidArgument(f"sampling_params.seed {seed!r} must be an integer", field="sampling_params.seed")
    return max_tokens, temperature, top_p, top_k, seed


def _number(params: dict, name: str, default: float) -> float:
    value = params.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidArgument(f"sampling_params.{name} {value!r} must be a number", field=f"sampling_params.{name}")
    return float(value)


def _prompt(prompt, vocab_size: int) -> torch.Tensor:
    chunks = prompt.get("chunks") if isinstance(prompt, dict) else None
    if not isinstance(chunks, list):
        raise InvalidArgument("prompt must be a ModelInput ({'chunks': [...]})", field="prompt")
    ids: list[int] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise InvalidArgument(
                f"prompt.chunks[{j}]: {kind} chunks are not supported (text tokens only)", field="prompt"
            )
        ids.extend(chunk.get("tokens") or [])
    if not ids:
        raise InvalidArgument("prompt is empty: send at least one token", field="prompt")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise InvalidArgument(f"prompt has ids outside 0..{vocab_size - 1}", field="prompt")
    return torch.tensor(ids, dtype=torch.long)


def _stop(stop, vocab_size: int) -> tuple[set[int] | None, list[str]]:
    """The SDK's ``stop``: None keeps EOS; a list of token ids replaces it ([] disables stopping); strings stop at the
    token that completes one of them."""
    if stop is None:
        return None, []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise InvalidArgument(
            "sampling_params.stop must be a string, a list of strings or of token ids", field="sampling_params.stop"
        )
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        if any(not 0 <= s < vocab_size for s in stop):
            raise InvalidArgument(
                f"sampling_params.stop has ids outside 0..{vocab_size - 1}", field="sampling_params.stop"
            )
        return set(stop), []
    if all(isinstance(s, str) and s for s in stop):
        return None, list(stop)
    raise InvalidArgument(
        "sampling_params.stop mixes strings and token ids, or holds an empty string", field="sampling_params.stop"
    )


def _draw(logits: torch.Tensor, spec: SampleSpec, gen: torch.Generator) -> torch.Tensor:
    """One token per row of ``logits`` [n, V] (float32, CPU) under temperature, top-k and top-p."""
    if spec.temperature == 0:
        return logits.argmax(-1)
    scaled = logits / spec.temperature
    if spec.top_k > 0 and spec.top_k < scaled.shape[-1]:
        kth = scaled.topk(spec.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if spec.top_p < 1:
        ordered, index = scaled.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each one
        ordered = ordered.masked_fill(before >= spec.top_p, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, index, ordered)
    return torch.multinomial(scaled.softmax(-1), 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate(
    model,
    spec: SampleSpec,
    eos_ids: set[int],
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[list[Sequence], np.ndarray | None]:
    """``spec.num_samples`` continuations of ``spec.prompt`` and, if asked, the prompt's log-probs (NaN where not
    computed: the first token, and before the last ``prompt_logprobs_last_n``)."""
    device = next(model.parameters()).device
    gen = torch.Generator()
    gen.manual_seed(spec.seed if spec.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
    stop_tokens = eos_ids if spec.stop_tokens is None else spec.stop_tokens
    n = spec.num_samples
    out = model(input_ids=spec.prompt[None].repeat(n, 1).to(device), use_cache=True)
    prompt_lps = None
    if spec.prompt_logprobs:
        row = out.logits[0, :-1].float()
        lp = (row.gather(-1, spec.prompt[1:, None].to(device)) - torch.logsumexp(row, -1, keepdim=True)).squeeze(-1)
        prompt_lps = np.concatenate([[np.nan], lp.cpu().numpy()]).astype(np.float32)
        if spec.prompt_logprobs_last_n is not None:
            prompt_lps[: len(prompt_lps) - spec.prompt_logprobs_last_n] = np.nan
    past = out.past_key_values
    logits = out.logits[:, -1].float().cpu()
    seqs = [Sequence([], [], "length") for _ in range(n)]
    done = [False] * n
    for step in range(spec.max_tokens):
        choice = _draw(logits, spec, gen)
        chosen = (logits.gather(-1, choice[:, None]) - torch.logsumexp(logits, -1, keepdim=True)).squeeze(-1)
        for i, seq in enumerate(seqs):
            if done[i]:
                continue
            token = int(choice[i])
            seq.tokens.append(token)
            seq.logprobs.append(float(chosen[i]))
            if token in stop_tokens or (spec.stop_strings and decode and _has_stop(decode(seq.tokens), spec)):
                seq.stop_reason, done[i] = "stop", True
        if all(done) or step == spec.max_tokens - 1:
            break
        out = model(input_ids=choice[:, None].to(device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[:, -1].float().cpu()
    return seqs, prompt_lps


def _has_stop(text: str, spec: SampleSpec) -> bool:
    return any(s in text for s in spec.stop_strings)


def encode_sample_response(seqs: list[Sequence], prompt_lps: np.ndarray | None) -> bytes:
    """The SDK's SampleResponse protobuf (tinker_public field numbers; proto/rlhf/v1/tinker.proto)."""
    msg = pb.SampleResponse()
    for seq in seqs:
        msg.sequences.append(
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_STOP if seq.stop_reason == "stop" else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
            )
        )
    if prompt_lps is not None:
        msg.prompt_logprobs = prompt_lps.astype(np.float32).tobytes()
    return msg.SerializeToString()
