"""Sampling options of the rollout service: the bounds every request is held to, one request's resolved options,
and the conversions into them (a JSON body's fields, a gRPC/queue ``SamplingParams``, the config's defaults)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlhf.v1 import common_pb2

if TYPE_CHECKING:  # pragma: no cover
    from rlhf.config import ExperimentConfig

MAX_N = 256  # samples per prompt
MAX_ROWS = 4096  # prompts x n per request
MAX_STOP = 16  # stop strings (and stop ids) per request
MAX_STOP_LEN = 256  # characters per stop string
MAX_TEMPERATURE = 2.0  # vLLM 0.32 refuses more
# sample j uses seed + j (j < MAX_N), an int64. The bound is a round decimal that is also a float64 exactly, so clients
# and tools that read JSON numbers as doubles (JavaScript, JSON Schema validators) agree on it: 2**63 - 1 - MAX_N
# reads as 2**63, and a near-2**63 double prints as a rounded decimal above it.
MAX_SEED = 9_200_000_000_000_000_000
MAX_TOP_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_REPETITION_PENALTY = 10.0
# and at least its inverse: positive logits are divided by it, and a tiny penalty (5e-324 is 0 in float32) makes them
# infinite, the distribution NaN and every log-prob NaN
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY
GREEDY_EPS = 1e-5  # temperatures below this decode greedily (vLLM's _SAMPLING_EPS)
# Prompt texts longer than this (in all) are tokenised in a worker thread: a 7 MB prompt took seconds on the event
# loop, and health checks waited (the tokenizer releases the GIL, so the loop keeps answering meanwhile).
OFFLOAD_CHARS = 1 << 16


@dataclass(frozen=True)
class SamplingOptions:
    """Sampling parameters of one request, resolved (no ``None`` left except ``seed``)."""

    n: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = -1  # <= 0: off
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    # vLLM's penalties: repetition (> 1 discourages tokens of the prompt and the output so far: positive logits
    # divided by it, negative ones multiplied), then OpenAI's frequency (minus penalty x count in the output so far)
    # and presence (minus penalty once a token is in the output)
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_logprobs: int = 0  # alternatives per generated token (the most probable of the distribution sampled from)
    # None: off. k >= 0: each prompt token's log-prob under the model itself (temperature 1, no penalties, top-k or
    # top-p: what scoring a text needs, as vLLM's prompt_logprobs) and the k most probable alternatives per position
    prompt_logprobs: int | None = None
    # a named adapter the replica holds (LoadAdapter; the training service's samplers), applied over the policy
    adapter: str | None = None
    # each sampled token's log-prob under the model's own distribution (temperature 1, before penalties, top-k and
    # top-p: what a training forward gives) instead of the distribution sampled from
    raw_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def resolve_options(
    defaults: dict[str, Any],
    *,
    n: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_tokens: int | None = None,
    stop: list[str] | tuple[str, ...] | None = None,
    stop_token_ids: list[int] | tuple[int, ...] | None = None,
    seed: int | None = None,
    ignore_eos: bool = False,
    repetition_penalty: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    top_logprobs: int | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingOptions:
    """Request values (``None``: unset) over the service's defaults -> SamplingOptions (not yet validated)."""

    def pick(value: Any, key: str, fallback: Any) -> Any:
        return value if value is not None else defaults.get(key, fallback)

    return SamplingOptions(
        n=1 if n is None else n,
        temperature=float(pick(temperature, "temperature", 1.0)),
        top_p=float(pick(top_p, "top_p", 1.0)),
        top_k=int(pick(top_k, "top_k", -1)),
        max_tokens=int(pick(max_tokens, "max_tokens", 16)),
        stop=tuple(pick(stop, "stop", ())),
        stop_token_ids=tuple(stop_token_ids or ()),
        seed=seed,
        ignore_eos=bool(ignore_eos),
        repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
        frequency_penalty=0.0 if frequency_penalty is None else float(frequency_penalty),
        presence_penalty=0.0 if presence_penalty is None else float(presence_penalty),
        top_logprobs=int(top_logprobs or 0),
        prompt_logprobs=None if prompt_logprobs is None else int(prompt_logprobs),
    )


def options_from_proto(p: Any, defaults: Mapping[str, Any]) -> SamplingOptions:
    """``rlhf.v1.SamplingParams`` (a gRPC request's or a prompt job's; 0 / unset: the default) -> SamplingOptions.
    The one conversion: the gRPC servicer and the queue worker both call it (the HTTP app resolves its JSON body
    through :func:`resolve_options` the same way)."""
    return resolve_options(
        dict(defaults),
        n=p.n or 1,
        temperature=p.temperature if p.HasField("temperature") else None,
        top_p=p.top_p if p.HasField("top_p") else None,
        top_k=(p.top_k if p.top_k > 0 else -1) if p.HasField("top_k") else None,
        max_tokens=p.max_tokens or None,
        stop=list(p.stop) or None,
        stop_token_ids=list(p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
        ignore_eos=p.ignore_eos,
    )


def finish_reason_proto(reason: str) -> int:
    """A sample's finish reason (``stop`` | ``length`` | ``abort``, what the HTTP app returns as is) -> the
    ``rlhf.v1.FinishReason`` the gRPC servicer and the experience records carry."""
    return {
        "stop": common_pb2.FINISH_REASON_STOP,
        "length": common_pb2.FINISH_REASON_LENGTH,
        "abort": common_pb2.FINISH_REASON_ABORT,
    }.get(reason, common_pb2.FINISH_REASON_UNSPECIFIED)


def default_options(cfg: ExperimentConfig) -> dict[str, Any]:
    """Sampling defaults of this service for fields a request leaves unset: the config's (ExperimentConfig
    .sampling_defaults, the same values the trainer's prompt jobs carry)."""
    return cfg.sampling_defaults()
