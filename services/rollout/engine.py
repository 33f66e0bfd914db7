"""The rollout service's engine base: :class:`EngineBase`, what the ``vllm`` and ``hf`` engines share (request
validation, versions, the two-step weight swap). The interface and its types are in
:mod:`services.rollout.engine_types`; the engines in :mod:`services.rollout.vllm_engine` and
:mod:`services.rollout.hf_engine`, chosen by ``actor_rollout_ref.actor_rollout.engine`` or ``RLHF_ROLLOUT_ENGINE``.

Design (what both return, sampling and prompt log-probs, penalties, streaming, seeds): docs/services.md#rollout;
the swap: docs/weight-sync.md#the-update.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.serving.errors import FailedPrecondition, Internal, InvalidArgument, NotReady
from rlhf.transport.weights.version import ServedVersion
from services.rollout.engine_types import EngineHooks, PromptResult, Sample, StreamEvent, SwapResult
from services.rollout.options import (
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_ROWS,
    MAX_SEED,
    MAX_STOP,
    MAX_STOP_LEN,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_REPETITION_PENALTY,
    OFFLOAD_CHARS,
    SamplingOptions,
)
from services.rollout.swap import SwapGate, check_state_dict

if TYPE_CHECKING:  # pragma: no cover
    import torch


log = logging.getLogger("rlhf.rollout")


class EngineBase:
    """What both engines share: the swap gate, versions, request validation, metrics hooks."""

    kind = "base"
    supports_partial_rollouts = False  # the engine stops its requests on gate.preempt and implements _continue
    # the engine reports the model's own log-probs per request (SamplingOptions.raw_logprobs) whatever the sampling
    # options; vLLM's log-probs mode is one per engine (processed), which equals raw only at temperature 1, untruncated
    supports_raw_logprobs = False

    def __init__(self, model_path: str | Path, model_name: str, hooks: EngineHooks | None = None):
        self.model_path = Path(model_path)
        self.model_name = model_name
        self.hooks = hooks or EngineHooks()
        self.gate = SwapGate()
        # The served version's one owner on this replica: the weight receiver and the data plane check updates
        # against it, the swap advances it, every sample and GetWeightsVersion report it.
        self.served = ServedVersion()
        self._ready = False
        self._not_ready_reason = "the model is still loading; retry when /readyz says ready"
        # Not ready because an update installed as it arrived stopped half-way (install_streamed): the model holds a
        # mix of versions, serves nothing, and takes the next complete update (the trainer's catch-up re-pushes)
        self._awaiting_weights = False
        self._tokenizer: Any = None
        # sampling defaults for fields a request leaves unset (the service sets them from the experiment config)
        self.defaults: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16, "stop": ()}
        self._manifest: dict[str, tuple[int, ...]] = {}
        self._model_config = json.loads((self.model_path / "config.json").read_text())
        self.vocab_size = int(self._model_config["vocab_size"])
        self.max_model_len = int(self._model_config.get("max_position_embeddings") or 2048)
        eos = self._model_config.get("eos_token_id")
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        self.ties_word_embeddings = bool(self._model_config.get("tie_word_embeddings", False))
        # actor_rollout.partial_rollouts: a swap stops requests at a token boundary and they go on under the new
        # weights (engines with supports_partial_rollouts); see _resume_preempted
        self.partial_rollouts = False

    # ------------------------------------------------------------------------------------------------ properties

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def weights_version(self) -> int:
        return self.served.version

    @property
    def weights_checksum(self) -> str:
        return self.served.checksum

    @property
    def loaded_at_unix_ms(self) -> int:
        return self.served.loaded_at_unix_ms

    @property
    def ready(self) -> bool:
        return self._ready

    def weight_manifest(self) -> dict[str, tuple[None, tuple[int, ...]]]:
        """What a weight update must hold: name -> (dtype, shape) of every parameter, in the form
        ``rlhf.transport.WeightReceiver(expected=...)`` takes (dtype None: any, the engine converts it). It bounds
        the sizes an update header may announce before the receiver allocates anything."""
        if not self._awaiting_weights:  # a replica waiting for a complete update must take one
            self.check_ready()  # known once the model is loaded
        return {name: (None, shape) for name, shape in self._manifest.items()}

    def check_ready(self) -> None:
        """Raise NotReady (503 / UNAVAILABLE) unless the model is loaded and serving."""
        if not self._ready:
            raise NotReady(self._not_ready_reason)

    def _mark_loaded(self) -> None:
        self.served.mark_loaded()
        self._ready = True

    # ------------------------------------------------------------------------------------------------ requests

    async def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of prompt texts with the served model's tokenizer (as given: no chat template). Raises
        InvalidArgument for text that is not valid Unicode (a lone surrogate cannot be tokenised)."""
        self.check_ready()  # the tokenizer comes with the model
        for i, t in enumerate(texts):
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidArgument(
                    "the prompt is not valid UTF-8 (it contains a lone surrogate)", field=f"prompt[{i}]"
                ) from None

        def encode() -> list[list[int]]:
            return [list(self._tokenizer.encode(t)) for t in texts]

        if sum(len(t) for t in texts) > OFFLOAD_CHARS:
            return await asyncio.to_thread(encode)
        return encode()

    def validate(self, prompts: list[list[int]], params: SamplingOptions, field: str = "prompt") -> SamplingOptions:
        """Check a request against this model; returns the options with ``max_tokens`` capped to the context.

        Raises InvalidArgument naming the field: empty prompt, prompt that fills the context, token ids outside
        ``[0, vocab)``, bad sampling values.
        """
        if not prompts:
            raise InvalidArgument("no prompt given: send at least one", field=field)
        if params.n < 1 or params.n > MAX_N:
            raise InvalidArgument(f"n must be between 1 and {MAX_N}, got {params.n}", field="n")
        if len(prompts) * params.n > MAX_ROWS:
            raise InvalidArgument(
                f"{len(prompts)} prompts x n={params.n} is over {MAX_ROWS} samples per request; send fewer", field="n"
            )
        if not (0.0 <= params.temperature <= MAX_TEMPERATURE):
            raise InvalidArgument(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0: greedy), got {params.temperature}",
                field="temperature",
            )
        if not (0.0 < params.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {params.top_p}", field="top_p")
        if params.top_k < -1:
            raise InvalidArgument(f"top_k must be -1 or 0 (off) or a positive count, got {params.top_k}", field="top_k")
        if params.max_tokens < 1 or params.max_tokens >= self.max_model_len:
            raise InvalidArgument(
                f"max_tokens must be between 1 and {self.max_model_len - 1} (the context is {self.max_model_len} "
                f"tokens), got {params.max_tokens}",
                field="max_tokens",
            )
        if len(params.stop) > MAX_STOP:
            raise InvalidArgument(f"at most {MAX_STOP} stop strings, got {len(params.stop)}", field="stop")
        for i, s in enumerate(params.stop):
            if not s or len(s) > MAX_STOP_LEN:
                raise InvalidArgument(f"a stop string must have 1 to {MAX_STOP_LEN} characters", field=f"stop[{i}]")
        if len(params.stop_token_ids) > MAX_STOP:
            raise InvalidArgument(f"at most {MAX_STOP} stop token ids", field="stop_token_ids")
        for i, t in enumerate(params.stop_token_ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidArgument(
                    f"stop token id {t} is outside the vocabulary [0, {self.vocab_size})", field=f"stop_token_ids[{i}]"
                )
        if not (MIN_REPETITION_PENALTY <= params.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidArgument(
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1: off), "
                f"got {params.repetition_penalty}",
                field="repetition_penalty",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(params, name)
            if not (-2.0 <= v <= 2.0):
                raise InvalidArgument(f"{name} must be in [-2, 2] (0: off), got {v}", field=name)
        if not (0 <= params.top_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidArgument(
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {params.top_logprobs}",
                field="top_logprobs",
            )
        if params.prompt_logprobs is not None and not (0 <= params.prompt_logprobs <= MAX_TOP_LOGPROBS):
            raise InvalidArgument(
                f"prompt log-prob alternatives must be between 0 and {MAX_TOP_LOGPROBS}, got {params.prompt_logprobs}",
                field="logprobs",
            )
        if params.seed is not None and not (0 <= params.seed <= MAX_SEED):
            raise InvalidArgument(f"seed must be between 0 and {MAX_SEED}, got {params.seed}", field="seed")
        if params.raw_logprobs and not self.supports_raw_logprobs and _reshaped(params, self.vocab_size):
            raise InvalidArgument(
                f"raw_logprobs with temperature {params.temperature:g}, top_k, top_p or penalties: the {self.kind} "
                "engine reports the log-probs of the distribution sampled from; sample at temperature 1 with no "
                "truncation or penalty, or use the hf engine",
                field="raw_logprobs",
            )
        if params.adapter is not None:
            self.check_adapter(params.adapter)
        longest = 0
        for i, p in enumerate(prompts):
            where = f"{field}[{i}]" if len(prompts) > 1 or field.endswith("s") else field  # plural: indexed
            if not p:
                raise InvalidArgument("the prompt is empty: send at least one token (or non-empty text)", field=where)
            if len(p) >= self.max_model_len:
                raise InvalidArgument(
                    f"the prompt has {len(p)} tokens; the context is {self.max_model_len}, so at most "
                    f"{self.max_model_len - 1} prompt tokens leave room for one new token",
                    field=where,
                )
            bad = next((j for j, t in enumerate(p) if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
            if bad is not None:
                raise InvalidArgument(
                    f"token id {p[bad]} is outside the vocabulary [0, {self.vocab_size}): send ids of the policy's "
                    "tokenizer",
                    field=f"{where}[{bad}]",
                )
            longest = max(longest, len(p))
        top_k = params.top_k if 0 < params.top_k < self.vocab_size else -1
        max_tokens = min(params.max_tokens, self.max_model_len - longest)
        if top_k != params.top_k or max_tokens != params.max_tokens:
            params = replace(params, top_k=top_k, max_tokens=max_tokens)
        return params

    # ------------------------------------------------------------------------------------------- named adapters

    def check_adapter(self, name: str) -> None:
        """Raise unless this replica holds adapter ``name`` (NotFound naming it); engines without named adapters
        refuse every one (FailedPrecondition)."""
        raise self._no_adapters()

    async def load_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> list[str]:
        """Hold a PEFT LoRA adapter under ``name`` (the LoadAdapter call); returns the names held."""
        raise self._no_adapters()

    def _no_adapters(self) -> FailedPrecondition:
        return FailedPrecondition(
            f"this {self.kind} replica serves no named adapters (hf: always; vllm: with RLHF_ROLLOUT_MAX_ADAPTERS "
            "set); see docs/tinker.md",
            field="adapter",
        )

    async def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingOptions, *, field: str = "prompt"
    ) -> list[PromptResult]:
        """``n`` samples for each prompt with the weights served now. ``field``: how errors name the prompts."""
        self.check_ready()
        params = self.validate(prompt_token_ids, params, field=field)
        async with self.gate.generation():
            version = self.served.version
            results = await self._generate(prompt_token_ids, params, version)
        if self.partial_rollouts:
            await self._resume_preempted(prompt_token_ids, params, results)
        self.hooks.tokens("prompt", sum(len(p) for p in prompt_token_ids))
        self.hooks.tokens("generated", sum(len(s.token_ids) for r in results for s in r.samples))
        return results

    async def _generate(self, prompts: list[list[int]], params: SamplingOptions, version: int) -> list[PromptResult]:
        raise NotImplementedError

    async def _resume_preempted(
        self, prompts: list[list[int]], params: SamplingOptions, results: list[PromptResult]
    ) -> None:
        """Partial rollouts: go on with every sample of ``results`` that a swap stopped (``preempted``), once the
        swap is done, from its prompt plus its tokens so far under the version served then, until none is left
        (a later swap may stop one again). Each keeps its budget (``params.max_tokens`` in all) and its options;
        the samples of ``results`` are replaced by the joined ones, with their version spans."""
        while todo := [(i, j) for i, r in enumerate(results) for j, smp in enumerate(r.samples) if smp.preempted]:
            old = [results[i].samples[j] for i, j in todo]
            opts = [continue_options(params, j, len(smp.token_ids)) for (_, j), smp in zip(todo, old, strict=True)]
            async with self.gate.generation():
                self.check_ready()  # a swap that failed half-way left weights nobody should sample from
                version = self.served.version
                more = await self._continue(
                    [prompts[i] for i, _ in todo], [smp.token_ids for smp in old], opts, version
                )
            for (i, j), before, after in zip(todo, old, more, strict=True):
                results[i].samples[j] = join_samples(before, after)

    async def _continue(
        self, prompts: list[list[int]], outputs: list[list[int]], opts: list[SamplingOptions], version: int
    ) -> list[Sample]:
        """One sample per ``prompts[k]`` that goes on after ``outputs[k]`` (tokens it already generated) with
        ``opts[k]`` (n=1, ``max_tokens`` what is left): penalties count ``outputs[k]`` as output, stop strings see
        it (an engine that cannot keep that for some options does not stop such requests: vLLM's frequency and
        presence penalties). Returns the new tokens only, with the whole response's text. Engines with partial
        rollouts implement it (:attr:`supports_partial_rollouts`)."""
        raise NotImplementedError

    async def generate_stream(
        self, prompt_token_ids: list[list[int]], params: SamplingOptions, *, field: str = "prompt"
    ) -> AsyncIterator[StreamEvent]:
        """Like :meth:`generate`, as events: each sample's tokens as the engine decodes them (``hf``: one per token;
        ``vllm``: what one engine step added), its last event with the finished sample. Closing the iterator (a
        client that went away) stops the samples still decoding."""
        self.check_ready()
        params = self.validate(prompt_token_ids, params, field=field)
        generated = 0
        stopped: dict[tuple[int, int], Sample] = {}  # samples a swap stopped (partial rollouts), to go on after it
        first = True
        while first or stopped:
            async with self.gate.generation():
                version = self.served.version
                if first:
                    index = None
                    source = self._generate_stream(prompt_token_ids, params, version)
                else:
                    self.check_ready()  # a swap that failed half-way left weights nobody should sample from
                    index = list(stopped)
                    old = [stopped[k] for k in index]
                    opts = [continue_options(params, j, len(s.token_ids)) for (_, j), s in zip(index, old, strict=True)]
                    prompts = [prompt_token_ids[i] for i, _ in index]
                    source = self._continue_stream(prompts, [s.token_ids for s in old], opts, version)
                first = False
                async with contextlib.aclosing(source) as events:
                    async for ev in events:
                        generated += len(ev.token_ids)
                        if out := _resumed_event(ev, index, stopped):
                            yield out
        self.hooks.tokens("prompt", sum(len(p) for p in prompt_token_ids))
        self.hooks.tokens("generated", generated)

    def _generate_stream(
        self, prompts: list[list[int]], params: SamplingOptions, version: int
    ) -> AsyncIterator[StreamEvent]:
        raise NotImplementedError

    def _continue_stream(
        self, prompts: list[list[int]], outputs: list[list[int]], opts: list[SamplingOptions], version: int
    ) -> AsyncIterator[StreamEvent]:
        """:meth:`_continue` as events, one sample per prompt (its ``prompt_index`` indexes ``prompts``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ weights

    async def swap_weights(
        self, tensors: dict[str, torch.Tensor], version: int, checksum: str, parent_version: int | None = None
    ) -> SwapResult:
        """Install ``tensors`` as ``version`` (trained from ``parent_version``, default ``version - 1``) between
        generation steps (see the module docstring); :attr:`served` decides whether it is newer (StaleVersion,
        409 / FAILED_PRECONDITION, when not). The engine may keep the tensors' memory as its own (the hf engine
        serves from it): do not modify them afterwards."""
        parent = version - 1 if parent_version is None else parent_version
        self.served.check(version, parent)
        if not getattr(tensors, "in_engine", False):  # staged by the engine itself: its header was checked
            check_state_dict(tensors, self._manifest)
        # Staging runs outside the gate: the old weights keep serving meanwhile. A failure here changed nothing.
        tp = time.perf_counter()
        staged = await self._prepare_weights(tensors)
        del tensors
        t0 = time.perf_counter()
        async with self.gate.exclusive():
            t1 = time.perf_counter()
            self.served.check(version, parent)  # another swap may have won the race while we waited
            try:
                await self._load_weights(staged)
            except BaseException as err:
                # A reload that failed half-way may leave a mix of old and new weights: stop serving.
                self._ready = False
                self._not_ready_reason = "a weight swap failed half-way; restart this replica"
                raise Internal(
                    f"the weight swap to version {version} failed ({type(err).__name__}); "
                    "this replica stopped serving and must be restarted"
                ) from err
            self.served.advance(version, parent, checksum)
            self._serving_again()
            t2 = time.perf_counter()
        del staged
        result = SwapResult(
            version=version,
            checksum=checksum,
            swapped=True,
            wait_seconds=t1 - t0,
            swap_seconds=t2 - t1,
            prepare_seconds=t0 - tp,
        )
        self.hooks.swapped(result)
        return result

    def _serving_again(self) -> None:
        """A complete update is installed: a replica that waited for one (a streamed install cut half-way) serves."""
        if self._awaiting_weights:
            self._awaiting_weights = False
            self._ready = True
            log.info("weights version %d installed whole: serving again", self.served.version)

    # An update installed as it arrives (the large-update path): see install_streamed.

    def streams_update(self, total_bytes: int) -> bool:
        """Whether an update of ``total_bytes`` is installed bucket by bucket as it arrives
        (:meth:`install_streamed`) rather than received whole and swapped (:meth:`swap_weights`)."""
        return False

    async def install_streamed(self, header: Any, buckets: Any) -> SwapResult:
        """Install an update into the serving model bucket by bucket as its verified buckets arrive (``buckets``: a
        :class:`~rlhf.transport.weights.receive.BucketFeed`), holding a bucket or two instead of a copy of the model.

        Generation pauses from the first verified bucket until the last is installed (requests in flight finish on
        the old version first). A transfer that fails before its first bucket is verified changes nothing. One that
        fails later (cut, corrupt bucket, sender gone) has put part of the new version into the model: the replica
        then stops serving (not ready, generation refused) and keeps reporting the old version, so the trainer's
        catch-up loop pushes again, and the next complete update makes it serve. Raises the transfer's error."""
        version, parent = header.version, header.parent_version
        self.served.check(version, parent)
        n = len(header.buckets)
        tp = time.perf_counter()
        feed = aiter(buckets)
        bucket = await anext(feed)  # the receive's error, raised here, changed nothing
        t0 = time.perf_counter()
        loaded = 0
        async with self.gate.exclusive():
            t1 = time.perf_counter()
            self.served.check(version, parent)  # another swap may have won the race while we waited
            try:
                await self._stream_begin(header)
                while bucket is not None:
                    await self._stream_bucket(bucket)
                    loaded += 1
                    bucket = None  # its buffer goes back to the receiver (once the engine holds no view of it)
                    buckets.done()
                    bucket = await anext(feed, None)
                await self._stream_end()
            except BaseException as err:
                del bucket
                await self._stream_failed(version, loaded, n, err)
                raise
            self.served.advance(version, parent, header.checksum)
            self._serving_again()
            t2 = time.perf_counter()
        result = SwapResult(
            version=version,
            checksum=header.checksum,
            swapped=True,
            wait_seconds=t1 - t0,
            swap_seconds=t2 - t1,
            prepare_seconds=t0 - tp,
        )
        self.hooks.swapped(result)
        return result

    async def _stream_failed(self, version: int, loaded: int, total: int, err: BaseException) -> None:
        """An install as it arrived stopped after ``loaded`` of ``total`` buckets: stop serving the mix."""
        self._ready = False
        try:
            await asyncio.shield(self._stream_abort())  # the model runnable again (a mix), so the next update loads
        except BaseException as abort_err:  # noqa: BLE001 - the engine cannot even end the load: restart it
            self._awaiting_weights = False
            self._not_ready_reason = "a weight update failed half-way and could not be ended; restart this replica"
            log.error(
                "weight update %d: ending the partial load failed (%s: %s); this replica must be restarted",
                version,
                type(abort_err).__name__,
                abort_err,
            )
            return
        self._awaiting_weights = True
        self._not_ready_reason = (
            f"a weight update (version {version}) stopped after {loaded} of {total} buckets had gone into the model "
            f"({type(err).__name__}): it serves nothing until a complete update arrives (the trainer pushes again)"
        )
        log.error(
            "weight update %d installed as it arrived stopped after %d of %d buckets (%s: %s); not serving "
            "until a complete update arrives",
            version,
            loaded,
            total,
            type(err).__name__,
            err,
        )

    async def _stream_begin(self, header: Any) -> None:
        raise NotImplementedError

    async def _stream_bucket(self, bucket: Any) -> None:
        raise NotImplementedError

    async def _stream_end(self) -> None:
        raise NotImplementedError

    async def _stream_abort(self) -> None:
        """End a load that :meth:`_stream_begin` started and that will not complete, leaving the model runnable."""
        raise NotImplementedError

    async def _prepare_weights(self, tensors: dict[str, torch.Tensor]) -> Any:
        """Stage ``tensors`` for :meth:`_load_weights` while the old weights still serve (outside the gate)."""
        return tensors

    @property
    def device_type(self) -> str:
        """The device type the model lives on (cpu, cuda, npu): which collective backends the engine can join."""
        raise NotImplementedError

    async def receive_collective(self, group: Any, ticket: bytes, header: Any, per_bucket: list) -> tuple[Any, int]:
        """Receive a collective push's buckets (:mod:`rlhf.transport.weights.collective`): in this process by
        default, on the model's device for nccl/hccl (``self.device``); an engine that receives elsewhere (vLLM:
        its worker) overrides it. Returns (tensors, bytes)."""
        from rlhf.transport.weights.collective import receive_buckets  # noqa: PLC0415 - torch loads after main.py sets its threads

        device = None if group.backend == "gloo" else self.device
        return await asyncio.to_thread(receive_buckets, group, ticket, header, per_bucket, device)

    async def _load_weights(self, staged: Any) -> None:
        """Install what :meth:`_prepare_weights` staged; generation is paused meanwhile (inside the gate)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        self._ready = False
        self._not_ready_reason = "the rollout service is shutting down"


def _reshaped(o: SamplingOptions, vocab: int) -> bool:
    """Whether the distribution sampled from differs from the model's own (so do their log-probs). Greedy requests
    report the model's own (temperature 1, as vLLM does)."""
    return (o.temperature != 1.0 and not o.greedy) or 0 < o.top_k < vocab or o.top_p < 1.0 or o.penalized


def decode_text(tokenizer: Any, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def continue_options(params: SamplingOptions, index: int, done: int) -> SamplingOptions:
    """The options sample ``index`` of a request goes on with after ``done`` tokens: one sample, the tokens left of
    its budget, no prompt log-probs (the first part had them); a seeded request stays seeded (a seed of its own per
    sample and resume point), so a replay that is stopped at the same tokens draws the same."""
    seed = None if params.seed is None else (params.seed + index + 7919 * done) % (MAX_SEED + 1)
    return replace(params, n=1, max_tokens=params.max_tokens - done, seed=seed, prompt_logprobs=None)


def _resumed_event(
    ev: StreamEvent, index: list[tuple[int, int]] | None, stopped: dict[tuple[int, int], Sample]
) -> StreamEvent | None:
    """``ev`` as the request's stream shows it: a resumed sample's event (``index``: its (prompt, sample) by
    ``ev.prompt_index``) renumbered, a finished sample joined with what it had before the swap stopped it, and a
    stopped one kept in ``stopped`` instead of ending its stream (None when nothing is left to send)."""
    i, j = (ev.prompt_index, ev.sample_index) if index is None else index[ev.prompt_index]
    ev = replace(ev, prompt_index=i, sample_index=j)
    if ev.sample is None:
        return ev
    before = stopped.pop((i, j), None)
    smp = ev.sample if before is None else join_samples(before, ev.sample)
    if not smp.preempted:
        return replace(ev, sample=smp)
    stopped[(i, j)] = smp
    # vLLM's stopped sample releases the text it held back (a possible stop string's start) without new tokens
    return replace(ev, sample=None) if ev.token_ids or ev.text else None


def join_samples(before: Sample, after: Sample) -> Sample:
    """A preempted sample's tokens so far, then what :meth:`EngineBase._continue` added: one sample whose version
    spans cover every token (stretches of one version merged), whose ``policy_version`` is the oldest token's, and
    which ends as ``after`` does (finish, stop reason, text; still ``preempted`` if it was stopped again)."""
    spans: list[tuple[int, int]] = []
    for start, version in [
        *(before.spans or [(0, before.policy_version)]),
        *((start + len(before.token_ids), v) for start, v in (after.spans or [(0, after.policy_version)])),
    ]:
        if spans and spans[-1][0] == start:  # the earlier stretch is empty (stopped before its first token)
            spans.pop()
        if not spans or spans[-1][1] != version:
            spans.append((start, version))
    n = len(before.token_ids) + len(after.token_ids)
    while len(spans) > 1 and spans[-1][0] >= n:  # a last stretch without tokens
        spans.pop()
    top = None
    if before.top_logprobs is not None or after.top_logprobs is not None:
        top = [*(before.top_logprobs or []), *(after.top_logprobs or [])]
    return Sample(
        token_ids=[*before.token_ids, *after.token_ids],
        logprobs=[*before.logprobs, *after.logprobs],
        finish_reason=after.finish_reason,
        text=after.text,
        policy_version=min(v for _, v in spans),
        stop_reason=after.stop_reason,
        top_logprobs=top,
        spans=spans if len(spans) > 1 else None,
        preempted=after.preempted,
    )


def version_span_fields(spans: list[tuple[int, int]] | None) -> dict[str, list[int]]:
    """Version spans as the ``span_starts`` / ``span_versions`` fields of a record (experience.proto ``Sample``) and
    of a ``Generate`` answer (rollout.proto ``Completion``, ``/v1/generate``): nothing for one version, so such a
    record or answer is byte for byte what it was before spans existed."""
    if not spans or len(spans) == 1:
        return {}
    return {"span_starts": [a for a, _ in spans], "span_versions": [v for _, v in spans]}


# The interface types are defined in services.rollout.engine_types; the engines import these from here too.
__all__ = [
    "EngineBase",
    "EngineHooks",
    "PromptResult",
    "Sample",
    "StreamEvent",
    "continue_options",
    "decode_text",
    "join_samples",
    "version_span_fields",
]
