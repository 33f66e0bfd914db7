"""The reference service's state: the frozen reference policy and its per-token log-probs of given responses.

``logprobs(items, temperature)``: ``log_softmax(logits / T)`` gathered at the response tokens, with the forward
convention of :mod:`rlhf.models`, in micro-batches (:mod:`rlhf.reference_logprobs`, which the trainer's in-process
step shares); concurrent requests of
the same temperature are merged into one forward call (:class:`rlhf.serving.batching.MicroBatcher`, up to
``MERGE_MICRO_BATCHES`` micro-batches and ``MERGE_MAX_TOKENS`` tokens). Design: docs/services.md#reference.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from array import array
from dataclasses import dataclass

from rlhf.config import ExperimentConfig, parse_config
from rlhf.serving import Internal, InvalidArgument, NotReady, ServiceMetrics
from rlhf.serving.batching import REGATHER_S, MicroBatcher
from rlhf.serving.model_process import ModelProcess, set_torch_threads

log = logging.getLogger("rlhf.reference")

MAX_ITEMS = 4096
# Bounds of one merged call: the head request's latency grows with what is merged behind it.
MERGE_MICRO_BATCHES = 8
MERGE_MAX_TOKENS = 1 << 17
# Requests with more ids than this are validated in a worker thread, not on the event loop.
OFFLOAD_IDS = 1 << 16
# Logits are divided by the temperature in float32: 1e-300 is 0 there and gave NaN / -inf "log-probs". Below the
# rollout's greedy threshold (services.rollout.options.GREEDY_EPS) no sampled policy matches anyway.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e6


class NonFiniteOutput(Internal):
    """The model computed NaN or inf for a valid request: an error (500), never a result."""


@dataclass
class LogProbsItem:
    prompt_ids: list[int]
    response_ids: list[int]


class ReferenceEngine:
    def __init__(
        self,
        cfg: ExperimentConfig,
        device: str | None = None,
        metrics: ServiceMetrics | None = None,
        max_items: int = MAX_ITEMS,
        model_process: bool = False,
        threads: int | None = None,
    ):
        self.cfg = cfg
        # RLHF_MODEL_PROCESS: the model and its forward in a child process; threads: the forward's torch threads
        # (None: leave them as they are); rlhf.serving.model_process
        self.model_process = model_process
        self.threads = threads
        self._proc: ModelProcess | None = None
        ref = cfg.actor_rollout_ref.ref
        self.model_spec = ref.load or cfg.actor.load
        self.temperature = float(ref.temperature if ref.temperature is not None else cfg.sample_temperature)
        self.micro_batch_size = ref.micro_batch_size
        self.device = device or "auto"
        self.metrics = metrics
        self.max_items = max_items
        self.model = None
        self.pad_token_id = 0
        self.vocab_size = 0
        self.max_len = 0
        self.ready = False
        self.loaded: dict = {}
        self._lock = threading.Lock()
        self._batcher = MicroBatcher(
            lambda t, items: self._forward(items, t),
            max_rows=MERGE_MICRO_BATCHES * self.micro_batch_size,
            max_cost=MERGE_MAX_TOKENS,
            on_batch=(lambda n, rows: metrics.observe_merged("logprobs", n, rows)) if metrics is not None else None,
            regather_s=0.0 if model_process else REGATHER_S,  # rlhf.serving.batching: not beside a model process
        )
        if metrics is not None:
            metrics.watch_batcher("logprobs", self._batcher)

    # -- life cycle

    def load(self) -> None:
        import torch

        from rlhf.models import load_causal_lm, load_policy_base, load_tokenizer, resolve_model_path, serving_dtype

        if not MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"reference temperature {self.temperature} is outside [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] "
                "(actor_rollout_ref.ref.temperature, else actor_rollout.temperature)"
            )
        if self.model_process:
            self._proc = ModelProcess(
                "services.reference.engine:process_handler",
                {"config": self.cfg.model_dump(mode="json", exclude_unset=True), "device": self.device},
                "reference",
                {"NonFiniteOutput": NonFiniteOutput},
                threads=self.threads,
            )
            hello = self._proc.start()
        else:
            set_torch_threads(self.threads)
            path = resolve_model_path(self.model_spec)
            tok = load_tokenizer(path)
            dtype = serving_dtype(self.cfg.actor_rollout_ref.ref.bf16, self.device)
            if self.cfg.actor_rollout_ref.ref.load is None:  # the actor's initial weights, as its base loads
                model = load_policy_base(path, self.device, dtype, self.cfg.actor).eval()
            else:
                model = load_causal_lm(path, device=self.device, dtype=dtype).eval()
            for p in model.parameters():
                p.requires_grad_(False)
            self.model = model
            hello = {
                "path": str(path),
                "pad_token_id": int(tok.pad_token_id),
                "vocab_size": int(model.config.vocab_size),
                "max_len": int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30),
                "where": f"{model.device} in {model.dtype}",
                "torch_threads": torch.get_num_threads(),
            }
        self.loaded = hello  # what was loaded, where (the model process sends its own as its hello)
        self.pad_token_id = hello["pad_token_id"]
        self.vocab_size = hello["vocab_size"]
        # MindSpeed's per-role seq_length: the longest sequence this role takes, within the model's context
        self.max_len = min(hello["max_len"], self.cfg.actor_rollout_ref.ref.seq_length or hello["max_len"])
        self.ready = True
        where = hello["where"] + (f", in model process {self._proc.pid}" if self._proc is not None else "")
        log.info(
            "reference model loaded from %s on %s (temperature %g, vocab %d, context %d)",
            hello["path"],
            where,
            self.temperature,
            self.vocab_size,
            self.max_len,
        )

    async def start(self) -> None:
        await asyncio.to_thread(self.load)

    async def close(self) -> None:
        if self._proc is not None:
            await asyncio.to_thread(self._proc.close)

    def info(self) -> dict:
        return {
            "model": self.model_spec,
            "temperature": self.temperature,
            "vocab_size": self.vocab_size,
            "max_length": self.max_len,
            "micro_batch_size": self.micro_batch_size,
        }

    # -- validation

    def validate(self, items: list[LogProbsItem], temperature: float | None) -> float:
        if not items:
            raise InvalidArgument("items is empty: send at least one {prompt_ids, response_ids} item", "items")
        if len(items) > self.max_items:
            raise InvalidArgument(f"items has {len(items)} entries; send at most {self.max_items} per request", "items")
        if temperature is not None and not (MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):  # NaN fails too
            raise InvalidArgument(
                f"temperature is {temperature}; send a value in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] or leave "
                f"it unset (the service default is {self.temperature})",
                "temperature",
            )
        for i, it in enumerate(items):
            if not it.prompt_ids:
                raise InvalidArgument(
                    f"items[{i}].prompt_ids is empty: send at least one prompt token (the first "
                    "response token is predicted from the prompt)",
                    f"items[{i}].prompt_ids",
                )
            if not it.response_ids:
                raise InvalidArgument(
                    f"items[{i}].response_ids is empty: send at least one response token", f"items[{i}].response_ids"
                )
            n = len(it.prompt_ids) + len(it.response_ids)
            if n > self.max_len:
                raise InvalidArgument(
                    f"items[{i}].response_ids: prompt_ids + response_ids is {n} tokens; the reference model's "
                    f"context is {self.max_len} (the model's, or actor_rollout_ref.ref.seq_length if shorter): "
                    "shorten the prompt or the response",
                    f"items[{i}].response_ids",
                )
            for fname in ("prompt_ids", "response_ids"):
                ids = getattr(it, fname)
                if min(ids) >= 0 and max(ids) < self.vocab_size:  # C-speed check; the slow scan only names the culprit
                    continue
                for j, t in enumerate(ids):
                    if not 0 <= t < self.vocab_size:
                        raise InvalidArgument(
                            f"items[{i}].{fname}[{j}] is {t}, outside the vocabulary [0, "
                            f"{self.vocab_size}); send ids of the policy's tokenizer",
                            f"items[{i}].{fname}[{j}]",
                        )
        return float(temperature) if temperature is not None else self.temperature

    # -- compute

    def _forward(self, items: list[LogProbsItem], temperature: float) -> list[list[float]]:
        if self._proc is None:
            return [row.tolist() for row in self._forward_rows(items, temperature)]
        # the model process: ids as int32 there, the log-probs as float32 back (the same values as in-process)
        ids = array("i")
        for it in items:
            ids.extend(it.prompt_ids)
            ids.extend(it.response_ids)
        header = {
            "temperature": temperature,
            "prompt_lens": [len(it.prompt_ids) for it in items],
            "response_lens": [len(it.response_ids) for it in items],
        }
        _, payload = self._proc.call(header, ids.tobytes())
        flat = array("f")
        flat.frombytes(payload)
        out, off = [], 0
        for it in items:
            n = len(it.response_ids)
            out.append(flat[off : off + n].tolist())
            off += n
        return out

    def _forward_rows(self, items: list[LogProbsItem], temperature: float) -> list:
        """Each item's response log-probs as a float32 tensor (the model in this process)."""
        import torch

        from rlhf.reference_logprobs import response_logprobs

        prompts = [it.prompt_ids for it in items]
        responses = [it.response_ids for it in items]
        with self._lock:
            rows = response_logprobs(
                self.model,
                prompts,
                responses,
                self.pad_token_id,
                temperature,
                self.micro_batch_size,
                self.cfg.training.padding_free,
            )
        for k, row in enumerate(rows):
            if not bool(torch.isfinite(row).all()):  # never a NaN / -inf "log-prob" as a success
                j = int((~torch.isfinite(row)).nonzero()[0])
                raise NonFiniteOutput(
                    f"the reference model gave a non-finite log-prob ({float(row[j])}) for "
                    f"items[{k}].response_ids[{j}]; nothing was returned (the model's weights or this "
                    "temperature overflow float32)",
                    f"items[{k}].response_ids[{j}]",
                )
        return rows

    async def logprobs(
        self, items: list[LogProbsItem], temperature: float | None = None
    ) -> tuple[list[list[float]], float]:
        if not self.ready:
            raise NotReady("the reference model is still loading; retry when /readyz answers 200")
        cost = sum(len(it.prompt_ids) + len(it.response_ids) for it in items)
        if cost > OFFLOAD_IDS:
            t = await asyncio.to_thread(self.validate, items, temperature)  # long id lists: off the event loop
        else:
            t = self.validate(items, temperature)
        result = await self._batcher.submit(t, items, cost)
        if self.metrics is not None:
            self.metrics.add_tokens("prompt", sum(len(it.prompt_ids) for it in items))
            self.metrics.add_tokens("response", sum(len(it.response_ids) for it in items))
        return result, t


class _ProcessHandler:
    """The model process's side (``rlhf.serving.model_process``): this engine, loaded there, runs each merged call."""

    def __init__(self, init: dict):
        self.engine = ReferenceEngine(parse_config(init["config"]), device=init["device"])
        self.engine.load()
        self.hello = self.engine.loaded

    def call(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        import torch

        ids = array("i")
        ids.frombytes(payload)
        items, off = [], 0
        for p, r in zip(header["prompt_lens"], header["response_lens"], strict=True):
            items.append(LogProbsItem(ids[off : off + p].tolist(), ids[off + p : off + p + r].tolist()))
            off += p + r
        rows = self.engine._forward_rows(items, float(header["temperature"]))
        return {}, torch.cat(rows).numpy().tobytes() if rows else b""


def process_handler(init: dict) -> _ProcessHandler:
    return _ProcessHandler(init)
