"""The ``hf`` rollout engine: a transformers causal LM on any torch device, concurrent requests decoded together.

An asyncio batcher collects rows (one per sample) and decodes them together with a KV cache; a seeded sampling loop
(not ``model.generate``) gives each row its own generator and the log-probs of exactly the logits it sampled from,
with vLLM's penalties (:func:`apply_penalties`), top-k/top-p masks and stop rules. :meth:`HFEngine._generate_stream`
hands each new token to the event loop as it is decoded.

Design: docs/services.md#rollout ("How the engines work").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlhf.algo import logprobs_from_logits
from rlhf.layout import CheckpointLayout
from rlhf.models import load_causal_lm, load_tokenizer, resolve_device
from rlhf.serving.errors import NotReady
from services.rollout.engine import (
    EngineBase,
    EngineHooks,
    PromptResult,
    Sample,
    StreamEvent,
    decode_text,
)
from services.rollout.hf_adapters import DEFAULT_MAX_ADAPTERS, Adapter, AdapterStore, parse_adapter
from services.rollout.options import SamplingOptions

log = logging.getLogger("rlhf.rollout.hf")


@dataclass
class _Row:
    prompt: list[int]
    opts: SamplingOptions
    seed: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    # filled by the decoder
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None
    top: list[list[tuple[int, float]]] | None = None  # top_logprobs alternatives per token, when asked for
    # streaming: called on the event loop with (token, log-prob, alternatives) as each token is decoded
    on_token: Any = None
    # opts.prompt_logprobs: each prompt token's log-prob (None first) and alternatives, from the prefill's logits
    prompt_lp: list[float | None] | None = None
    prompt_top: list[list[tuple[int, float]] | None] | None = None
    # partial rollouts: a pending swap may stop this row between tokens (preempted); a resumed row's ``prompt`` ends
    # with ``output``, the tokens the sample generated before (penalties count them as output, stop strings see them)
    preemptible: bool = False
    preempted: bool = False
    output: list[int] = field(default_factory=list)
    adapter: Adapter | None = None  # a named adapter, pinned until the row's future is done


def apply_penalties(
    logits: torch.Tensor,
    in_prompt: torch.Tensor,
    counts: torch.Tensor,
    rep: torch.Tensor,
    freq: torch.Tensor,
    pres: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties on (B, V) logits: repetition (tokens seen in the prompt or the output: positive logits divided
    by it, negative ones multiplied), then frequency (``- freq x count``) and presence (``- pres`` once seen) over the
    output's token ``counts``. ``rep`` / ``freq`` / ``pres``: (B,); 1, 0, 0 leave a row unchanged."""
    seen = in_prompt | (counts > 0)
    r = rep.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - freq.unsqueeze(1) * counts - pres.unsqueeze(1) * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM 0.32's ``apply_top_k_top_p_pytorch`` (CPU path): masked entries become -inf. ``k``: (B,) long with
    ``vocab`` meaning off; ``p``: (B,) float with 1.0 meaning off. Works on a copy."""
    if k is None and p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = logits_sort.gather(1, (logits_sort.size(1) - k.long()).unsqueeze(1))
        logits_sort = logits_sort.masked_fill(logits_sort < kth, float("-inf"))
    if p is not None:
        probs_sum = logits_sort.softmax(dim=-1).cumsum(dim=-1)
        top_p_mask = probs_sum <= 1 - p.unsqueeze(1)
        top_p_mask[:, -1] = False
        logits_sort = logits_sort.masked_fill(top_p_mask, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, logits_idx, logits_sort)


def step_distribution(
    logits: torch.Tensor, temps: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None
) -> torch.Tensor:
    """(B, V) float32 logits (penalties applied) -> the logits of the distribution each row samples from:
    divided by the row's temperature, then top-k / top-p masked (-inf). Its ``log_softmax`` at a token is the
    sampling log-prob the engine reports (one code path for the decode loop and anything that checks it)."""
    return apply_top_k_top_p(logits / temps.unsqueeze(1), k, p)


@dataclass
class _Penalties:
    """vLLM's penalties of one batch (:func:`apply_penalties`): which tokens each row's prompt holds, each token's
    count in each row's output so far, and the rows' factors."""

    in_prompt: torch.Tensor  # (B, V) bool
    counts: torch.Tensor  # (B, V) float32, updated by :meth:`count` after each step
    rep: torch.Tensor  # (B,) float32
    freq: torch.Tensor
    pres: torch.Tensor

    @classmethod
    def of(cls, rows: list[_Row], vocab: int, device: torch.device) -> _Penalties | None:
        """None when no row is penalized: the decode loop then skips penalties altogether."""
        if not any(r.opts.penalized for r in rows):
            return None
        in_prompt = torch.zeros((len(rows), vocab), dtype=torch.bool)
        counts = torch.zeros((len(rows), vocab), dtype=torch.float32)
        for i, r in enumerate(rows):
            in_prompt[i, torch.tensor(r.prompt)] = True
            if r.output:  # a resumed row: its tokens so far count as output
                counts[i].scatter_add_(0, torch.tensor(r.output), torch.ones(len(r.output)))

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        return cls(
            in_prompt=in_prompt.to(device),
            counts=counts.to(device),
            rep=per_row([r.opts.repetition_penalty for r in rows]),
            freq=per_row([r.opts.frequency_penalty for r in rows]),
            pres=per_row([r.opts.presence_penalty for r in rows]),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_penalties(logits, self.in_prompt, self.counts, self.rep, self.freq, self.pres)

    def count(self, tok: torch.Tensor, active: list[bool]) -> None:
        """Count each active row's new token ``tok`` (B,)."""
        weight = torch.tensor(active, dtype=self.counts.dtype, device=self.counts.device)
        self.counts.scatter_add_(1, tok.unsqueeze(1), weight[:, None])


