"""The rollout engine's interface: what an engine returns (:class:`Sample`, :class:`PromptResult`,
:class:`StreamEvent`, :class:`SwapResult`), the metrics hooks it calls (:class:`EngineHooks`) and the protocol the gRPC
servicer and the HTTP app use (:class:`RolloutEngine`).

Plain types, no behaviour: what the engines do behind them (sampling log-probs, seeds, streaming, weight swaps) is
described in :mod:`services.rollout.engine`, where their shared base lives.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from services.rollout.options import SamplingOptions

if TYPE_CHECKING:  # pragma: no cover
    import torch


FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Sample:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    policy_version: int
    stop_reason: int | str | None = None  # the stop id or string that ended it (None for EOS or length)
    # per generated token, (token id, log-prob) of the top_logprobs most probable tokens, most probable first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # partial rollouts: (first token index, weights version) of each stretch of tokens one version sampled, when a
    # swap interrupted the sample and it went on under newer weights; None: policy_version sampled every token.
    # policy_version is then the oldest span's.
    spans: list[tuple[int, int]] | None = None
    # engine-internal: a pending swap stopped this sample at a token boundary; EngineBase.generate resumes it after
    # the swap and never returns one so marked
    preempted: bool = False


@dataclass
class StreamEvent:
    """A piece of :meth:`services.rollout.engine.EngineBase.generate_stream`: new tokens of sample ``sample_index``
    of prompt ``prompt_index`` and, on the last event of that sample, the finished sample (its text is final: stop
    strings cut)."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None
    sample: Sample | None = None
    # the new text when the engine detokenizes as it goes (vLLM: a stop string and a split character held back, the
    # pieces add up to the sample's text); None: the serving layer decodes the tokens itself
    text: str | None = None
    # with SamplingOptions.prompt_logprobs, on the first event of each sample: the prompt's, as in PromptResult
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class PromptResult:
    prompt_token_ids: list[int]
    samples: list[Sample]  # exactly n
    # with SamplingOptions.prompt_logprobs: per prompt token, its log-prob given the tokens before it and the most
    # probable (token id, log-prob) alternatives there; None at the first token (nothing conditions it)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class SwapResult:
    version: int
    checksum: str
    swapped: bool
    wait_seconds: float  # waiting for in-flight requests to drain (or, with partial rollouts, to stop)
    swap_seconds: float  # weights being replaced (generation paused)
    prepare_seconds: float = 0.0  # staging the new weights before the pause (generation goes on)


@dataclass
class EngineHooks:
    """Observers the service wires to its metrics (called from engine threads; must be cheap and thread-safe)."""

    on_step: Callable[[int], None] | None = None  # sequences decoded together in one engine step
    on_tokens: Callable[[str, int], None] | None = None  # ("prompt" | "generated", count)
    on_swap: Callable[[SwapResult], None] | None = None  # a weight update installed (its waits and pause)

    def step(self, size: int) -> None:
        if self.on_step is not None and size > 0:
            self.on_step(size)

    def tokens(self, kind: str, n: int) -> None:
        if self.on_tokens is not None and n > 0:
            self.on_tokens(kind, n)

    def swapped(self, result: SwapResult) -> None:
        if self.on_swap is not None:
            self.on_swap(result)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the gRPC servicer and the HTTP app use. Both engines implement it (see
    :class:`services.rollout.engine.EngineBase`)."""

    kind: str  # "vllm" | "hf"
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None

    @property
    def tokenizer(self) -> Any: ...

    @property
    def weights_version(self) -> int: ...

    @property
    def weights_checksum(self) -> str: ...

    @property
    def loaded_at_unix_ms(self) -> int: ...

    @property
    def ready(self) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    defaults: dict[str, Any]  # sampling defaults for fields a request leaves unset

    async def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingOptions, *, field: str = "prompt"
    ) -> list[PromptResult]: ...

    def generate_stream(
        self, prompt_token_ids: list[list[int]], params: SamplingOptions, *, field: str = "prompt"
    ) -> AsyncIterator[StreamEvent]: ...

    async def swap_weights(self, tensors: dict[str, torch.Tensor], version: int, checksum: str) -> SwapResult: ...
