"""The training service's state: one base model loaded once, a LoRA adapter + Adam optimizer per training run, the
futures of queued requests, and the checkpoints of every run on disk.

Every model operation (create_model, forward_backward, optim_step, save/load) runs on ONE worker thread in the order
the requests arrived: the SDK sends a training client's requests in seq_id order and waits for each to be accepted
before it sends the next, so arrival order is its order; runs of different clients interleave between requests. The
adapters live in one PEFT model over the shared base (``add_adapter`` / ``set_adapter``), each with its own optimizer;
a request touches only its run's adapter.

Isolation: every session, run, future and checkpoint belongs to the token (user) that created it; another token gets
404 for it, as for something that does not exist.

Durability: a checkpoint (``save_weights``) is a folder ``<root>/<run>/weights/<name>/`` with the adapter
(``adapter.safetensors``), the Adam state (``optimizer.safetensors``) and ``state.json``, written to a temporary
folder and renamed into place, so a crash leaves either the whole checkpoint or none. Futures are in memory: their ids
carry this process's boot id, and a future of an earlier process (the service restarted while it was queued, running
or unretrieved) is answered with an error, never a result. Design: docs/tinker.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlhf.algo.tinker_losses import LOSSES, tinker_loss
from rlhf.checkpoints import fsync_files
from rlhf.serving import FailedPrecondition, InvalidArgument, NotFound, NotReady
from services.training.sampling import SampleSpec, encode_sample_response, generate
from services.training.wire import ForwardBackwardCall

log = logging.getLogger("rlhf.training")

# The built-in losses the tinker SDK names (tinker.types.LossFnType), all in rlhf.algo.tinker_losses.
SDK_LOSSES = LOSSES
# Module names of a Llama-style decoder that the SDK's train_attn / train_mlp / train_unembed select.
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
LORA_ALPHA = 32.0  # fixed: the SDK's LoraConfig has no alpha
MAX_RANK = 256
# Seconds retrieve_future waits for a running request before answering try_again: the SDK polls again at once after a
# try_again, so the server holds the poll (its read timeout is 45 s).
LONG_POLL_S = 20.0
KEEP_FUTURES = 4096  # finished futures kept for retrieval (oldest dropped first)
SEGMENTS = {"weights": "training", "sampler_weights": "sampler"}
# Checkpoint lifetimes the SDK documents for ttl_seconds: 1 hour to 10 years (None: never expires).
MIN_TTL_S = 3600
MAX_TTL_S = 10 * 365 * 86400
CHECKPOINT_JSON = "checkpoint.json"
# A session without a heartbeat for this long has its runs unloaded (the SDK heartbeats every 10 s).
SESSION_TTL_S = 600.0
# Padded tokens (rows x longest) of one forward; a batch is cut into micro-batches of at most this many.
MICRO_BATCH_TOKENS = 8192


class RequestFailed(Exception):
    """A queued request that failed: the future answers ``{"error": message, "category": category}``."""

    def __init__(self, message: str, category: str = "user"):
        super().__init__(message)
        self.message = message
        self.category = category


@dataclass
class AdamStep:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class LoraSpec:
    rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Run:
    model_id: str
    owner: str
    adapter: str  # the PEFT adapter name in the shared model
    lora: LoraSpec
    params: dict[str, torch.nn.Parameter]  # canonical name (adapter name removed) -> parameter
    optimizer: torch.optim.AdamW
    steps: int = 0
    user_metadata: dict | None = None


@dataclass
class Sampler:
    """A sampling client's session: the weights it was created from, pinned for its life (a later save of the
    run makes a new snapshot, never changes this one)."""

    sampler_id: str
    owner: str
    model_path: str | None  # None: the base model, or an unnamed save (save_weights_and_get_sampling_client)
    snapshot: str | None  # the key of its adapter snapshot in TrainingEngine._snapshots; None: the base model


@dataclass
class Snapshot:
    adapter: str  # the PEFT adapter name in the shared model
    samplers: set[str] = field(default_factory=set)


@dataclass
class _Future:
    owner: str
    kind: str
    future: concurrent.futures.Future


@dataclass
class Session:
    owner: str
    created: float
    last_heartbeat: float
    finished: str | None = None
    meta: dict = field(default_factory=dict)


def owner_of(token: str) -> str:
    """A user's id: a digest of the token (the token itself is never stored or written)."""
    return hashlib.sha256(token.encode()).hexdigest()[:16]


def run_dir_name(model_id: str) -> str:
    """The folder of a run under the checkpoint root; an id that would name a hidden or parent folder is refused."""
    if not model_id or model_id.startswith(".") or "/" in model_id or "\\" in model_id or len(model_id) > 200:
        raise InvalidArgument(f"{model_id!r} is not a training run id", field="model_id")
    return model_id.replace(":", "_")


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``tinker://<run>/<weights|sampler_weights>/<name>`` -> (run model id, segment, name)."""
    if not path.startswith("tinker://"):
        raise InvalidArgument(f"path {path!r} is not a tinker:// path", field="path")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENTS or not parts[0] or not parts[2]:
        raise InvalidArgument(f"path {path!r} is not tinker://<run>/weights/<name>", field="path")
    return parts[0], parts[1], parts[2]


def _check_name(name: str, what: str) -> str:
    if not name or "/" in name or name in (".", "..") or name.startswith(".") or len(name) > 200:
        raise InvalidArgument(f"{what} {name!r}: give a plain name (no '/', not starting with '.')", field="path")
    return name


