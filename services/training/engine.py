"""The training service's engine: one base model loaded once, a LoRA adapter + Adam optimizer per training run, and
the SDK's calls over them. It composes its parts, each handed what it uses: the :class:`SharedModel` (base + every
adapter), :class:`Sessions`, the :class:`FutureBook` (the one worker thread and the request ids), the
:class:`CheckpointStore` (the files) and :class:`Samplers`; the runs and their training steps are its own.

Every model operation (create_model, forward_backward, optim_step, save/load, sampling) runs on ONE worker thread in
the order the requests arrived: the SDK sends a training client's requests in seq_id order and waits for each to be
accepted before it sends the next, so arrival order is its order; runs of different clients interleave between
requests. Isolation: every session, run, future and checkpoint belongs to the token (user) that created it; another
token gets 404 for it, as for something that does not exist. Design: docs/tinker.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from rlhf.algo.tinker_losses import LOSSES, tinker_loss
from rlhf.serving import FailedPrecondition, InvalidArgument, NotFound, NotReady
from services.training.checkpoints import CheckpointStore, SamplerAdapter, check_name, checkpoint_record
from services.training.fleet import FleetSampler
from services.training.futures import FutureBook, Outcome, RequestFailed
from services.training.samplers import Sampler, Samplers
from services.training.sampling import SampleSpec
from services.training.sessions import SESSION_TTL_S, Sessions, session_of
from services.training.shared_model import LORA_ALPHA, LoraSpec, SharedModel
from services.training.wire import Datum, ForwardBackwardCall

log = logging.getLogger("rlhf.training")

# The built-in losses the tinker SDK names (tinker.types.LossFnType), all in rlhf.algo.tinker_losses.
SDK_LOSSES = LOSSES
MAX_RANK = 256
# Padded tokens (rows x longest) of one forward; a batch is cut into micro-batches of at most this many.
MICRO_BATCH_TOKENS = 8192


@dataclass
class AdamStep:
    # no defaults: the SDK's are on the wire model (tinker_protocol.AdamIn), the one place that says them
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float


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


def _adamw(params: dict[str, torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(list(params.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)


class TrainingEngine:
    def __init__(
        self,
        base_model: str,
        root: str | Path,
        device: str = "cpu",
        session_ttl_s: float = SESSION_TTL_S,
        fleet: FleetSampler | None = None,
    ):
        self.base_model = base_model
        self.fleet = fleet
        self.device = device
        self.ready = False
        self.model = SharedModel(base_model, device)
        self.store = CheckpointStore(root, base_model)
        self.sessions = Sessions(session_ttl_s)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="training-model")
        self.futures = FutureBook(self._worker, boot=uuid.uuid4().hex[:12])
        self.samplers = Samplers(self.model, self.store, fleet, self.futures.boot)
        self.runs: dict[str, Run] = {}
        self._gone: dict[str, str] = {}  # model id -> why it was unloaded
        self._expiry: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._worker, self._load)
        self.ready = True
        self._expiry = asyncio.create_task(self._expire_loop())

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.sessions.ttl_s / 3))
            try:
                self.expire()
            except Exception:  # the loop must outlive one bad pass; the error goes to the log
                log.exception("training: session expiry failed")

    def _load(self) -> None:
        self.store.prepare()
        self.model.load()

    def close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self.fleet is not None:
            self.fleet.close()
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _need_ready(self) -> None:
        if not self.ready:
            raise NotReady("the base model is still loading: retry shortly")

    # ------------------------------------------------------------------------------------------------ sessions

    def create_session(self, owner: str, meta: dict) -> str:
        return self.sessions.create(owner, meta)

    def heartbeat(self, owner: str, session_id: str) -> None:
        self.sessions.heartbeat(owner, session_id)

    def finish_session(self, owner: str, session_id: str, reason: str) -> None:
        if self.sessions.finish(owner, session_id, reason):
            self._unload_session(session_id, f"its session was closed ({reason or 'no reason'})")

    def expire(self, now: float | None = None) -> concurrent.futures.Future | None:
        """Unload the runs of sessions that missed their heartbeats for the sessions' TTL (the SDK sends one every
        10 s while its client lives): a client that is gone holds no adapter. Returns the unload job, if any."""
        now = time.monotonic() if now is None else now
        job = None
        for sid in self.sessions.expire(now):
            job = self._unload_session(sid, f"its session sent no heartbeat for {self.sessions.ttl_s:.0f} s")
        # checkpoints past their ttl_seconds, on the model's thread (never under a load of the same folder)
        self._worker.submit(self.store.sweep, time.time())
        return job

    def _unload_session(self, session_id: str, why: str) -> concurrent.futures.Future | None:
        prefix = f"{session_id}:train:"
        # list(...) copies in one step: the model's thread adds runs while this reads
        model_ids = sorted({m for m in list(self.runs) + list(self.futures.created) if m.startswith(prefix)})
        samplers = self.samplers.of_session(session_id)
        if not model_ids and not samplers:
            return None
        # on the model's thread, after the requests already queued for these runs
        return self._worker.submit(self._unload_job, model_ids, why, samplers)

    def _unload_job(self, model_ids: list[str], why: str, samplers: list[str] = ()) -> None:
        for sampler_id in samplers:
            self.samplers.release(sampler_id)
        for model_id in model_ids:
            run = self.runs.pop(model_id, None)
            self._gone[model_id] = why
            self.futures.forget(model_id)
            if run is not None:
                run.optimizer.state.clear()
                self.model.delete(run.adapter)
                log.info("training: unloaded %s: %s", model_id, why)

    async def retrieve(self, owner: str, request_id: str) -> Outcome:
        return await self.futures.retrieve(owner, request_id)

    # ------------------------------------------------------------------------------------------------ runs

    def run(self, owner: str, model_id: str) -> Run:
        r = self.runs.get(model_id)
        if r is None and model_id in self._gone and self.sessions.owner(session_of(model_id)) == owner:
            raise NotFound(
                f"model {model_id!r} was unloaded ({self._gone[model_id]}): resume from a checkpoint "
                "(create_training_client_from_state_with_optimizer)",
                field="model_id",
            )
        if r is None or r.owner != owner:
            raise NotFound(f"model {model_id!r} does not exist (or is not yours)", field="model_id")
        return r

    def check_lora(self, lora: LoraSpec) -> None:
        if not 1 <= lora.rank <= MAX_RANK:
            raise InvalidArgument(f"lora_config.rank {lora.rank} must be in 1..{MAX_RANK}", field="lora_config.rank")
        if self.ready:
            self.model.targets(lora)

    def create_model(
        self, owner: str, session_id: str, model_seq_id: int, base_model: str, lora: LoraSpec, meta: dict | None
    ) -> str:
        self._need_ready()
        self.sessions.get(owner, session_id)
        if base_model != self.base_model:
            raise InvalidArgument(
                f"base_model {base_model!r} is not served here: this service trains LoRA adapters over "
                f"{self.base_model!r} (get_server_capabilities)",
                field="base_model",
            )
        self.check_lora(lora)
        model_id = f"{session_id}:train:{model_seq_id}"
        if (again := self.futures.created.get(model_id)) is not None:
            return again  # a resend (the SDK lost the answer): the same future, not a second run
        request_id = self.futures.submit(owner, "create_model", partial(self._create_job, owner, model_id, lora, meta))
        self.futures.created[model_id] = request_id
        return request_id

    def _create_job(self, owner: str, model_id: str, lora: LoraSpec, meta: dict | None) -> dict:
        self._new_run(owner, model_id, lora, meta)
        self._write_run_json(self.runs[model_id])
        return {"model_id": model_id, "type": "create_model"}

    def _new_run(self, owner: str, model_id: str, lora: LoraSpec, meta: dict | None) -> Run:
        if model_id in self.runs:
            raise FailedPrecondition(f"model {model_id} exists already")
        adapter, params = self.model.add_trainable(lora)
        run = Run(model_id, owner, adapter, lora, params, _adamw(params), user_metadata=meta)
        self.runs[model_id] = run
        return run

    def _write_run_json(self, run: Run) -> None:
        self.store.write_run(run.model_id, run.owner, run.lora.to_json(), run.user_metadata)

    def info(self, owner: str, model_id: str) -> dict:
        run = self.run(owner, model_id)
        return {
            "type": "get_info",
            "model_data": {"arch": self.model.arch, "model_name": self.base_model, "tokenizer_id": self.base_model},
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

    def check_data(self, data: list[Datum]) -> None:
        """Each datum fits the model (length, token ids) and has one loss input per token, target_tokens among them."""
        vocab, max_length = self.model.vocab_size, self.model.max_length
        for i, d in enumerate(data):
            n = d.tokens.numel()
            if max_length and n > max_length:
                raise InvalidArgument(
                    f"data[{i}] has {n} tokens; the base model takes at most {max_length}", field="data"
                )
            if int(d.tokens.min()) < 0 or int(d.tokens.max()) >= vocab:
                raise InvalidArgument(f"data[{i}].model_input has ids outside 0..{vocab - 1}", field="data")
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
            if int(target.min()) < 0 or int(target.max()) >= vocab:
                raise InvalidArgument(f"data[{i}].target_tokens has ids outside 0..{vocab - 1}", field="data")

    def forward_backward(self, owner: str, call: ForwardBackwardCall) -> str:
        self._need_ready()
        self.run(owner, call.model_id)
        if (again := self.futures.retry_of(call.model_id, call.seq_id)) is not None:
            return again
        self.check_loss(call.loss_fn)
        self.check_data(call.data)
        kind = "forward" if call.forward_only else "forward_backward"
        job = partial(self._fwd_bwd_job, owner, call)
        return self.futures.submit_seq(owner, call.model_id, call.seq_id, kind, job)

    def _fwd_bwd_job(self, owner: str, call: ForwardBackwardCall) -> dict:
        run = self.run(owner, call.model_id)
        self.model.peft.set_adapter(run.adapter)
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
                    lps = self.model.target_logprobs(batch)
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

    def optim_step(self, owner: str, model_id: str, adam: AdamStep, seq_id: int | None = None) -> str:
        self._need_ready()
        self.run(owner, model_id)
        if (again := self.futures.retry_of(model_id, seq_id)) is not None:
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
        job = partial(self._optim_job, owner, model_id, adam)
        return self.futures.submit_seq(owner, model_id, seq_id, "optim_step", job)

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
        if (again := self.futures.retry_of(model_id, seq_id)) is not None:
            return again
        name = check_name(name or f"step-{run.steps:06d}", "checkpoint name")
        record = checkpoint_record(meta, ttl_seconds)
        job = partial(self._save_job, owner, model_id, name, overwrite, record)
        return self.futures.submit_seq(owner, model_id, seq_id, "save_weights", job)

    def _save_job(self, owner: str, model_id: str, name: str, overwrite: bool, record: dict) -> dict:
        run = self.run(owner, model_id)
        adapter = {k: p.detach().cpu().contiguous() for k, p in run.params.items()}
        moments, opt_steps = {}, {}
        for k, p in run.params.items():
            s = run.optimizer.state.get(p)
            if s:
                moments[f"{k}.exp_avg"] = s["exp_avg"].detach().cpu().contiguous()
                moments[f"{k}.exp_avg_sq"] = s["exp_avg_sq"].detach().cpu().contiguous()
                opt_steps[k] = float(s["step"])
        state = {
            "model_id": model_id,
            "owner": owner,
            "base_model": self.base_model,
            "lora": run.lora.to_json(),
            "steps": run.steps,
            "optimizer_steps": opt_steps,
        }
        path = self.store.save_training(model_id, name, overwrite, (adapter, moments), state, record)
        return {"path": path, "type": "save_weights"}

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
        if (again := self.futures.retry_of(model_id, seq_id)) is not None:
            return again
        if sampling_session_seq_id is not None:
            # save_weights_and_get_sampling_client: a snapshot of the adapter as it stands, in memory, and a sampler
            # bound to it; nothing is written (the SDK gets no path)
            sampler_id = f"{session_of(model_id)}:sample:{sampling_session_seq_id}"
            job = partial(self._snapshot_run_job, owner, model_id, sampler_id)
        else:
            name = check_name(name or f"step-{run.steps:06d}", "sampler checkpoint name")
            job = partial(self._sampler_job, owner, model_id, name, checkpoint_record(meta, ttl_seconds))
        return self.futures.submit_seq(owner, model_id, seq_id, "save_weights_for_sampler", job)

    def _run_adapter(self, run: Run, tensors: dict[str, torch.Tensor]) -> SamplerAdapter:
        return SamplerAdapter(tensors, run.lora.rank, LORA_ALPHA, self.model.targets(run.lora))

    def _sampler_job(self, owner: str, model_id: str, name: str, record: dict) -> dict:
        run = self.run(owner, model_id)
        adapter = self._run_adapter(run, self.model.adapter_tensors(run.adapter))
        path = self.store.save_sampler(model_id, name, adapter, record)
        return {"path": path, "type": "save_weights_for_sampler"}

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
        folder, state = self.store.training_checkpoint(owner, path)
        if model_id is not None:
            self.run(owner, model_id)
            if (again := self.futures.retry_of(model_id, seq_id)) is not None:
                return again
            job = partial(self._load_job, owner, model_id, folder, state, with_optimizer, False, meta, path)
            return self.futures.submit_seq(owner, model_id, seq_id, "load_weights", job)
        if session_id is None or model_seq_id is None:
            raise InvalidArgument("load_weights needs model_id, or session_id with model_seq_id", field="model_id")
        self.sessions.get(owner, session_id)
        model_id = f"{session_id}:train:{model_seq_id}"
        if (again := self.futures.created.get(model_id)) is not None:
            return again  # a resend of this create-by-load
        job = partial(self._load_job, owner, model_id, folder, state, with_optimizer, True, meta, path)
        request_id = self.futures.submit(owner, "load_weights", job)
        self.futures.created[model_id] = request_id
        return request_id

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
        adapter = self.store.read_adapter(folder)
        if set(adapter) != set(run.params):
            raise RequestFailed(f"checkpoint {path} holds other adapter tensors than this model", "server")
        with torch.no_grad():
            for k, p in run.params.items():
                p.copy_(adapter[k].to(p.device, p.dtype))
                p.grad = None
        # a fresh optimizer: load_state restores weights only; with the optimizer, Adam's moments and step counts too
        run.optimizer = torch.optim.AdamW(list(run.params.values()), lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        if with_optimizer:
            moments = self.store.read_moments(folder)
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
        return self.store.list(owner, run_id)

    # ------------------------------------------------------------------------------------------------ sampling

    def _snapshot_run_job(self, owner: str, model_id: str, sampler_id: str) -> dict:
        run = self.run(owner, model_id)
        copy = self._run_adapter(
            run, {k: v.detach().clone() for k, v in self.model.adapter_tensors(run.adapter).items()}
        )

        def make() -> str:
            return self.model.add_frozen(copy.tensors, copy.rank, copy.alpha, copy.targets)

        out = self.samplers.bind(owner, sampler_id, None, f"{model_id}@{uuid.uuid4().hex}", make)
        return {**out, "path": None, "type": "save_weights_for_sampler"}

    async def create_sampling_session(
        self, owner: str, session_id: str, seq_id: int, model_path: str | None, base_model: str | None
    ) -> str:
        """A sampler over a sampler checkpoint (``tinker://<run>/sampler_weights/<name>``) or the base model. Its
        adapter is read now and kept: rewriting the checkpoint later does not change what this sampler samples."""
        self._need_ready()
        self.sessions.get(owner, session_id)
        sampler_id = f"{session_id}:sample:{seq_id}"
        if sampler_id in self.samplers.by_id:
            return sampler_id  # a resend
        if model_path is None:
            if base_model != self.base_model:
                raise InvalidArgument(
                    f"base_model {base_model!r} is not served here ({self.base_model!r})", field="base_model"
                )
            job = partial(self.samplers.bind, owner, sampler_id, None, None, None)
        else:
            folder = self.store.sampler_checkpoint(owner, model_path)
            make = partial(self.samplers.load_checkpoint, folder)
            job = partial(self.samplers.bind, owner, sampler_id, model_path, self.store.version_key(folder), make)
        await asyncio.get_running_loop().run_in_executor(self._worker, job)
        return sampler_id

    def sampler(self, owner: str, sampler_id: str) -> Sampler:
        return self.samplers.get(owner, sampler_id)

    def get_sampler(self, owner: str, sampler_id: str) -> dict:
        return self.samplers.describe(owner, sampler_id)

    def sample(self, owner: str, sampler_id: str, seq_id: int | None, spec: SampleSpec) -> tuple[str, list[str]]:
        """Queue a sample request; returns its future id and one sequence id per sample. A resend of a seq_id gets
        the same future."""
        self._need_ready()
        self.samplers.get(owner, sampler_id)
        if (again := self.futures.sample_of(sampler_id, seq_id)) is not None:
            return again
        job = partial(self.samplers.sample_job, owner, sampler_id, spec)
        fleet_job = self.samplers.fleet_job(owner, sampler_id, spec, lambda: self._worker.submit(job).result())
        if fleet_job is None:
            request_id = self.futures.submit(owner, "sample", job)
        else:  # the replicas' calls wait off the model's thread
            request_id = self.futures.submit(owner, "sample", fleet_job, executor=self.fleet.pool)
        out = (request_id, [f"{request_id}:{i}" for i in range(spec.num_samples)])
        self.futures.remember_sample(sampler_id, seq_id, out)
        return out

    # ------------------------------------------------------------------------------------------------ memory

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
            "base_bytes": self.model.base_bytes,
            "run_bytes": runs,
            "samplers": len(self.samplers.by_id),
            "sampler_adapters": len(self.samplers.snapshots),
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