@dataclass
class _Step:
    """The tokens one decode step drew, one per row (rows that have finished draw one too; it is dropped)."""

    tokens: list[int]
    logprobs: list[float]  # each token's sampling log-prob
    # per row, the ``n_top`` most probable (token ids, log-probs) of the distribution sampled from; None: no row asks
    top: list[tuple[list[int], list[float]]] | None


@dataclass
class _Sampling:
    """How each row of one decode batch samples: (B,) tensors on the device, one seeded generator per row, and each
    row's stop tokens and token budget. Built by :meth:`of`; :meth:`draw` samples one step."""

    temps: torch.Tensor  # float32; 1.0 for greedy rows
    greedy: torch.Tensor  # bool
    top_k: torch.Tensor | None  # long, ``vocab`` meaning off; None: no row truncates, the mask is skipped
    top_p: torch.Tensor | None  # float32, 1.0 meaning off; None as for top_k
    gens: list[torch.Generator]
    stop_ids: list[set[int]]  # the row's stop_token_ids and, unless it ignores it, EOS
    budgets: list[int]  # tokens the row may generate: max_tokens, cut to the context left
    n_top: int  # the most top_logprobs alternatives any row asks for (0: none)
    penalties: _Penalties | None
    raw: torch.Tensor | None = None  # (B,) bool: rows that report the model's own log-probs; None: no row

    @classmethod
    def of(
        cls, rows: list[_Row], *, vocab: int, eos_token_id: int | None, max_model_len: int, device: torch.device
    ) -> _Sampling:
        def truncates_k(r: _Row) -> bool:
            return 0 < r.opts.top_k < vocab and not r.opts.greedy

        any_p = any(r.opts.top_p < 1.0 and not r.opts.greedy for r in rows)
        top_k = torch.tensor([r.opts.top_k if truncates_k(r) else vocab for r in rows])
        top_p = torch.tensor([r.opts.top_p if not r.opts.greedy else 1.0 for r in rows], dtype=torch.float32)
        temps = torch.tensor([r.opts.temperature if not r.opts.greedy else 1.0 for r in rows], dtype=torch.float32)
        gens = []
        for r in rows:
            g = torch.Generator(device=device)
            g.manual_seed(r.seed)
            gens.append(g)
        eos = set() if eos_token_id is None else {eos_token_id}
        return cls(
            temps=temps.to(device),
            greedy=torch.tensor([r.opts.greedy for r in rows]).to(device),
            top_k=top_k.to(device) if any(truncates_k(r) for r in rows) else None,
            top_p=top_p.to(device) if any_p else None,
            gens=gens,
            stop_ids=[set(r.opts.stop_token_ids) | (set() if r.opts.ignore_eos else eos) for r in rows],
            budgets=[min(r.opts.max_tokens, max_model_len - len(r.prompt)) for r in rows],
            n_top=max(r.opts.top_logprobs for r in rows),
            penalties=_Penalties.of(rows, vocab, device),
            raw=torch.tensor([r.opts.raw_logprobs for r in rows]).to(device)
            if any(r.opts.raw_logprobs for r in rows)
            else None,
        )

    def draw(self, logits: torch.Tensor, active: list[bool]) -> _Step:
        """One token per row from the (B, V) float32 logits of the last position, with its sampling log-prob."""
        # penalties before temperature and top-k/top-p, as in vLLM; greedy rows take the penalized argmax
        model_logits = logits
        if self.penalties is not None:
            logits = self.penalties.apply(logits)
        masked = step_distribution(logits, self.temps, self.top_k, self.top_p)
        # Exponential-race sampling (argmax of p / q, q ~ Exp(1)) with each row's own generator: a row draws the same
        # tokens whatever else shares its batch. Finished rows draw nothing from theirs.
        probs = masked.softmax(dim=-1)
        q = torch.empty_like(probs)
        for i, g in enumerate(self.gens):
            if active[i]:
                q[i].exponential_(generator=g)
            else:
                q[i].fill_(1.0)
        sampled = (probs / q).argmax(dim=-1)
        tok = torch.where(self.greedy, logits.argmax(dim=-1), sampled)
        # log_softmax(masked logits / T) at the token: the distribution sampled from (temperature 1 if greedy)
        lp = logprobs_from_logits(masked, tok, 1.0)
        if self.raw is not None:  # the model's own distribution: temperature 1, nothing penalized or masked
            lp = torch.where(self.raw, logprobs_from_logits(model_logits, tok, 1.0), lp)
        top = None
        if self.n_top:  # the most probable tokens of the same distribution (tokens masked by top-k/top-p: -inf)
            top_v, top_i = masked.log_softmax(dim=-1).topk(self.n_top, dim=-1)
            top = list(zip(top_i.tolist(), top_v.tolist(), strict=True))
        if self.penalties is not None:
            self.penalties.count(tok, active)
        return _Step(tok.tolist(), lp.tolist(), top)


