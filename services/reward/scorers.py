"""The reward scorers of ``reward.scorers`` (:class:`services.reward.engine.RewardEngine` combines them by weight):
``model`` (:class:`ModelScorer`: a one-label sequence-classification reward model, concurrent requests merged by
:class:`rlhf.serving.batching.MicroBatcher`), ``rule`` (:class:`RuleScorer`: :mod:`services.reward.rules` or a user
``module:function``), ``remote`` and ``judge`` (:mod:`services.reward.http_scorers`).

Every item gets a score or an error status, never a score of 0 for a failure; a request malformed as a whole
raises :class:`InvalidArgument` naming the field. Design: docs/services.md#reward.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rlhf.config import ScorerConfig
from rlhf.serving import InvalidArgument, NotReady, ServiceMetrics
from rlhf.serving.batching import REGATHER_S, MicroBatcher
from rlhf.serving.model_process import ModelProcess, set_torch_threads
from services.reward import rules

log = logging.getLogger("rlhf.reward")
T = TypeVar("T")

OK, INVALID_INPUT, SCORER_ERROR, TIMEOUT = "ok", "invalid_input", "scorer_error", "timeout"
STATUSES = (OK, INVALID_INPUT, SCORER_ERROR, TIMEOUT)

# Bounds of one merged reward-model call: the head request's latency grows with what is merged behind it.
MERGE_MICRO_BATCHES = 8
MERGE_MAX_TOKENS = 1 << 17


@dataclass
class Item:
    prompt: str
    response: str
    label: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    finished: bool = True
    cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # per-scorer encodings


@dataclass
class Failure:
    status: str
    message: str


@dataclass
class ScoreOutcome:
    score: float | None
    status: str = OK
    error: str = ""
    components: dict[str, float] = field(default_factory=dict)
    failed_scorer: str = ""


# ------------------------------------------------------------------------------------------------------------ scorers


class Scorer:
    type = "?"
    LOG_EVERY_S = 10.0  # failures are logged at most this often per scorer (with how many were not)

    def __init__(self, cfg: ScorerConfig, name: str):
        self.cfg = cfg
        self.name = name
        self.weight = cfg.weight
        self._logged_at = float("-inf")
        self._unlogged = 0

    def report_failure(self, message: str, exc: BaseException | None = None) -> None:
        """Log a failed item (the traceback of a raising user function included): a scorer that fails shows in the
        reward service's log, not only as an error status in the samples. Rate-limited: a scorer failing on every
        item logs once per ``LOG_EVERY_S`` with the count it left out."""
        now = time.monotonic()
        if now - self._logged_at < self.LOG_EVERY_S:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more failure(s) since the last report)" if self._unlogged else ""
        self._logged_at, self._unlogged = now, 0
        exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
        log.warning("%s%s", message, more, exc_info=exc_info)

    def load(self) -> None:
        """Blocking set-up (model loading); called once before serving."""

    def validate(self, items: list[Item]) -> None:
        """Raise InvalidArgument for a request this scorer can never score (before any work is done)."""

    async def score(self, items: list[Item]) -> list[float | Failure]:
        raise NotImplementedError

    async def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "weight": self.weight}


class RuleScorer(Scorer):
    type = "rule"

    def __init__(self, cfg: ScorerConfig, name: str, count_tokens=None):
        super().__init__(cfg, name)
        self.fn = rules.resolve_rule(cfg.name or "")
        self.builtin = (cfg.name or "") in rules.RULES
        self.kwargs = dict(cfg.kwargs)
        rules.check_kwargs(self.fn, self.kwargs, cfg.name or "")
        if self.builtin:
            self.kwargs = rules.prepare_kwargs(cfg.name or "", self.kwargs)
        self.wants_sample = rules.accepts_sample(self.fn)
        self.count_tokens = count_tokens

    def _one(self, it: Item) -> float | Failure:
        kwargs = dict(self.kwargs)
        if self.wants_sample:
            kwargs["sample"] = rules.RuleSample(
                it.prompt, it.response, it.label, it.prompt_ids, it.response_ids, it.finished, self.count_tokens
            )
        try:
            value = self.fn(it.prompt, it.response, it.label, **kwargs)
        except rules.RuleInputError as err:
            return Failure(INVALID_INPUT, f"scorer {self.name!r}: {err}")
        except Exception as err:  # noqa: BLE001 - a user function may raise anything
            message = f"scorer {self.name!r} raised {type(err).__name__}: {err}"
            self.report_failure(message, err)
            return Failure(SCORER_ERROR, message)
        try:
            value = float(value)
        except (TypeError, ValueError):
            message = f"scorer {self.name!r} returned {type(value).__name__}, not a number"
            self.report_failure(message)
            return Failure(SCORER_ERROR, message)
        if not math.isfinite(value):
            self.report_failure(f"scorer {self.name!r} returned {value}")
            return Failure(SCORER_ERROR, f"scorer {self.name!r} returned {value}")
        return value

    async def score(self, items: list[Item]) -> list[float | Failure]:
        if self.builtin and len(items) <= 64:  # microseconds: not worth a thread hop
            return [self._one(it) for it in items]
        # user functions may block (I/O, sandboxes): keep them off the event loop
        return await asyncio.to_thread(lambda: [self._one(it) for it in items])


class ModelScorer(Scorer):
    type = "model"

    def __init__(
        self,
        cfg: ScorerConfig,
        name: str,
        device: str,
        micro_batch_size: int,
        metrics: ServiceMetrics | None = None,
        padding_free: bool = False,
        bf16: bool = False,
        model_process: bool = False,
        threads: int | None = None,
        seq_length: int | None = None,
    ):
        super().__init__(cfg, name)
        self.threads = threads  # the forward's torch threads (None: leave them as they are)
        # RLHF_MODEL_PROCESS: the model and its forward in a child process (rlhf.serving.model_process); the
        # tokenizer stays here (validation and encoding happen before a request is merged)
        self.model_process = model_process
        self._proc: ModelProcess | None = None
        self.loaded: dict = {}
        self.device_name = device
        self.bf16 = bf16  # reward.bf16: serve in bf16 on an accelerator (rlhf.models.serving_dtype)
        self.seq_length = seq_length  # reward.seq_length: the longest sequence scored, within the model's context
        self.micro_batch_size = micro_batch_size
        self.padding_free = padding_free  # training.padding_free: the forward skips padding (rlhf.packing)
        self.model = None
        self.tokenizer = None
        self.max_len = 0
        self._backend = None
        self._lock = threading.Lock()
        on_batch = None
        if metrics is not None:
            on_batch = lambda n, rows: metrics.observe_merged(f"score:{name}", n, rows)
        self._batcher = MicroBatcher(
            lambda _key, seqs: self._forward(seqs),
            max_rows=MERGE_MICRO_BATCHES * micro_batch_size,
            max_cost=MERGE_MAX_TOKENS,
            on_batch=on_batch,
            regather_s=0.0 if model_process else REGATHER_S,  # rlhf.serving.batching: not beside a model process
        )
        if metrics is not None:
            metrics.watch_batcher(f"score:{name}", self._batcher)

    def load(self) -> None:
        import torch

        from rlhf.models import load_sequence_classifier, load_tokenizer, resolve_model_path, serving_dtype

        path = resolve_model_path(self.cfg.load or "")
        self.tokenizer = load_tokenizer(path)
        if self.model_process:
            init = {
                "scorer": self.cfg.model_dump(mode="json"),
                "name": self.name,
                "device": self.device_name,
                "micro_batch_size": self.micro_batch_size,
                "padding_free": self.padding_free,
                "bf16": self.bf16,
            }
            self._proc = ModelProcess(
                "services.reward.scorers:process_handler", init, f"reward model {self.name}", threads=self.threads
            )
            hello = self._proc.start()
        else:
            set_torch_threads(self.threads)
            dtype = serving_dtype(self.bf16, self.device_name)
            self.model = load_sequence_classifier(path, device=self.device_name, dtype=dtype).eval()
            hello = {
                "max_len": int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30),
                "vocab": int(self.model.config.vocab_size),
                "where": f"{self.model.device} in {self.model.dtype}",
                "torch_threads": torch.get_num_threads(),
            }
        self.loaded = hello  # what was loaded, where (the model process sends its own as its hello)
        self.max_len, self.vocab = hello["max_len"], hello["vocab"]
        self._backend = self._fast_backend()
        where = hello["where"] + (f", in model process {self._proc.pid}" if self._proc is not None else "")
        log.info("reward model %s loaded from %s on %s", self.name, path, where)

    def _fast_backend(self):
        """The Rust tokenizer under a fast HF tokenizer, when calling it directly gives the same ids: the HF wrapper
        costs more per call than encoding a few short texts (it re-applies truncation/padding settings and converts
        every encoding). Checked on probe texts here, once; None (use the wrapper) when they differ."""
        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None) if getattr(tok, "is_fast", False) else None
        if backend is None:
            return None
        probe = ["Hello world 12 + 30 = 42. \\boxed{7}", "  two\nlines\t", "é ü 中文"]
        try:
            for special in (False, True):
                want = tok(probe, add_special_tokens=special)["input_ids"]  # leaves no truncation/padding set
                got = [e.ids for e in backend.encode_batch(probe, add_special_tokens=special)]
                if got != want or backend.truncation is not None or backend.padding is not None:
                    return None
        except Exception:  # noqa: BLE001 - an unusual tokenizer: the wrapper it is
            return None
        return backend

    def _tokenize(self, texts: list[str], special: bool) -> list[list[int]]:
        if self._backend is not None:
            return [e.ids for e in self._backend.encode_batch(texts, add_special_tokens=special)]
        return self.tokenizer(texts, add_special_tokens=special)["input_ids"]

    def _texts(self, items: list[Item]) -> list[str] | None:
        """The chat-template texts of ``items`` (one batched render), or None when the tokenizer has no template."""
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            return None
        convs = [
            [{"role": "user", "content": it.prompt}, {"role": "assistant", "content": it.response}] for it in items
        ]
        return list(tok.apply_chat_template(convs, tokenize=False))

    def _text(self, it: Item) -> str | None:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            msgs = [{"role": "user", "content": it.prompt}, {"role": "assistant", "content": it.response}]
            return tok.apply_chat_template(msgs, tokenize=False)
        return None

    def encode(self, it: Item) -> list[int]:
        key = f"ids:{self.name}"
        if key not in it.cache:
            it.cache[key] = self._encode(it)
        return it.cache[key]

    def _encode(self, it: Item) -> list[int]:
        tok = self.tokenizer
        if not it.prompt and it.prompt_ids:  # token ids only: used as is (they must be the reward model's ids)
            return list(it.prompt_ids) + list(it.response_ids)
        text = self._text(it)
        if text is not None:
            return tok(text, add_special_tokens=False)["input_ids"]
        return tok(it.prompt + it.response)["input_ids"]

    def encode_many(self, items: list[Item]) -> None:
        """Fill the id caches of ``items``: one tokenizer call for all the texts (a fast tokenizer's batch call
        costs far less than a call per item; the ids are the same)."""
        key = f"ids:{self.name}"
        todo = []
        for it in items:
            if key in it.cache:
                continue
            if not it.prompt and it.prompt_ids:
                it.cache[key] = list(it.prompt_ids) + list(it.response_ids)
            else:
                todo.append(it)
        if not todo:
            return
        texts = self._texts(todo)
        templated = texts is not None
        if texts is None:
            texts = [it.prompt + it.response for it in todo]
        for it, ids in zip(todo, self._tokenize(texts, special=not templated), strict=True):
            it.cache[key] = ids

    def validate(self, items: list[Item]) -> None:
        if self.tokenizer is None:
            return
        self.encode_many(items)
        for i, it in enumerate(items):
            ids = self.encode(it)
            if not ids:
                raise InvalidArgument(f"items[{i}] encodes to no tokens; send a non-empty prompt", f"items[{i}].prompt")
            if len(ids) > self.max_len:
                raise InvalidArgument(
                    f"items[{i}].response: prompt + response is {len(ids)} tokens for the reward model "
                    f"{self.name!r}, which accepts at most {self.max_len}; shorten the response (or the prompt)",
                    f"items[{i}].response",
                )
            # reward.seq_length counts the sequence as the policy made it (MindSpeed's reward reads the actor's
            # tokens): its ids when the item carries them; the scorer's own encoding adds its chat template
            n = len(it.prompt_ids) + len(it.response_ids) if it.prompt_ids else len(ids)
            if self.seq_length is not None and n > self.seq_length:
                raise InvalidArgument(
                    f"items[{i}].response: prompt + response is {n} tokens, more than reward.seq_length "
                    f"{self.seq_length}; shorten the response (or the prompt)",
                    f"items[{i}].response",
                )
            bad = [t for t in ids if not 0 <= t < self.vocab] if min(ids) < 0 or max(ids) >= self.vocab else []
            if bad:
                raise InvalidArgument(
                    f"items[{i}].prompt_ids/response_ids contain {bad[0]}, outside the reward model's vocabulary "
                    f"[0, {self.vocab}); send text instead, or ids of this tokenizer",
                    f"items[{i}].prompt_ids",
                )

    def _forward(self, seqs: list[list[int]]) -> list[float]:
        if self._proc is None:
            return self._forward_here(seqs)
        ids = array("i")  # to the model process as int32, the scores back as float32 (the values computed here)
        for q in seqs:
            ids.extend(q)
        _, payload = self._proc.call({"lens": [len(q) for q in seqs]}, ids.tobytes())
        out = array("f")
        out.frombytes(payload)
        return out.tolist()

    def _forward_here(self, seqs: list[list[int]]) -> list[float]:
        import torch

        from rlhf.models import score_head_outputs

        pad = self.tokenizer.pad_token_id
        out = [0.0] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda k: len(seqs[k]))
        dev = self.model.device
        with self._lock, torch.inference_mode():
            for s in range(0, len(order), self.micro_batch_size):
                idx = order[s : s + self.micro_batch_size]
                width = max(len(seqs[k]) for k in idx)
                batch = torch.full((len(idx), width), pad, dtype=torch.long)
                for r, k in enumerate(idx):
                    batch[r, : len(seqs[k])] = torch.tensor(seqs[k], dtype=torch.long)
                values = score_head_outputs(self.model, batch.to(dev), pad, self.padding_free).float().cpu()
                for r, k in enumerate(idx):
                    out[k] = float(values[r, len(seqs[k]) - 1])
        return out

    async def close(self) -> None:
        if self._proc is not None:
            await asyncio.to_thread(self._proc.close)

    async def score(self, items: list[Item]) -> list[float | Failure]:
        if self.model is None and self._proc is None:
            raise NotReady(f"reward model {self.name!r} is still loading; retry shortly")
        seqs = [self.encode(it) for it in items]
        try:
            values = await self._batcher.submit(None, seqs, sum(len(q) for q in seqs))
        except Exception as err:  # a model failure is an error status for every item
            log.exception("reward model %s failed", self.name)
            return [Failure(SCORER_ERROR, f"scorer {self.name!r} failed: {type(err).__name__}: {err}")] * len(items)
        return [v if math.isfinite(v) else Failure(SCORER_ERROR, f"scorer {self.name!r} produced {v}") for v in values]


class _ProcessHandler:
    """The model process's side (``rlhf.serving.model_process``): the scorer, loaded there, runs each merged call."""

    def __init__(self, init: dict):
        self.scorer = ModelScorer(
            ScorerConfig(**init["scorer"]),
            init["name"],
            init["device"],
            init["micro_batch_size"],
            padding_free=init["padding_free"],
            bf16=init["bf16"],
        )
        self.scorer.load()
        self.hello = self.scorer.loaded

    def call(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        ids = array("i")
        ids.frombytes(payload)
        seqs, off = [], 0
        for n in header["lens"]:
            seqs.append(ids[off : off + n].tolist())
            off += n
        return {}, array("f", self.scorer._forward_here(seqs)).tobytes()


def process_handler(init: dict) -> _ProcessHandler:
    return _ProcessHandler(init)