class TrainingEngine:
    def __init__(
        self,
        base_model: str,
        root: str | Path,
        device: str = "cpu",
        session_ttl_s: float = SESSION_TTL_S,
    ):
        self.base_model = base_model
        self.session_ttl_s = session_ttl_s
        self._gone: dict[str, str] = {}  # model id -> why it was unloaded
        self._expiry: asyncio.Task | None = None
        self.root = Path(root)
        self.device = device
        self.boot = uuid.uuid4().hex[:12]
        self.ready = False
        self.base: Any = None
        self.peft: Any = None
        self.vocab_size = 0
        self.max_length = 0
        self.arch = ""
        self.present_modules: set[str] = set()
        self.sessions: dict[str, Session] = {}
        self.runs: dict[str, Run] = {}
        self._futures: OrderedDict[str, _Future] = OrderedDict()
        self._counter = 0
        self._seq: dict[str, tuple[int, str]] = {}  # model id -> (last seq_id, its request id)
        self._created: dict[str, str] = {}  # model id -> the request id that creates it
        self._adapters = 0
        self.samplers: dict[str, Sampler] = {}
        self._snapshots: dict[str, Snapshot] = {}
        self._sample_seq: dict[tuple[str, int], tuple[str, list[str]]] = {}  # (sampler, seq_id) -> its future
        self.eos_ids: set[int] = set()
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="training-model")
        self._base_bytes = 0

    # ------------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._worker, self._load)
        self.ready = True
        self._expiry = asyncio.create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.session_ttl_s / 3))
            try:
                self.expire()
            except Exception:  # the loop must outlive one bad pass; the error goes to the log
                log.exception("training: session expiry failed")

    def _load(self) -> None:
        from rlhf.models import load_causal_lm, resolve_model_path  # noqa: PLC0415 - torch/transformers at start-up

        self.root.mkdir(parents=True, exist_ok=True)
        path = resolve_model_path(self.base_model)
        model = load_causal_lm(path, device=self.device)
        model.eval()  # no dropout: two passes over the same tokens give the same log-probs
        for p in model.parameters():
            p.requires_grad_(False)
        self.base = model
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        self.max_length = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        self.arch = str(getattr(cfg, "model_type", ""))
        self.present_modules = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        self._base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        for source in (cfg, getattr(model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None)
            self.eos_ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        log.info("training: base %s loaded (%s, vocab %d)", self.base_model, self.arch, self.vocab_size)

    def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _need_ready(self) -> None:
        if not self.ready:
            raise NotReady("the base model is still loading: retry shortly")

    # ------------------------------------------------------------------------------------------------ sessions

    def create_session(self, owner: str, meta: dict) -> str:
        session_id = uuid.uuid4().hex
        now = time.monotonic()
        self.sessions[session_id] = Session(owner, now, now, meta=meta)
        return session_id

    def session(self, owner: str, session_id: str, live: bool = True) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.owner != owner:
            raise NotFound(f"session {session_id!r} does not exist (or is not yours)", field="session_id")
        if live and s.finished is not None:
            raise NotFound(
                f"session {session_id!r} is over ({s.finished}): start a new ServiceClient", field="session_id"
            )
        return s

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.session(owner, session_id).last_heartbeat = time.monotonic()

    def finish_session(self, owner: str, session_id: str, reason: str) -> None:
        s = self.session(owner, session_id, live=False)
        if s.finished is None:  # first reason wins, as the SDK documents
            s.finished = reason
            self._unload_session(session_id, f"its session was closed ({reason or 'no reason'})")

    def expire(self, now: float | None = None) -> concurrent.futures.Future | None:
        """Unload the runs of sessions that missed their heartbeats for ``session_ttl_s`` (the SDK sends one every
        10 s while its client lives): a client that is gone holds no adapter. Returns the unload job, if any."""
        now = time.monotonic() if now is None else now
        stale = [
            sid
            for sid, s in self.sessions.items()
            if s.finished is None and now - s.last_heartbeat > self.session_ttl_s
        ]
        job = None
        for sid in stale:
            self.sessions[sid].finished = "expired"
            job = self._unload_session(sid, f"its session sent no heartbeat for {self.session_ttl_s:.0f} s")
        # checkpoints past their ttl_seconds, on the model's thread (never under a load of the same folder)
        self._worker.submit(self.sweep_checkpoints, time.time())
        return job

    def sweep_checkpoints(self, now: float) -> list[Path]:
        """Delete the checkpoints whose ``ttl_seconds`` ran out by ``now`` (wall clock); returns their folders."""
        gone = []
        for record in self.root.glob(f"*/*/*/{CHECKPOINT_JSON}"):
            folder = record.parent
            if not folder.name.startswith(".") and _expired(folder, now):
                shutil.rmtree(folder, ignore_errors=True)
                gone.append(folder)
                log.info("training: checkpoint %s expired", folder)
        return gone

    def _unload_session(self, session_id: str, why: str) -> concurrent.futures.Future | None:
        prefix = f"{session_id}:train:"
        # list(...) copies in one step: the model's thread adds runs while this reads
        model_ids = sorted({m for m in list(self.runs) + list(self._created) if m.startswith(prefix)})
        samplers = [s for s in list(self.samplers) if s.startswith(f"{session_id}:sample:")]
        if not model_ids and not samplers:
            return None
        # on the model's thread, after the requests already queued for these runs
        return self._worker.submit(self._unload_job, model_ids, why, samplers)

    def _unload_job(self, model_ids: list[str], why: str, samplers: list[str] = ()) -> None:
        for sampler_id in samplers:
            self._release_sampler(sampler_id)
        for model_id in model_ids:
            run = self.runs.pop(model_id, None)
            self._gone[model_id] = why
            self._seq.pop(model_id, None)
            if run is not None:
                run.optimizer.state.clear()
                self.peft.delete_adapter(run.adapter)
                log.info("training: unloaded %s: %s", model_id, why)

    # ------------------------------------------------------------------------------------------------ futures

    def _submit(self, owner: str, kind: str, fn, *args) -> str:
        with self._lock:
            self._counter += 1
            request_id = f"{self.boot}-{self._counter}"
        entry = _Future(owner, kind, self._worker.submit(fn, *args))
        with self._lock:
            self._futures[request_id] = entry
            self._trim()
        return request_id

    def _retry_of(self, model_id: str, seq_id: int | None) -> str | None:
        """The SDK numbers a training client's requests (seq_id 1, 2, ...) and resends one whose answer it lost: the
        request id of an accepted seq_id again (a resend, not a second step), None for a new one. Going backwards is
        refused: the requests of a model run in the order they are numbered."""
        if not seq_id:
            return None
        last = self._seq.get(model_id)
        if last is None or seq_id > last[0]:
            return None
        if seq_id == last[0]:
            return last[1]
        raise InvalidArgument(
            f"seq_id {seq_id} comes after seq_id {last[0]} for model {model_id}: a training client's requests are "
            "numbered in the order they are sent",
            field="seq_id",
        )

    def _submit_seq(self, owner: str, model_id: str, seq_id: int | None, kind: str, fn, *args) -> str:
        request_id = self._submit(owner, kind, fn, *args)
        if seq_id:
            self._seq[model_id] = (seq_id, request_id)
        return request_id

    def _trim(self) -> None:
        finished = [k for k, v in self._futures.items() if v.future.done()]
        for key in finished[: max(0, len(finished) - KEEP_FUTURES)]:
            del self._futures[key]

    async def retrieve(self, owner: str, request_id: str) -> tuple[str, Any]:
        """("pending", None) | ("done", result) | ("failed", (message, category))."""
        boot, _, number = request_id.partition("-")
        if boot != self.boot and len(boot) == len(self.boot) and number.isdigit():
            return "failed", (
                f"request {request_id} was accepted by an earlier run of the training service, which stopped before "
                "its result was retrieved; nothing of it is known now: reload your last checkpoint (load_state) and "
                "resend",
                "server",
            )
        entry = self._futures.get(request_id)
        if entry is None or entry.owner != owner:
            raise NotFound(f"request {request_id!r} is not known (or not yours)", field="request_id")
        if not entry.future.done():
            # any outcome (done, failed, still running) is read below
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(entry.future)), LONG_POLL_S)
        if not entry.future.done():
            return "pending", None
        err = entry.future.exception()
        if err is None:
            return "done", entry.future.result()
        if isinstance(err, RequestFailed):
            return "failed", (err.message, err.category)
        if isinstance(err, (InvalidArgument, NotFound, FailedPrecondition, ValueError)):
            return "failed", (str(err), "user")
        log.exception("training: request %s failed", request_id, exc_info=err)
        return "failed", (f"internal error in {entry.kind}: {type(err).__name__}", "server")

    # ------------------------------------------------------------------------------------------------ runs

    def run(self, owner: str, model_id: str) -> Run:
        r = self.runs.get(model_id)
        if (
            r is None
            and model_id in self._gone
            and self.sessions.get(model_id.split(":", 1)[0], Session("", 0, 0)).owner == owner
        ):
            raise NotFound(
                f"model {model_id!r} was unloaded ({self._gone[model_id]}): resume from a checkpoint "
                "(create_training_client_from_state_with_optimizer)",
                field="model_id",
            )
        if r is None or r.owner != owner:
            raise NotFound(f"model {model_id!r} does not exist (or is not yours)", field="model_id")
        return r

    def _targets(self, lora: LoraSpec) -> list[str]:
        wanted = (
            (ATTN_MODULES if lora.train_attn else ())
            + (MLP_MODULES if lora.train_mlp else ())
            + (UNEMBED_MODULES if lora.train_unembed else ())
        )
        targets = [m for m in wanted if m in self.present_modules]
        if not targets:
            raise InvalidArgument(
                "lora_config selects no module of the base model: set train_attn, train_mlp or train_unembed",
                field="lora_config",
            )
        return targets

    def check_lora(self, lora: LoraSpec) -> None:
        if not 1 <= lora.rank <= MAX_RANK:
            raise InvalidArgument(f"lora_config.rank {lora.rank} must be in 1..{MAX_RANK}", field="lora_config.rank")
        if self.ready:
            self._targets(lora)

    def create_model(
        self, owner: str, session_id: str, model_seq_id: int, base_model: str, lora: LoraSpec, meta: dict | None
    ) -> str:
        self._need_ready()
        self.session(owner, session_id)
        if base_model != self.base_model:
            raise InvalidArgument(
                f"base_model {base_model!r} is not served here: this service trains LoRA adapters over "
                f"{self.base_model!r} (get_server_capabilities)",
                field="base_model",
            )
        self.check_lora(lora)
        model_id = f"{session_id}:train:{model_seq_id}"
        if (again := self._created.get(model_id)) is not None:
            return again  # a resend (the SDK lost the answer): the same future, not a second run
        request_id = self._submit(owner, "create_model", self._create_job, owner, model_id, lora, meta)
        self._created[model_id] = request_id
        return request_id

    def _create_job(self, owner: str, model_id: str, lora: LoraSpec, meta: dict | None) -> dict:
        self._new_run(owner, model_id, lora, meta)
        self._write_run_json(self.runs[model_id])
        return {"model_id": model_id, "type": "create_model"}

    def _new_run(self, owner: str, model_id: str, lora: LoraSpec, meta: dict | None) -> Run:
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415 - the lora extra, needed by this service only

        if model_id in self.runs:
            raise FailedPrecondition(f"model {model_id} exists already")
        self._adapters += 1
        adapter = f"run{self._adapters}"
        config = LoraConfig(
            r=lora.rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=self._targets(lora),
            bias="none",
            task_type="CAUSAL_LM",
        )
        # seed None: a fresh random init, as the SDK documents; B starts at zero either way (the base model's outputs)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.seed if lora.seed is not None else int.from_bytes(os.urandom(4), "little"))
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=adapter)
            else:
                self.peft.add_adapter(adapter, config)
        marker = f".{adapter}."
        params = {}
        for name, p in self.peft.named_parameters():
            if marker in name:
                p.requires_grad_(True)
                params[name.replace(marker, ".")] = p
        optimizer = torch.optim.AdamW(list(params.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        run = Run(model_id, owner, adapter, lora, params, optimizer, user_metadata=meta)
        self.runs[model_id] = run
        return run

    def _write_run_json(self, run: Run) -> None:
        d = self.root / run_dir_name(run.model_id)
        d.mkdir(parents=True, exist_ok=True)
        body = {
            "model_id": run.model_id,
            "owner": run.owner,
            "base_model": self.base_model,
            "lora": run.lora.to_json(),
            "user_metadata": run.user_metadata,
        }
        _atomic_write(d / "run.json", json.dumps(body, indent=1))

    def info(self, owner: str, model_id: str) -> dict:
        run = self.run(owner, model_id)
        return {
            "type": "get_info",
            "model_data": {"arch": self.arch, "model_name": self.base_model, "tokenizer_id": self.base_model},
            "model_id": model_id,
            "optimizer_config": {"type": "adamw"},
            "is_lora": True,
            "lora_rank": run.lora.rank,
            "model_name": self.base_model,
        }

    # ------------------------------------------------------------------------------------------------ training

    def check_loss(self, name: str) -> None:
        if name not in SDK_LOSSES:
            raise InvalidArgument(
                f"loss_fn {name!r} is not one of the tinker SDK's built-in losses ({', '.join(SDK_LOSSES)}); "
                "server-side custom losses are not supported (forward_backward_custom runs on the client)",
                field="loss_fn",
            )

    def forward_backward(self, owner: str, call: ForwardBackwardCall) -> str:
        self._need_ready()
        self.run(owner, call.model_id)
        if (again := self._retry_of(call.model_id, call.seq_id)) is not None:
            return again
        self.check_loss(call.loss_fn)
        for i, d in enumerate(call.data):
            n = d.tokens.numel()
            if self.max_length and n > self.max_length:
                raise InvalidArgument(
                    f"data[{i}] has {n} tokens; the base model takes at most {self.max_length}", field="data"
                )
            if int(d.tokens.min()) < 0 or int(d.tokens.max()) >= self.vocab_size:
                raise InvalidArgument(f"data[{i}].model_input has ids outside 0..{self.vocab_size - 1}", field="data")
            target = d.inputs.get("target_tokens")
            if target is None:
                raise InvalidArgument(f"data[{i}].loss_fn_inputs has no target_tokens", field="data")
            for key, t in d.inputs.items():
                if t.shape[:1] != (n,):
                    raise InvalidArgument(
                        f"data[{i}].loss_fn_inputs.{key} has shape {list(t.shape)}; it must have one entry per input "
                        f"token ({n})",
                        field="data",
                    )
            if int(target.min()) < 0 or int(target.max()) >= self.vocab_size:
                raise InvalidArgument(f"data[{i}].target_tokens has ids outside 0..{self.vocab_size - 1}", field="data")
        kind = "forward" if call.forward_only else "forward_backward"
        return self._submit_seq(owner, call.model_id, call.seq_id, kind, self._fwd_bwd_job, owner, call)

    def _fwd_bwd_job(self, owner: str, call: ForwardBackwardCall) -> dict:
        run = self.run(owner, call.model_id)
        self.peft.set_adapter(run.adapter)
        # The loss checks every datum's inputs and the config on placeholder log-probs first, so that a datum it
        # refuses fails the request before any gradient is added.
        placeholders = [torch.zeros(d.inputs["target_tokens"].shape) for d in call.data]
        try:
            tinker_loss(call.loss_fn, placeholders, [d.inputs for d in call.data], call.loss_fn_config)
        except ValueError as err:
            raise RequestFailed(str(err)) from None
        # Every loss is a sum over data, so micro-batches add up to the batch's loss and gradient. What the batch
        # has added is taken back if a micro-batch fails after the first: the run's gradients are as before.
        saved = {k: None if p.grad is None else p.grad.clone() for k, p in run.params.items()}
        logprobs: list[torch.Tensor] = []
        parts: list[tuple[dict[str, float], int]] = []
        try:
            for batch in micro_batches(call.data, MICRO_BATCH_TOKENS):
                with torch.set_grad_enabled(not call.forward_only):
                    lps = self._target_logprobs(batch)
                    device = lps[0].device
                    inputs = [{k: v.to(device) for k, v in d.inputs.items()} for d in batch]
                    loss, metrics = tinker_loss(call.loss_fn, lps, inputs, call.loss_fn_config)
                    if not call.forward_only:
                        loss.backward()
                logprobs.extend(lp.detach().cpu() for lp in lps)
                parts.append((metrics, len(batch)))
        except BaseException:
            for k, p in run.params.items():
                p.grad = saved[k]
            raise
        return {"outputs": [{"logprobs": lp} for lp in logprobs], "metrics": combine_metrics(parts)}

    def _target_logprobs(self, batch: list) -> list[torch.Tensor]:
        """log p(target_tokens) of each datum in one right-padded forward: (N,), or (N, K) for top-K targets."""
        device = next(self.peft.parameters()).device
        lengths = [d.tokens.numel() for d in batch]
        ids = torch.zeros((len(batch), max(lengths)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, d in enumerate(batch):
            ids[i, : lengths[i]] = d.tokens
            mask[i, : lengths[i]] = 1
        logits = self.peft(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        out = []
        for i, d in enumerate(batch):
            row = logits[i, : lengths[i]]
            target = d.inputs["target_tokens"].to(device).long()
            index = target if target.dim() == 2 else target[:, None]
            # gather - logsumexp: no second [T, vocab] tensor as log_softmax would make
            lp = row.gather(-1, index) - torch.logsumexp(row, dim=-1, keepdim=True)
            out.append(lp if target.dim() == 2 else lp.squeeze(-1))
        return out

    def optim_step(self, owner: str, model_id: str, adam: AdamStep, seq_id: int | None = None) -> str:
        self._need_ready()
        self.run(owner, model_id)
        if (again := self._retry_of(model_id, seq_id)) is not None:
            return again
        checks = (
            ("learning_rate", adam.learning_rate >= 0),
            ("beta1", 0 <= adam.beta1 < 1),
            ("beta2", 0 <= adam.beta2 < 1),
            ("eps", adam.eps >= 0),
            ("weight_decay", adam.weight_decay >= 0),
            ("grad_clip_norm", adam.grad_clip_norm >= 0),
        )
        for name, ok in checks:
            if not ok:
                raise InvalidArgument(f"adam_params.{name} = {getattr(adam, name)} is out of range", field=name)
        return self._submit_seq(owner, model_id, seq_id, "optim_step", self._optim_job, owner, model_id, adam)

    def _optim_job(self, owner: str, model_id: str, adam: AdamStep) -> dict:
        run = self.run(owner, model_id)
        for group in run.optimizer.param_groups:
            group.update(
                lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps, weight_decay=adam.weight_decay
            )
        params = list(run.params.values())
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        if adam.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.steps += 1
        return {"metrics": {"grad_norm:mean": norm}}

    # ------------------------------------------------------------------------------------------------ checkpoints

    def save_weights(
        self,
        owner: str,
        model_id: str,
        name: str | None,
        overwrite: bool,
        meta: dict | None,
        seq_id: int | None = None,
        ttl_seconds: int | None = None,
    ) -> str:
        self._need_ready()
        run = self.run(owner, model_id)
        if (again := self._retry_of(model_id, seq_id)) is not None:
            return again
        name = _check_name(name or f"step-{run.steps:06d}", "checkpoint name")
        record = checkpoint_record(meta, ttl_seconds)
        return self._submit_seq(
            owner, model_id, seq_id, "save_weights", self._save_job, owner, model_id, name, overwrite, record
        )

    def _save_job(self, owner: str, model_id: str, name: str, overwrite: bool, record: dict) -> dict:
        run = self.run(owner, model_id)
        final = self.root / run_dir_name(model_id) / "weights" / name
        if final.exists() and not overwrite:
            raise RequestFailed(f"checkpoint {name!r} exists already for this run: pick another name or overwrite")
        tmp = final.parent / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir(parents=True)
        adapter = {k: p.detach().cpu().contiguous() for k, p in run.params.items()}
        save_file(adapter, tmp / "adapter.safetensors")
        opt_tensors, opt_steps = {}, {}
        state = run.optimizer.state
        for k, p in run.params.items():
            s = state.get(p)
            if s:
                opt_tensors[f"{k}.exp_avg"] = s["exp_avg"].detach().cpu().contiguous()
                opt_tensors[f"{k}.exp_avg_sq"] = s["exp_avg_sq"].detach().cpu().contiguous()
                opt_steps[k] = float(s["step"])
        save_file(opt_tensors, tmp / "optimizer.safetensors")
        body = {
            "model_id": model_id,
            "owner": owner,
            "base_model": self.base_model,
            "lora": run.lora.to_json(),
            "steps": run.steps,
            "optimizer_steps": opt_steps,
        }
        (tmp / "state.json").write_text(json.dumps(body, indent=1))
        (tmp / CHECKPOINT_JSON).write_text(json.dumps(record, indent=1))
        fsync_files(tmp, recursive=False, folder=True)  # a checkpoint folder is flat
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_files(final.parent, recursive=False, folder=True)  # the rename
        return {"path": f"tinker://{model_id}/weights/{name}", "type": "save_weights"}

    def save_for_sampler(
        self,
        owner: str,
        model_id: str,
        name: str | None,
        seq_id: int | None = None,
        ttl_seconds: int | None = None,
        meta: dict | None = None,
        sampling_session_seq_id: int | None = None,
    ) -> str:
        self._need_ready()
        run = self.run(owner, model_id)
        if (again := self._retry_of(model_id, seq_id)) is not None:
            return again
        if sampling_session_seq_id is not None:
            # save_weights_and_get_sampling_client: a snapshot of the adapter as it stands, in memory, and a sampler
            # bound to it; nothing is written (the SDK gets no path)
            sampler_id = f"{model_id.split(':', 1)[0]}:sample:{sampling_session_seq_id}"
            return self._submit_seq(
                owner, model_id, seq_id, "save_weights_for_sampler", self._snapshot_run_job, owner, model_id, sampler_id
            )
        name = _check_name(name or f"step-{run.steps:06d}", "sampler checkpoint name")
        record = checkpoint_record(meta, ttl_seconds)
        return self._submit_seq(
            owner, model_id, seq_id, "save_weights_for_sampler", self._sampler_job, owner, model_id, name, record
        )

    def _sampler_job(self, owner: str, model_id: str, name: str, record: dict) -> dict:
        from peft import get_peft_model_state_dict  # noqa: PLC0415 - the lora extra

        from rlhf.lora import write_adapter  # noqa: PLC0415 - imports safetensors only, at first use

        run = self.run(owner, model_id)
        final = self.root / run_dir_name(model_id) / "sampler_weights" / name
        tmp = final.parent / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        tensors = get_peft_model_state_dict(self.peft, adapter_name=run.adapter, save_embedding_layers=False)
        write_adapter(tmp, tensors, run.lora.rank, LORA_ALPHA, self._targets(run.lora), self.base_model)
        (tmp / CHECKPOINT_JSON).write_text(json.dumps(record, indent=1))
        fsync_files(tmp, recursive=False, folder=True)  # a checkpoint folder is flat
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return {"path": f"tinker://{model_id}/sampler_weights/{name}", "type": "save_weights_for_sampler"}

    # ------------------------------------------------------------------------------------------------ sampling

    def _add_adapter(self, tensors: dict[str, torch.Tensor], rank: int, alpha: float, targets: list[str]) -> str:
        """A frozen copy of an adapter (PEFT state-dict keys) in the shared model; returns its adapter name."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict  # noqa: PLC0415 - the lora extra

        self._adapters += 1
        name = f"snap{self._adapters}"
        config = LoraConfig(
            r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none", task_type="CAUSAL_LM"
        )
        if self.peft is None:
            self.peft = get_peft_model(self.base, config, adapter_name=name)
        else:
            self.peft.add_adapter(name, config)
        result = set_peft_model_state_dict(self.peft, tensors, adapter_name=name)
        if getattr(result, "unexpected_keys", None):
            self.peft.delete_adapter(name)
            raise RequestFailed(
                f"the adapter holds tensors the base model has no place for: {result.unexpected_keys[:3]}"
            )
        for pname, p in self.peft.named_parameters():
            if f".{name}." in pname:
                p.requires_grad_(False)
        return name

    def _bind(self, owner: str, sampler_id: str, model_path: str | None, key: str | None, make) -> dict:
        """Register sampler ``sampler_id`` on snapshot ``key`` (made by ``make()`` unless it exists)."""
        if sampler_id in self.samplers:  # a resend of the request that made it (its session is the caller's)
            return {"sampling_session_id": sampler_id}
        if key is not None:
            if key not in self._snapshots:
                self._snapshots[key] = Snapshot(make())
            self._snapshots[key].samplers.add(sampler_id)
        self.samplers[sampler_id] = Sampler(sampler_id, owner, model_path, key)
        return {"sampling_session_id": sampler_id}

    def _release_sampler(self, sampler_id: str) -> None:
        sampler = self.samplers.pop(sampler_id, None)
        snap = self._snapshots.get(sampler.snapshot) if sampler and sampler.snapshot else None
        if snap is not None:
            snap.samplers.discard(sampler_id)
            if not snap.samplers:
                del self._snapshots[sampler.snapshot]
                self.peft.delete_adapter(snap.adapter)

    def _snapshot_run_job(self, owner: str, model_id: str, sampler_id: str) -> dict:
        from peft import get_peft_model_state_dict  # noqa: PLC0415 - the lora extra

        run = self.run(owner, model_id)
        tensors = {
            k: v.detach().clone()
            # the adapter only: not the base's embedding / lm_head weights, which PEFT adds when lm_head is adapted
            for k, v in get_peft_model_state_dict(
                self.peft, adapter_name=run.adapter, save_embedding_layers=False
            ).items()
        }

        def make() -> str:
            return self._add_adapter(tensors, run.lora.rank, LORA_ALPHA, self._targets(run.lora))

        out = self._bind(owner, sampler_id, None, f"{model_id}@{uuid.uuid4().hex}", make)
        return {**out, "path": None, "type": "save_weights_for_sampler"}

    async def create_sampling_session(
        self, owner: str, session_id: str, seq_id: int, model_path: str | None, base_model: str | None
    ) -> str:
        """A sampler over a sampler checkpoint (``tinker://<run>/sampler_weights/<name>``) or the base model. Its
        adapter is read now and kept: rewriting the checkpoint later does not change what this sampler samples."""
        self._need_ready()
        self.session(owner, session_id)
        sampler_id = f"{session_id}:sample:{seq_id}"
        if sampler_id in self.samplers:
            return sampler_id  # a resend
        if model_path is None:
            if base_model != self.base_model:
                raise InvalidArgument(
                    f"base_model {base_model!r} is not served here ({self.base_model!r})", field="base_model"
                )
            job = (self._bind, owner, sampler_id, None, None, None)
        else:
            folder = self._sampler_checkpoint(owner, model_path)
            key = f"{folder}@{_record(folder).get('created')}"
            job = (self._bind, owner, sampler_id, model_path, key, lambda: self._load_sampler_adapter(folder))
        await asyncio.get_running_loop().run_in_executor(self._worker, *job)
        return sampler_id

    def _sampler_checkpoint(self, owner: str, path: str) -> Path:
        run_id, segment, name = parse_tinker_path(path)
        if segment != "sampler_weights":
            raise InvalidArgument(
                f"path {path!r} is a training checkpoint: sample from a sampler checkpoint "
                "(save_weights_for_sampler, tinker://<run>/sampler_weights/<name>)",
                field="model_path",
            )
        d = self.root / run_dir_name(run_id)
        folder = d / "sampler_weights" / _check_name(name, "sampler checkpoint name")
        run_json = d / "run.json"
        if (
            not (folder / "adapter_model.safetensors").is_file()
            or not run_json.is_file()
            or json.loads(run_json.read_text()).get("owner") != owner
        ):
            raise NotFound(f"sampler checkpoint {path!r} does not exist", field="model_path")
        if _expired(folder, time.time()):
            raise NotFound(f"sampler checkpoint {path!r} has expired (its ttl_seconds ran out)", field="model_path")
        return folder

    def _load_sampler_adapter(self, folder: Path) -> str:
        config = json.loads((folder / "adapter_config.json").read_text())
        if config.get("base_model_name_or_path") != self.base_model:
            raise InvalidArgument(
                f"sampler checkpoint {folder.name!r} is over {config.get('base_model_name_or_path')!r}; this service "
                f"serves {self.base_model!r}",
                field="model_path",
            )
        tensors = load_file(folder / "adapter_model.safetensors", device=str(self.device))
        return self._add_adapter(tensors, int(config["r"]), float(config["lora_alpha"]), list(config["target_modules"]))

    def sampler(self, owner: str, sampler_id: str) -> Sampler:
        s = self.samplers.get(sampler_id)
        if s is None or s.owner != owner:
            raise NotFound(
                f"sampling session {sampler_id!r} does not exist (or is not yours, or its session was closed)",
                field="sampling_session_id",
            )
        return s

    def get_sampler(self, owner: str, sampler_id: str) -> dict:
        s = self.sampler(owner, sampler_id)
        return {"sampler_id": sampler_id, "base_model": self.base_model, "model_path": s.model_path}

    def sample(self, owner: str, sampler_id: str, seq_id: int | None, spec: SampleSpec) -> tuple[str, list[str]]:
        """Queue a sample request; returns its future id and one sequence id per sample. A resend of a seq_id gets
        the same future."""
        self._need_ready()
        self.sampler(owner, sampler_id)
        if seq_id is not None and (again := self._sample_seq.get((sampler_id, seq_id))) is not None:
            return again
        request_id = self._submit(owner, "sample", self._sample_job, owner, sampler_id, spec)
        out = (request_id, [f"{request_id}:{i}" for i in range(spec.num_samples)])
        if seq_id is not None:
            with self._lock:
                self._sample_seq[(sampler_id, seq_id)] = out
                while len(self._sample_seq) > KEEP_FUTURES:
                    del self._sample_seq[next(iter(self._sample_seq))]
        return out

    def _sample_job(self, owner: str, sampler_id: str, spec: SampleSpec) -> dict:
        sampler = self.sampler(owner, sampler_id)
        decode = self._decoder() if spec.stop_strings else None
        if sampler.snapshot is not None:
            self.peft.set_adapter(self._snapshots[sampler.snapshot].adapter)
            seqs, prompt_lps = generate(self.peft, spec, self.eos_ids, decode)
        elif self.peft is None or self.peft.active_adapter not in self.peft.peft_config:
            # no adapter in the shared model (PEFT keeps the name of the last one deleted, and its LoRA layers skip
            # adapters they no longer hold): the base alone
            seqs, prompt_lps = generate(self.base, spec, self.eos_ids, decode)
        else:
            with self.peft.disable_adapter():
                seqs, prompt_lps = generate(self.peft, spec, self.eos_ids, decode)
        return {"sample": encode_sample_response(seqs, prompt_lps)}

    def _decoder(self):
        if self._tokenizer is None:
            from rlhf.models import load_tokenizer, resolve_model_path  # noqa: PLC0415 - only for stop strings

            self._tokenizer = load_tokenizer(resolve_model_path(self.base_model))
        return self._tokenizer.decode

    def _checkpoint(self, owner: str, path: str) -> tuple[Path, dict]:
        run_id, segment, name = parse_tinker_path(path)
        if segment != "weights":
            raise InvalidArgument(
                f"path {path!r} is a sampler checkpoint: load_weights takes a training checkpoint (save_state)",
                field="path",
            )
        folder = self.root / run_dir_name(run_id) / "weights" / _check_name(name, "checkpoint name")
        state_file = folder / "state.json"
        if not state_file.is_file():
            raise NotFound(f"checkpoint {path!r} does not exist", field="path")
        state = json.loads(state_file.read_text())
        if state.get("owner") != owner:
            raise NotFound(f"checkpoint {path!r} does not exist", field="path")
        if _expired(folder, time.time()):
            raise NotFound(f"checkpoint {path!r} has expired (its ttl_seconds ran out)", field="path")
        if state.get("base_model") != self.base_model:
            # 400, not 409: the SDK resends 409s for minutes, and this one never changes
            raise InvalidArgument(
                f"checkpoint {path!r} is over base model {state.get('base_model')!r}; this service serves "
                f"{self.base_model!r}",
                field="path",
            )
        return folder, state

    def load_weights(
        self,
        owner: str,
        path: str,
        with_optimizer: bool,
        model_id: str | None = None,
        session_id: str | None = None,
        model_seq_id: int | None = None,
        meta: dict | None = None,
        seq_id: int | None = None,
    ) -> str:
        self._need_ready()
        folder, state = self._checkpoint(owner, path)
        if model_id is not None:
            self.run(owner, model_id)
            if (again := self._retry_of(model_id, seq_id)) is not None:
                return again
        else:
            if session_id is None or model_seq_id is None:
                raise InvalidArgument("load_weights needs model_id, or session_id with model_seq_id", field="model_id")
            self.session(owner, session_id)
            model_id = f"{session_id}:train:{model_seq_id}"
            if (again := self._created.get(model_id)) is not None:
                return again  # a resend of this create-by-load
            job = (self._load_job, owner, model_id, folder, state, with_optimizer, True, meta, path)
            request_id = self._submit(owner, "load_weights", *job)
            self._created[model_id] = request_id
            return request_id
        job = (self._load_job, owner, model_id, folder, state, with_optimizer, False, meta, path)
        return self._submit_seq(owner, model_id, seq_id, "load_weights", *job)

    def _load_job(
        self,
        owner: str,
        model_id: str,
        folder: Path,
        state: dict,
        with_optimizer: bool,
        create: bool,
        meta: dict | None,
        path: str,
    ) -> dict:
        lora = LoraSpec(**state["lora"])
        if create:
            run = self._new_run(owner, model_id, lora, meta)
            self._write_run_json(run)
        else:
            run = self.run(owner, model_id)
            if run.lora.to_json() | {"seed": None} != lora.to_json() | {"seed": None}:
                raise RequestFailed(
                    f"checkpoint {path} has LoRA {state['lora']}; this model has {run.lora.to_json()}: they must match"
                )
        adapter = load_file(folder / "adapter.safetensors")
        if set(adapter) != set(run.params):
            raise RequestFailed(f"checkpoint {path} holds other adapter tensors than this model", "server")
        with torch.no_grad():
            for k, p in run.params.items():
                p.copy_(adapter[k].to(p.device, p.dtype))
                p.grad = None
        # a fresh optimizer: load_state restores weights only; with the optimizer, Adam's moments and step counts too
        run.optimizer = torch.optim.AdamW(list(run.params.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        if with_optimizer:
            moments = load_file(folder / "optimizer.safetensors")
            for k, p in run.params.items():
                if k in state["optimizer_steps"]:
                    run.optimizer.state[p] = {
                        "step": torch.tensor(state["optimizer_steps"][k]),
                        "exp_avg": moments[f"{k}.exp_avg"].to(p.device),
                        "exp_avg_sq": moments[f"{k}.exp_avg_sq"].to(p.device),
                    }
        run.steps = int(state["steps"])
        return {"path": path, "model_id": model_id, "type": "load_weights"}

    def list_checkpoints(self, owner: str, run_id: str) -> list[dict]:
        d = self.root / run_dir_name(run_id)
        run_json = d / "run.json"
        if not run_json.is_file() or json.loads(run_json.read_text()).get("owner") != owner:
            raise NotFound(f"training run {run_id!r} does not exist (or is not yours)", field="model_id")
        out = []
        for segment, kind in SEGMENTS.items():
            for folder in sorted((d / segment).glob("[!.]*")):
                size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
                record = _record(folder)
                if _expired(folder, time.time()):
                    continue
                out.append(
                    {
                        "checkpoint_id": f"{segment}/{folder.name}",
                        "checkpoint_type": kind,
                        "time": record.get("created")
                        or datetime.fromtimestamp(folder.stat().st_mtime, UTC).isoformat(),
                        "tinker_path": f"tinker://{run_id}/{segment}/{folder.name}",
                        "size_bytes": size,
                        "public": False,
                        "user_metadata": record.get("user_metadata"),
                        "expires_at": record.get("expires_at"),
                    }
                )
        return out

    async def memory_report(self) -> dict:
        """:meth:`memory` on the model's thread, between requests (the optimizers' state changes during a step)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, self.memory)

    def memory(self) -> dict:
        """Bytes of the shared base and of each run (adapter + Adam moments + gradients as they stand)."""
        runs = {}
        for model_id, run in self.runs.items():
            n = 0
            for p in run.params.values():
                n += p.numel() * p.element_size()
                if p.grad is not None:
                    n += p.grad.numel() * p.grad.element_size()
                for v in run.optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        n += v.numel() * v.element_size()
            runs[model_id] = n
        # samplers and their frozen adapter copies (samplers over one checkpoint share a copy)
        return {
            "base_bytes": self._base_bytes,
            "run_bytes": runs,
            "samplers": len(self.samplers),
            "sampler_adapters": len(self._snapshots),
        }


def micro_batches(data: list, max_tokens: int) -> list[list]:
    """``data`` in order, cut so that each piece's padded size (rows x longest) stays within ``max_tokens`` (a datum
    longer than that is a piece of its own)."""
    out: list[list] = []
    current: list = []
    longest = 0
    for d in data:
        n = d.tokens.numel()
        if current and (len(current) + 1) * max(longest, n) > max_tokens:
            out.append(current)
            current, longest = [], 0
        current.append(d)
        longest = max(longest, n)
    if current:
        out.append(current)
    return out


def combine_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of micro-batches as the SDK combines chunks: ``x:sum`` added, ``x:max`` / ``x:min`` their extreme,
    anything else averaged, weighted by data."""
    out: dict[str, float] = {}
    for key in sorted({k for m, _ in parts for k in m}):
        values = [(m[key], n) for m, n in parts if key in m]
        suffix = key.rsplit(":", 1)[-1]
        if suffix == "sum":
            out[key] = float(sum(v for v, _ in values))
        elif suffix == "max":
            out[key] = float(max(v for v, _ in values))
        elif suffix == "min":
            out[key] = float(min(v for v, _ in values))
        else:
            out[key] = float(sum(v * n for v, n in values) / sum(n for _, n in values))
    return out


def checkpoint_record(meta: dict | None, ttl_seconds: int | None) -> dict:
    """``checkpoint.json`` of a checkpoint folder: when it was made, when it expires (None: never), user metadata."""
    if ttl_seconds is not None and not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidArgument(
            f"ttl_seconds {ttl_seconds} must be from {MIN_TTL_S} (1 hour) to {MAX_TTL_S} (10 years), or null for never",
            field="ttl_seconds",
        )
    now = time.time()
    expires = None if ttl_seconds is None else now + ttl_seconds
    return {
        "created": datetime.fromtimestamp(now, UTC).isoformat(),
        "expires_at": None if expires is None else datetime.fromtimestamp(expires, UTC).isoformat(),
        "expires_unix": expires,
        "user_metadata": meta,
    }


def _record(folder: Path) -> dict:
    try:
        return json.loads((folder / CHECKPOINT_JSON).read_text())
    except (OSError, ValueError):
        return {}


def _expired(folder: Path, now: float) -> bool:
    expires = _record(folder).get("expires_unix")
    return expires is not None and expires <= now


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