def _token_events(events: asyncio.Queue[tuple]) -> Any:
    """``on_token(i, j)`` for :meth:`HFEngine._enqueue`: sample ``j`` of prompt ``i``'s tokens as queue entries."""

    def on_token(i: int, j: int) -> Any:
        return lambda tok, lp, top: events.put_nowait(("tok", i, j, tok, lp, top))

    return on_token


class HFEngine(EngineBase):
    kind = "hf"
    supports_partial_rollouts = True
    supports_raw_logprobs = True

    def __init__(
        self,
        model_path: str | Path,
        model_name: str,
        *,
        dtype: str = "float32",
        device: str = "auto",
        hooks: EngineHooks | None = None,
        max_batch_rows: int = 64,
        batch_wait_ms: float = 5.0,
        max_model_len: int | None = None,
        partial_rollouts: bool = False,
        max_adapters: int = DEFAULT_MAX_ADAPTERS,
    ):
        super().__init__(model_path, model_name, hooks)
        self.adapters = AdapterStore(max_adapters)
        self.partial_rollouts = partial_rollouts
        if max_model_len:
            self.max_model_len = min(self.max_model_len, int(max_model_len))
        self.dtype = dtype
        self.device_spec = device
        self.max_batch_rows = max_batch_rows
        self.batch_wait_s = batch_wait_ms / 1000.0
        self.model: Any = None
        self.device: torch.device | None = None
        self._queue: asyncio.Queue[_Row] | None = None
        self._worker: asyncio.Task | None = None
        self._rng = random.SystemRandom()
        self.pad_token_id = 0

    # ------------------------------------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        def _load() -> tuple[Any, Any]:
            tok = load_tokenizer(self.model_path)
            model = load_causal_lm(self.model_path, device=self.device_spec, dtype=self.dtype).eval()
            return tok, model

        self.device = resolve_device(self.device_spec)
        self._tokenizer, self.model = await asyncio.to_thread(_load)
        self.pad_token_id = int(self._tokenizer.pad_token_id)
        # Updates come in the checkpoint layout (what vLLM loads too): the manifest is the checkpoint's, and _stage
        # maps it back onto the live module (a tie's alias is the same parameter; fused MoE experts are rebuilt).

        self._layout = CheckpointLayout(self.model, self.model.state_dict())
        self._manifest = {name: shape for name, _, shape in self._layout.specs()}
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._batcher(), name="hf-batcher")
        self._mark_loaded()
        log.info("hf engine ready: %s on %s (%s)", self.model_path, self.device, self.dtype)

    @property
    def device_type(self) -> str:
        self.check_ready()  # the device is resolved with the model
        return self.device.type

    async def close(self) -> None:
        await super().close()
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(BaseException):
                await self._worker
            self._worker = None
        if self._queue is not None:
            while not self._queue.empty():
                row = self._queue.get_nowait()
                if not row.future.done():
                    row.future.set_exception(NotReady("the rollout service is shutting down"))

    # ------------------------------------------------------------------------------------------------ batching

    async def _batcher(self) -> None:
        assert self._queue is not None
        while True:
            rows = [await self._queue.get()]
            deadline = time.monotonic() + self.batch_wait_s
            while len(rows) < self.max_batch_rows:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    rows.append(await asyncio.wait_for(self._queue.get(), timeout))
                except TimeoutError:
                    break
            while len(rows) < self.max_batch_rows and not self._queue.empty():
                rows.append(self._queue.get_nowait())
            rows = [r for r in rows if not r.future.done()]  # cancelled callers
            if not rows:
                continue
            # one forward serves one set of weights: the rows of each named adapter (and the policy's) decode apart
            groups: dict[int, list[_Row]] = {}
            for r in rows:
                groups.setdefault(id(r.adapter), []).append(r)
            for group in groups.values():
                await self._decode_group(group)

    async def _decode_group(self, rows: list[_Row]) -> None:
        try:
            await asyncio.to_thread(self._decode, rows)
        except Exception as err:  # report to every caller in the batch
            log.exception("hf decode failed")
            for r in rows:
                if not r.future.done():
                    r.future.set_exception(err)
            return
        for r in rows:
            if not r.future.done():
                r.future.set_result(r)

    # ------------------------------------------------------------------------------------------------ named adapters

    def check_adapter(self, name: str) -> None:
        self.adapters.check(name)

    async def load_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> list[str]:
        self.check_ready()
        adapter = await asyncio.to_thread(parse_adapter, name, tensors, config, self.model)
        held = self.adapters.put(adapter)
        log.info("hf engine: adapter %s loaded (%d modules); holding %d", name, len(adapter.modules), len(held))
        return held

    def _pin(self, row: _Row) -> _Row:
        """Pin the row's named adapter (NotFound if the replica no longer holds it) until its future is done."""
        if row.opts.adapter is not None:
            row.adapter = self.adapters.pin(row.opts.adapter)
            row.future.add_done_callback(lambda _f, a=row.adapter: self.adapters.unpin(a))
        return row

    def _forward(self, adapter: Adapter | None) -> Any:
        """The model's forward under ``adapter`` (None: the policy as it is)."""
        if adapter is None:
            return self.model
        params = adapter.params(self.model)
        # tie_weights=False: an adapted lm_head tied to the embedding replaces the head's use of it only
        return lambda **kw: torch.func.functional_call(self.model, params, (), kw, tie_weights=False, strict=False)

    def _enqueue(
        self, prompts: list[list[int]], params: SamplingOptions, on_token: Any = None, preemptible: bool = False
    ) -> list[list[_Row]]:
        """One row per sample, queued for the batcher. ``on_token(i, j)``: the streaming callback of sample j of
        prompt i (None: no streaming). ``preemptible``: a pending swap may stop the rows (partial rollouts)."""
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        base = params.seed
        rows: list[list[_Row]] = []
        for i, p in enumerate(prompts):
            prow = []
            for j in range(params.n):
                seed = base + j if base is not None else self._rng.randrange(2**63 - 1)
                row = self._pin(
                    _Row(
                        prompt=list(p),
                        opts=params,
                        seed=seed,
                        future=loop.create_future(),
                        loop=loop,
                        on_token=on_token(i, j) if on_token is not None else None,
                        preemptible=preemptible,
                    )
                )
                prow.append(row)
                self._queue.put_nowait(row)
            rows.append(prow)
        return rows

    @staticmethod
    def _sample(r: _Row, version: int) -> Sample:
        return Sample(
            token_ids=r.tokens,
            logprobs=r.logprobs,
            finish_reason=r.finish or "length",
            text=r.text or "",
            policy_version=version,
            stop_reason=r.stop_reason,
            top_logprobs=r.top,
            preempted=r.preempted,
        )

    @staticmethod
    async def _wait(rows: list[_Row]) -> None:
        futures = [r.future for r in rows]
        try:
            await asyncio.gather(*futures)
        except BaseException:
            for f in futures:
                f.cancel()
            raise

    async def _generate(self, prompts: list[list[int]], params: SamplingOptions, version: int) -> list[PromptResult]:
        rows = self._enqueue(prompts, params, preemptible=self.partial_rollouts)
        await self._wait([r for prow in rows for r in prow])
        return [
            PromptResult(
                prompt_token_ids=list(p),
                samples=[self._sample(r, version) for r in prow],
                prompt_logprobs=prow[0].prompt_lp,  # the same for every sample of a prompt
                prompt_top_logprobs=prow[0].prompt_top,
            )
            for p, prow in zip(prompts, rows, strict=True)
        ]

    def _continue_row(self, prompt: list[int], output: list[int], opts: SamplingOptions, on_token: Any = None) -> _Row:
        """A row that goes on after ``output`` (a preempted sample's tokens so far), queued for the batcher."""
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        row = _Row(
            prompt=[*prompt, *output],
            opts=opts,
            seed=opts.seed if opts.seed is not None else self._rng.randrange(2**63 - 1),
            future=loop.create_future(),
            loop=loop,
            on_token=on_token,
            preemptible=True,
            output=list(output),
        )
        self._pin(row)
        self._queue.put_nowait(row)
        return row

    async def _continue(
        self, prompts: list[list[int]], outputs: list[list[int]], opts: list[SamplingOptions], version: int
    ) -> list[Sample]:
        rows = [self._continue_row(p, out, o) for p, out, o in zip(prompts, outputs, opts, strict=True)]
        await self._wait(rows)
        return [self._sample(r, version) for r in rows]

    def _generate_stream(
        self, prompts: list[list[int]], params: SamplingOptions, version: int
    ) -> AsyncIterator[StreamEvent]:
        """Tokens as they are decoded: the decode thread hands each new token to the event loop
        (``call_soon_threadsafe``), where it becomes an event; the last event of a sample carries the finished
        sample (with partial rollouts, one a swap stopped is marked ``preempted``)."""
        events: asyncio.Queue[tuple] = asyncio.Queue()
        rows = self._enqueue(prompts, params, _token_events(events), preemptible=self.partial_rollouts)
        flat = [(i, j, r) for i, prow in enumerate(rows) for j, r in enumerate(prow)]
        return self._stream_rows(flat, events, version)

    def _continue_stream(
        self, prompts: list[list[int]], outputs: list[list[int]], opts: list[SamplingOptions], version: int
    ) -> AsyncIterator[StreamEvent]:
        events: asyncio.Queue[tuple] = asyncio.Queue()
        on_token = _token_events(events)
        flat = [
            (k, 0, self._continue_row(p, out, o, on_token(k, 0)))
            for k, (p, out, o) in enumerate(zip(prompts, outputs, opts, strict=True))
        ]
        return self._stream_rows(flat, events, version)

    async def _stream_rows(
        self, flat: list[tuple[int, int, _Row]], events: asyncio.Queue[tuple], version: int
    ) -> AsyncIterator[StreamEvent]:
        """The events of ``flat``'s rows (prompt index, sample index, row) until each has finished. Closing the
        iterator (a client that went away) cancels the rows still decoding."""
        for i, j, r in flat:
            # runs after the row's token callbacks: they were scheduled from the decode thread before the batcher
            # resolved the future
            r.future.add_done_callback(lambda _f, i=i, j=j: events.put_nowait(("done", i, j)))
        by_index = {(i, j): r for i, j, r in flat}
        opened: set[tuple[int, int]] = set()  # samples whose first event (with the prompt's log-probs) went out
        try:
            left = len(flat)
            while left:
                ev = await events.get()
                i, j = ev[1], ev[2]
                r = by_index[(i, j)]
                first: dict[str, Any] = {}
                if (i, j) not in opened:  # set by the decode thread after the prefill, before the first token
                    first = {"prompt_logprobs": r.prompt_lp, "prompt_top_logprobs": r.prompt_top}
                    opened.add((i, j))
                if ev[0] == "tok":
                    _, _, _, tok, lp, top = ev
                    yield StreamEvent(i, j, [tok], [lp], [top] if top is not None else None, **first)
                    continue
                left -= 1
                if r.future.cancelled():
                    raise asyncio.CancelledError
                if r.future.exception() is not None:
                    raise r.future.exception()
                yield StreamEvent(i, j, [], [], None, self._sample(r, version), **first)
        finally:
            for _, _, r in flat:
                r.future.cancel()

    # ------------------------------------------------------------------------------------------------ decoding

    @torch.inference_mode()
    def _decode(self, rows: list[_Row]) -> None:
        """Decode ``rows`` together until each has finished (runs in a worker thread)."""
        self.hooks.step(len(rows))
        inp, mask, inp_pos = self._prefill_inputs(rows)
        prompt_width = inp.shape[1]
        sampling = _Sampling.of(
            rows,
            vocab=self.vocab_size,
            eos_token_id=self.eos_token_id,
            max_model_len=self.max_model_len,
            device=self.device,
        )
        for r in rows:
            if r.opts.top_logprobs:
                r.top = []
        active = [True] * len(rows)
        past = None
        preempt = self.gate.preempt
        forward = self._forward(rows[0].adapter)  # the batcher groups rows by adapter
        for t in range(max(sampling.budgets)):
            # A caller that went away (HTTP client disconnected, gRPC call cancelled) cancelled its futures: its
            # rows stop here instead of decoding to max_tokens for nobody.
            for i, r in enumerate(rows):
                if active[i] and r.future.cancelled():
                    active[i] = False
                    r.finish = "abort"
            # Partial rollouts: a swap waits; preemptible rows stop here, to go on under the new weights. Each row
            # gets one token per admission first (the prefill, prompt log-probs): progress, however often swaps come.
            if t and preempt.is_set():
                for i, r in enumerate(rows):
                    if active[i] and r.preemptible:
                        active[i] = False
                        r.preempted = True
            if not any(active):
                break
            out = forward(
                input_ids=inp,
                attention_mask=mask,
                position_ids=inp_pos,
                past_key_values=past,
                use_cache=True,
                return_dict=True,
            )
            if past is None and any(r.opts.prompt_logprobs is not None for r in rows):
                # the prefill holds the logits of every prompt position
                self._prompt_logprobs(rows, out.logits, prompt_width)
            past = out.past_key_values
            step = sampling.draw(out.logits[:, -1, :].float(), active)
            for i, r in enumerate(rows):
                if active[i]:
                    active[i] = self._take(r, step, i, sampling)
            if not any(active):
                break
            inp, mask, inp_pos = self._next_inputs(step.tokens, active, mask)
            self.hooks.step(sum(active))
        for r in rows:
            if r.finish is None:
                r.finish = "length"
            if r.text is None:
                r.text = decode_text(self._tokenizer, [*r.output, *r.tokens])

    def _prefill_inputs(self, rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input ids, attention mask, position ids) of the prefill, (B, P) on the device: the prompts left-padded
        to the longest, so every row's next token is at the last position."""
        n_rows, width = len(rows), max(len(r.prompt) for r in rows)
        ids = torch.full((n_rows, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n_rows, width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)

    def _take(self, r: _Row, step: _Step, i: int, sampling: _Sampling) -> bool:
        """Append row ``i``'s token of ``step`` to ``r`` (and stream it); False when that finished the row."""
        tok, lp = step.tokens[i], step.logprobs[i]
        r.tokens.append(tok)
        r.logprobs.append(lp)
        alts = None
        if r.top is not None and step.top is not None:
            ids, values = step.top[i]
            n = r.opts.top_logprobs
            alts = [(t, v) for t, v in zip(ids[:n], values[:n], strict=True) if v > float("-inf")]
            r.top.append(alts)
        if r.on_token is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody listens
                r.loop.call_soon_threadsafe(r.on_token, tok, lp, alts)
        if tok in sampling.stop_ids[i]:
            r.finish = "stop"
            r.stop_reason = tok if tok in r.opts.stop_token_ids else None  # None: EOS
        elif r.opts.stop and self._hit_stop_string(r):
            r.finish = "stop"
        elif len(r.tokens) >= sampling.budgets[i]:
            r.finish = "length"
        return r.finish is None

    def _next_inputs(
        self, tokens: list[int], active: list[bool], mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next step's (B, 1) input ids, the attention mask grown by one column and the (B, 1) position ids:
        each active row's new token; a finished row feeds padding, masked out."""
        dev = self.device
        nxt = torch.tensor([t if a else self.pad_token_id for t, a in zip(tokens, active, strict=True)], device=dev)
        step_mask = torch.tensor([1 if a else 0 for a in active], device=dev, dtype=mask.dtype)
        mask = torch.cat([mask, step_mask.unsqueeze(1)], dim=1)
        return nxt.unsqueeze(1), mask, (mask.sum(1, keepdim=True) - 1).clamp(min=0)

    @staticmethod
    def _prompt_logprobs(rows: list[_Row], logits: torch.Tensor, prompt_width: int) -> None:
        """Prompt log-probs of the rows that ask for them, from the prefill's (B, P, V) logits: the logits at
        position j predict token j + 1, and a row's prompt is the right end of its (left-padded) input. Temperature
        1, nothing masked: the model's own distribution, as the reference service computes it."""
        for i, r in enumerate(rows):
            k = r.opts.prompt_logprobs
            if k is None:
                continue
            n_prompt = len(r.prompt)
            lps = logits[i, prompt_width - n_prompt : prompt_width - 1].float().log_softmax(dim=-1)
            target = torch.tensor(r.prompt[1:], dtype=torch.long, device=lps.device)
            r.prompt_lp = [None, *lps.gather(1, target.unsqueeze(1)).squeeze(1).tolist()]
            if k:
                top_v, top_i = lps.topk(k, dim=-1)
                pairs = [list(zip(ix, v, strict=True)) for ix, v in zip(top_i.tolist(), top_v.tolist(), strict=True)]
                r.prompt_top = [None, *pairs]

    def _hit_stop_string(self, r: _Row) -> bool:
        text = decode_text(self._tokenizer, [*r.output, *r.tokens])
        hits = [(text.find(s), s) for s in r.opts.stop if s in text]
        if not hits:
            return False
        at, s = min(hits)
        r.text = text[:at]
        r.stop_reason = s
        return True

    # ------------------------------------------------------------------------------------------------ weights

    def _stage(self, tensors: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(model tensor, new data) pairs: each new tensor on the model's device and dtype, contiguous. ``tensors``
        are in the checkpoint layout (:mod:`rlhf.layout`); tied weights (one parameter under several names) get
        one entry, from the name the checkpoint keeps. Runs in a thread, outside the gate:
        a tensor already right (the received float32 CPU buckets) is used as it is, no copy."""
        model = self.model
        if not self._layout.identity:
            tensors = self._layout.to_live(tensors, model.state_dict())
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        seen: set[int] = set()
        pairs = []
        for name, target in named:
            if name not in tensors or id(target) in seen:  # non-persistent buffers are not in the state dict
                continue
            seen.add(id(target))
            new = tensors[name].detach().to(device=target.device, dtype=target.dtype)
            pairs.append((target, new.contiguous()))
        return pairs

    async def _prepare_weights(self, tensors: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return await asyncio.to_thread(self._stage, tensors)

    async def _load_weights(self, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # Double buffering: the staged tensors become the parameters' storage, O(number of tensors), no copy; the
        # Parameter objects stay (tied weights stay tied), the old storage is freed with its last reference.
        with torch.no_grad():
            for target, new in staged:
                target.data = new
