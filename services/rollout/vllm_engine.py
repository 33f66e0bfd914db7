"""The ``vllm`` rollout engine: vLLM with continuous batching, sampling log-probs and in-place weight reloads.

Two drivers, one behaviour: ``inproc`` (vLLM's in-process engine core, stepped by one thread; the service's default
on CPU) and ``async`` (``AsyncLLM``, engine core in a subprocess; GPU/NPU images). Engine settings come from
:func:`services.rollout.factory.vllm_engine_kwargs`. It holds two parts: the weight-update paths
(:class:`services.rollout.vllm_weights.VllmWeights`) and the LoRA adapters
(:class:`services.rollout.vllm_lora.VllmAdapters`).

Design (drivers, output kind, log-prob mode): docs/services.md#rollout ("How the engines work"); partial rollouts
(a pending swap aborts the requests in flight, which resume from prompt + tokens so far): docs/weight-sync.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from rlhf.models import load_tokenizer
from rlhf.serving.errors import FailedPrecondition, Internal, InvalidArgument, NotReady
from services.rollout.engine import EngineBase, decode_text
from services.rollout.engine_types import EngineHooks, PromptResult, Sample, StreamEvent, SwapResult
from services.rollout.options import SamplingOptions
from services.rollout.swap import read_checkpoint_manifest
from services.rollout.vllm_lora import LoraSpec, VllmAdapters
from services.rollout.vllm_named import DEFAULT_MAX_RANK, VllmNamedAdapters
from services.rollout.vllm_weights import LOAD_BUCKET_BYTES, VllmWeights

log = logging.getLogger("rlhf.rollout.vllm")

EXTENSION = "services.rollout.vllm_ext.WorkerExtension"


def set_vllm_env_defaults(device: str | None = None) -> None:
    """Environment vLLM (and the OpenMP runtime) read at start-up; values already set are kept.

    - ``OMP_NUM_THREADS=1``: vLLM's own default for serving. In-process on CPU it matters most: vLLM's CPU kernels
      otherwise run OpenMP teams across every core, and on a busy or small machine each barrier waits for a time
      slice (measured in docs/services.md#rollout). OpenMP reads it once, when torch loads, so
      this must run before anything imports torch (``services.rollout.main`` keeps torch out of its imports).
    - on CPU: ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; start-up refuses without it or a memory fraction),
      ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in-process: the ``inproc`` driver), and
      ``TORCH_COMPILE_DISABLE=1``: enforce_eager runs the model eagerly, but vLLM still torch.compile()s a sampler
      helper on the first request with log-probs (inductor work that takes long on a small CPU: docs/services.md).
    - on GPU/NPU: ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` (the images set it too).
    - ``HF_HUB_OFFLINE=1``: models are local directories; nothing is downloaded.
    """
    if "OMP_NUM_THREADS" not in os.environ:
        if "torch" in sys.modules:
            log.warning(
                "OMP_NUM_THREADS is not set and torch is already imported: vLLM's CPU kernels may use "
                "every core per step; set OMP_NUM_THREADS=1 in the environment"
            )
        os.environ["OMP_NUM_THREADS"] = "1"
    cpu = device == "cpu" or (device in (None, "auto") and not _has_accelerator())
    if not cpu:
        # The service already runs gRPC and uvicorn threads when vLLM starts its workers; fork would copy a
        # multi-threaded process (and CUDA/ACL state), which can deadlock or fail to initialise the device.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _has_accelerator() -> bool:
    """CUDA or Ascend present, without importing torch when it is not imported yet (see set_vllm_env_defaults)."""
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        if torch.cuda.is_available():
            return True
        return hasattr(torch, "npu") and torch.npu.is_available()
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/davinci_manager"))


def _top(position: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """The k most probable tokens of one position of vLLM's log-probs (rank 1 first; -inf: masked by top-k/top-p)."""
    ranked = sorted((lp.rank, t, float(lp.logprob)) for t, lp in position.items() if lp.rank is not None)
    return [(t, v) for rank, t, v in ranked if rank <= k and v > float("-inf")]


class VllmEngine(EngineBase):
    """The driver: start and close, the engine thread (inproc) or AsyncLLM (async), generation. Its two weight paths
    are parts it holds: :attr:`weights` (:class:`VllmWeights`, the whole model), which EngineBase's weight hooks
    delegate to, and :attr:`adapters` (:class:`VllmAdapters`, made at start with a ``lora`` spec), which takes every
    push instead."""

    kind = "vllm"
    supports_partial_rollouts = True

    def __init__(
        self,
        model_path: str | Path,
        model_name: str,
        *,
        dtype: str = "float32",
        seed: int = 0,
        hooks: EngineHooks | None = None,
        mode: str | None = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        staged_swap: bool | None = None,
        inplace_load_bytes: int | None = None,
        load_bucket_bytes: int = LOAD_BUCKET_BYTES,
        lora: LoraSpec | None = None,
        partial_rollouts: bool = False,
        max_adapters: int = 0,
        max_adapter_rank: int = DEFAULT_MAX_RANK,
    ):
        super().__init__(model_path, model_name, hooks)
        # named adapters (LoadAdapter; 0: off, vLLM's LoRA stays off unless the policy is adapter-pushed)
        self.max_adapters, self.max_adapter_rank = max_adapters, max_adapter_rank
        self.named: VllmNamedAdapters | None = None  # made at start, with the checkpoint's manifest
        if partial_rollouts and lora is not None:
            raise ValueError("partial rollouts with LoRA adapter pushes: an adapter push does not pause generation")
        self.partial_rollouts = partial_rollouts
        # Adapter-only weight sync (actor_rollout.lora_sync adapter): pushes are LoRA adapters (vllm_lora.py)
        self.lora = lora
        self.adapters: VllmAdapters | None = None  # made at start, once the checkpoint's manifest is read
        if max_model_len:
            self.max_model_len = min(self.max_model_len, int(max_model_len))
        if mode is None:
            mode = "inproc" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0" else "async"
        if mode not in ("inproc", "async"):
            raise ValueError(f"vLLM driver mode must be inproc or async, got {mode!r}")
        self.mode = mode
        self.dtype = dtype
        self.seed = seed
        self.max_num_seqs = max_num_seqs
        self.engine_kwargs = dict(engine_kwargs or {})
        self._ids = itertools.count()
        # inproc driver
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._futures: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        # streamed requests: every output (one per engine step) goes to the stream's queue as (index, output)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, int]] = {}
        self._dead: BaseException | None = None
        # partial rollouts: the requests a swap may stop (request id -> its stop strings), owned by the engine thread
        # in-process, by the event loop with AsyncLLM; and those it stopped, until their output is read
        self._preemptible: dict[str, tuple[str, ...]] = {}
        self._preempted: set[str] = set()
        # async driver
        self._async: Any = None
        self._inflight = 0
        self._preempting: asyncio.Task | None = None
        self.gate.on_preempt(self._on_preempt)
        self.weights = VllmWeights(
            self, staged_swap=staged_swap, inplace_load_bytes=inplace_load_bytes, load_bucket_bytes=load_bucket_bytes
        )

    # ------------------------------------------------------------------------------------------------ start / close

    def _engine_args(self, cls: type) -> Any:
        from vllm.config import WeightTransferConfig

        from services.rollout.vllm_transfer import BACKEND as TRANSFER_BACKEND

        kw: dict[str, Any] = dict(
            model=str(self.model_path),
            tokenizer=str(self.model_path),
            dtype=self.dtype,
            seed=self.seed,
            enforce_eager=self.default_enforce_eager(),  # actor_rollout.enforce_eager, when set, overrides it
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            worker_extension_cls=EXTENSION,
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            # vLLM's weight-transfer API with the collective backend (services/rollout/vllm_transfer.py, registered
            # by the worker extension): collective pushes go through init/start/update/finish
            weight_transfer_config=WeightTransferConfig(backend=TRANSFER_BACKEND),
        )
        if self.device_type == "cpu":
            # Whole prompts only: vLLM rewinds a seeded request's generator after a partial prefill by its CUDA offset,
            # which a CPU generator does not have ("CPU Generator does not use offset"), failing the whole batch: a
            # seeded request (an eval, a client's seed) whose prompt the token budget cut in two stopped the replica.
            kw.update(enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_model_len, 8192))
        if self.lora is not None:
            kw.update(self.lora.engine_args())
        if self.max_adapters:
            rank = max(self.max_adapter_rank, self.lora.max_lora_rank if self.lora else 0)
            kw.update(VllmNamedAdapters.engine_args(self.max_adapters, rank, 2 if self.lora else 0))
        kw.update(self.engine_kwargs)
        return cls(**kw)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if os.environ.get("TORCH_COMPILE_DISABLE") == "1":  # also when torch was imported before the variable was set
            import torch._dynamo

            torch._dynamo.config.disable = True
        self._manifest = await asyncio.to_thread(read_checkpoint_manifest, self.model_path)
        if self.max_adapters:
            self.named = VllmNamedAdapters(
                self.max_adapters, self.max_adapter_rank, self._manifest, str(self.model_path), self._lora_call
            )
        if self.lora is not None:  # a push is the adapter: checked against its names and shapes
            self.adapters = VllmAdapters(
                self.lora,
                self.model_path,
                self._manifest,
                served=self.served,
                lora_call=self._lora_call,
                serving_again=self._serving_again,
            )
            self._manifest = self.adapters.manifest
        self._tokenizer = await asyncio.to_thread(load_tokenizer, self.model_path)
        if self.mode == "inproc":
            started: asyncio.Future = loop.create_future()
            self._thread = threading.Thread(target=self._run, args=(loop, started), name="vllm-engine", daemon=True)
            self._thread.start()
            await started
        else:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            args = self._engine_args(AsyncEngineArgs)
            self._async = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        await self.weights.start()
        self._mark_loaded()
        log.info(
            "vLLM engine (%s) ready: %s, max_model_len %d; weight loading: %s",
            self.mode,
            self.model_path,
            self.max_model_len,
            self.weights.features,
        )

    def default_enforce_eager(self) -> bool:
        """Eager unless on CUDA with the staged swap off: vLLM's in-place reload copies each update into the
        tensors the captured CUDA graphs read, so graphs stay valid across pushes, while the staged swap installs
        another copy of the model that no graph was captured on. The CPU stages by default, and Ascend's graph mode
        has not been run with a reload here, so both stay eager."""
        return self.device_type != "cuda" or bool(self.weights.staged_swap_setting)

    @property
    def device_type(self) -> str:
        """vLLM's platform in this process (cuda, npu with vllm-ascend, cpu): its workers' device type."""
        from vllm.platforms import current_platform

        return str(current_platform.device_type)

    @property
    def device(self) -> Any:
        """Where a collective push lands when it is received in this process (EngineBase.receive_collective, on a
        worker without engine sessions: vLLM 0.23, vllm-ascend's set): vLLM's platform device. Without it an hccl push
        raised AttributeError after the replica took its ticket, and the trainer waited out HCCL_CONNECT_TIMEOUT."""
        return torch.device(self.device_type)

    async def close(self) -> None:
        await super().close()
        t0 = time.perf_counter()
        if self._thread is not None:
            self._cmds.put(("stop",))
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        if self._async is not None:
            eng, self._async = self._async, None
            await asyncio.to_thread(eng.shutdown)
        if self.adapters is not None:
            self.adapters.close()
        if self.named is not None:
            self.named.close()
        log.info("vLLM engine (%s) closed in %.2fs", self.mode, time.perf_counter() - t0)

    # ------------------------------------------------------------------------------------------------ inproc driver

    @staticmethod
    def _resolve(
        loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any = None, error: BaseException | None = None
    ) -> None:
        def _set() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(_set)

    def _run(self, loop: asyncio.AbstractEventLoop, started: asyncio.Future) -> None:
        """The engine thread: owns the LLMEngine; adds requests and runs calls between steps."""
        try:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine

            llm = LLMEngine.from_engine_args(self._engine_args(EngineArgs))
        except BaseException as err:  # noqa: BLE001 - reported to start()
            self._resolve(loop, started, error=err)
            return
        self._resolve(loop, started, True)
        try:
            while True:
                busy = llm.has_unfinished_requests()
                cmds = []
                if not busy:
                    cmds.append(self._cmds.get())
                while True:
                    try:
                        cmds.append(self._cmds.get_nowait())
                    except queue.Empty:
                        break
                while cmds:
                    if cmds[0][0] == "stop":
                        self._fail_all(NotReady("the rollout service is shutting down"))
                        return
                    self._command(llm, cmds.pop(0))  # held by _command only (see its "call" branch)
                if self._preemptible and self.gate.preempt.is_set():
                    self._preempt_inproc(llm)
                if llm.has_unfinished_requests():
                    self.hooks.step(llm.get_num_unfinished_requests())
                    self._dispatch(llm.step())
        except BaseException as err:  # the engine is dead: fail everything, stop being ready
            log.exception("vLLM engine thread failed")
            self._dead = err
            self._ready = False
            self._fail_all(Internal(f"the vLLM engine failed ({type(err).__name__}); see the service log"))
        finally:
            del llm

    def _dispatch(self, outs: list[Any]) -> None:
        """One step's outputs: a streamed request's go to its stream (one hand-over per event loop and step), a
        finished one's to its future."""
        streamed: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, int, Any]]] = {}
        for out in outs:
            if out.finished:
                self._preemptible.pop(out.request_id, None)
            sink = self._streams.get(out.request_id)
            if sink is not None:
                streamed.setdefault(sink[0], []).append((sink[1], sink[2], out))
                if out.finished:
                    del self._streams[out.request_id]
            elif out.finished:
                entry = self._futures.pop(out.request_id, None)
                if entry is not None:
                    self._resolve(entry[0], entry[1], out)
        for loop, items in streamed.items():
            self._hand_over(loop, items)

    @staticmethod
    def _hand_over(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, int, Any]]) -> None:
        def put() -> None:
            for q, k, item in items:
                q.put_nowait((k, item))

        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(put)

    def _command(self, llm: Any, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "stream":  # as "add", each output to the stream's queue
            _, items, lora, loop, q = cmd
            for k, (rid, prompt, sp, stops) in enumerate(items):
                try:
                    llm.add_request(rid, {"prompt_token_ids": prompt}, sp, lora_request=lora)
                    self._streams[rid] = (loop, q, k)
                    if stops is not None:
                        self._preemptible[rid] = stops
                except BaseException as err:  # noqa: BLE001 - reported to the stream
                    self._hand_over(loop, [(q, k, err)])
        elif kind == "add":  # all prompts of one request join the batch in the same step
            _, items, lora, loop, futs = cmd
            for (rid, prompt, sp, stops), fut in zip(items, futs, strict=True):
                try:
                    # outputs carry this (external) id
                    llm.add_request(rid, {"prompt_token_ids": prompt}, sp, lora_request=lora)
                    self._futures[rid] = (loop, fut)
                    if stops is not None:
                        self._preemptible[rid] = stops
                except BaseException as err:  # noqa: BLE001 - reported to the caller
                    self._resolve(loop, fut, error=err)
        elif kind == "abort":  # the caller went away: its outputs are dropped
            rids = [rid for rid in cmd[1] if (self._futures.pop(rid, None) or self._streams.pop(rid, None)) is not None]
            for rid in rids:
                self._preemptible.pop(rid, None)
            if rids:
                llm.abort_request(rids)
        elif kind == "call":
            _, fn, loop, fut = cmd
            del cmd
            try:
                value, error = fn(llm), None
            except BaseException as err:  # noqa: BLE001
                value, error = None, err
            # the call (a weight bucket's tensors, say) goes before its caller resumes: a buffer its caller then
            # gives back is free at once
            del fn
            self._resolve(loop, fut, value, error)

    def _preempt_inproc(self, llm: Any) -> None:
        """Partial rollouts, on the engine thread while a swap waits: abort each preemptible request that may stop now
        (:func:`_stoppable`) and hand over its output so far (finish reason ``abort``) as a finished one's. vLLM's
        in-process engine makes no output for an aborted request (AsyncLLM does, in its abort), so it is made here
        from the request's output state, as AsyncLLM's abort makes it."""
        from vllm.v1.engine import FinishReason

        proc = llm.output_processor
        outs = []
        for rid, stops in list(self._preemptible.items()):
            states = [st for i in proc.external_req_ids.get(rid, ()) if (st := proc.request_states.get(i)) is not None]
            if not states or not all(_stoppable(st.detokenizer, stops) for st in states):
                continue  # next step (vLLM checks the stop strings of what it decodes after the resume only)
            made = [st.make_request_output([], None, FinishReason.ABORT, None) for st in states]
            llm.abort_request([rid])
            for st in states:  # vLLM's abort by request id leaves a parent of n > 1 samples behind
                if st.parent_req is not None:
                    proc.parent_requests.pop(st.parent_req.request_id, None)
            del self._preemptible[rid]
            self._preempted.add(rid)
            outs += [o for o in made if o is not None]  # n > 1 without streaming: the last child's holds them all
        self._dispatch(outs)

    def _fail_all(self, err: BaseException) -> None:
        self._preemptible.clear()
        entries, self._futures = list(self._futures.values()), {}
        for loop, fut in entries:
            self._resolve(loop, fut, error=err)
        sinks, self._streams = list(self._streams.values()), {}
        for loop, q, k in sinks:
            self._hand_over(loop, [(q, k, err)])
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                for fut in cmd[-1]:
                    self._resolve(cmd[-2], fut, error=err)
            elif cmd[0] == "stream":
                self._hand_over(cmd[-2], [(cmd[-1], k, err) for k in range(len(cmd[1]))])
            elif cmd[0] == "call":
                self._resolve(cmd[-2], cmd[-1], error=err)

    def _check_alive(self) -> None:
        if self._dead is not None or (self.mode == "inproc" and self._thread is None):
            raise NotReady("the vLLM engine is not running")

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(llm)`` on the engine thread between two steps."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._cmds.put(("call", fn, loop, fut))
        return await fut

    async def _rpc(self, method: str, *args: Any) -> Any:
        """One worker call (the first worker's answer)."""
        if self.mode == "inproc":
            return (await self._call(lambda llm: llm.collective_rpc(method, args=args)))[0]
        return (await self._async.collective_rpc(method, args=args))[0]

    def _items(self, prompts: list[list[int]], sps: list[Any], stops: tuple[str, ...] | None) -> list[tuple]:
        """(request id, prompt, sampling parameters, stop strings: None unless a swap may stop it) per prompt."""
        tag = uuid.uuid4().hex[:8]
        return [(f"r{next(self._ids)}-{tag}", p, sp, stops) for p, sp in zip(prompts, sps, strict=True)]

    async def _submit_many(self, items: list[tuple], lora: Any = None) -> list[Any]:
        """One vLLM request per item (:meth:`_items`), added to the engine together (so they share the same steps);
        ``lora``: the adapter they run on (None: the base model)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        futs = [loop.create_future() for _ in items]
        self._cmds.put(("add", items, lora, loop, futs))
        try:
            return list(await asyncio.gather(*futs))
        except BaseException:
            for f in futs:
                f.cancel()
            self._cmds.put(("abort", [item[0] for item in items]))
            raise

    async def _submit_async(self, item: tuple, lora: Any = None) -> Any:
        rid, prompt, sp, stops = item
        self._inflight += 1
        self.hooks.step(self._inflight)  # async driver: requests in flight when this one joins
        if stops is not None:
            self._preemptible[rid] = stops
        final = None
        try:
            async for out in self._async.generate({"prompt_token_ids": prompt}, sp, request_id=rid, lora_request=lora):
                final = out
        finally:
            self._inflight -= 1
            self._preemptible.pop(rid, None)
        return final

    async def _stream_inproc(self, items: list[tuple], lora: Any) -> AsyncIterator[tuple[int, Any]]:
        """(item index, output) as the engine thread hands each step's outputs over; closing it aborts what is
        still running."""
        self._check_alive()
        q: asyncio.Queue = asyncio.Queue()
        self._cmds.put(("stream", items, lora, asyncio.get_running_loop(), q))
        left = len(items)
        try:
            while left:
                k, out = await q.get()
                if isinstance(out, BaseException):
                    raise out
                left -= bool(out.finished)
                yield k, out
        finally:
            if left:
                self._cmds.put(("abort", [item[0] for item in items]))

    async def _stream_async(self, items: list[tuple], lora: Any) -> AsyncIterator[tuple[int, Any]]:
        """(item index, output) from AsyncLLM's generators, merged; closing it closes them (vLLM aborts)."""
        from vllm.utils.async_utils import merge_async_iterators

        gens = [
            self._async.generate({"prompt_token_ids": p}, sp, request_id=rid, lora_request=lora)
            for rid, p, sp, _ in items
        ]
        self._inflight += len(gens)
        self.hooks.step(self._inflight)
        self._preemptible.update((rid, stops) for rid, _, _, stops in items if stops is not None)
        try:
            async for k, out in merge_async_iterators(*gens):
                yield k, out
        finally:
            self._inflight -= len(gens)
            for rid, *_ in items:
                self._preemptible.pop(rid, None)

    def _on_preempt(self) -> None:
        """A swap waits (AsyncLLM driver): stop the preemptible requests (the in-process engine thread polls)."""
        if self._async is not None and (self._preempting is None or self._preempting.done()):
            self._preempting = asyncio.get_running_loop().create_task(self._preempt_async())

    async def _preempt_async(self) -> None:
        """Abort each preemptible request once it may stop (:func:`_stoppable`) while the swap waits: AsyncLLM's abort
        ends its generator with its output so far (finish reason ``abort``)."""
        proc = self._async.output_processor
        # while requests hold the gate: one admitted just before the swap may register only now
        while self.gate.active and self.gate.preempt.is_set():
            ready = []
            for rid, stops in list(self._preemptible.items()):
                states = [st for i in proc.external_req_ids.get(rid, ()) if (st := proc.request_states.get(i))]
                if states and all(_stoppable(st.detokenizer, stops) for st in states):
                    ready.append(rid)
                    del self._preemptible[rid]
                    self._preempted.add(rid)
            if ready:  # its output processor makes the outputs at once (no await between the check and them)
                await self._async.abort(ready)
            await asyncio.sleep(0.002)  # requests still before their first token, or inside a stop string

    def check_adapter(self, name: str) -> None:
        if self.named is None:
            raise self._no_adapters()
        self.named.store.check(name)

    async def load_adapter(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> list[str]:
        if self.named is None:
            raise self._no_adapters()
        self.check_ready()
        return await self.named.load(name, tensors, config)

    async def _lora_call(self, method: str, arg: Any) -> Any:
        """vLLM's ``add_lora`` / ``remove_lora`` (``method``) on this driver's engine: the adapter path's handle."""
        if self.mode == "inproc":
            return await self._call(lambda llm: getattr(llm, method)(arg))
        return await getattr(self._async, method)(arg)

    # ------------------------------------------------------------------------------------------------ weights
    #
    # EngineBase's weight hooks, routed to the part that serves this engine's pushes: the adapter path when there
    # is one (a LoRA adapter per push, no pause), else the whole-model path. The swap gate and versions stay here.

    async def swap_weights(
        self, tensors: dict[str, Any], version: int, checksum: str, parent_version: int | None = None
    ) -> SwapResult:
        if self.adapters is not None:
            result = await self.adapters.swap(tensors, version, checksum, parent_version)
            self.hooks.swapped(result)  # no pause: counted as a swap with no wait
            return result
        async with self.weights.update_lock():
            return await super().swap_weights(tensors, version, checksum, parent_version)

    async def _prepare_weights(self, tensors: dict[str, Any]) -> Any:
        return await self.weights.prepare(tensors)

    async def _load_weights(self, staged: Any) -> None:
        await self.weights.load(staged)

    def streams_update(self, total_bytes: int) -> bool:
        return self.adapters is None and self.weights.streams_update(total_bytes)

    async def install_streamed(self, header: Any, buckets: Any) -> SwapResult:
        async with self.weights.update_lock():  # after any update still loading into the shadow
            return await super().install_streamed(header, buckets)

    async def _stream_begin(self, header: Any) -> None:
        await self.weights.stream_begin(header)

    async def _stream_bucket(self, bucket: Any) -> None:
        await self.weights.stream_bucket(bucket)

    async def _stream_end(self) -> None:
        await self.weights.stream_end()

    async def _stream_abort(self) -> None:
        await self.weights.stream_abort()

    async def receive_collective(self, group: Any, ticket: bytes, header: Any, per_bucket: list) -> tuple[Any, int]:
        if self.adapters is None and self.weights.receives_collective:
            return await self.weights.receive_collective(group, ticket, header, per_bucket)
        # into this process: vLLM reads an adapter from its folder, and a worker without engine sessions cannot
        # receive while it generates (on the device for nccl/hccl)
        return await super().receive_collective(group, ticket, header, per_bucket)

    @property
    def collective_ranks(self) -> int:
        # an adapter's collective push is received by this process alone, whatever vLLM's worker count
        return 1 if self.adapters is not None else self.weights.collective_ranks

    # The whole-model path's settings and state, read (and in tests set) on the engine

    @property
    def load_path(self) -> str:
        return self.weights.load_path

    @property
    def staged_swap_setting(self) -> bool | None:
        return self.weights.staged_swap_setting

    @property
    def staged_swap(self) -> bool:
        return self.weights.staged_swap

    @staged_swap.setter
    def staged_swap(self, value: bool) -> None:
        self.weights.staged_swap = value

    @property
    def inplace_load_bytes(self) -> int | None:
        return self.weights.inplace_load_bytes

    @inplace_load_bytes.setter
    def inplace_load_bytes(self, value: int | None) -> None:
        self.weights.inplace_load_bytes = value

    # ------------------------------------------------------------------------------------------------ generation

    def _sampling_params(self, o: SamplingOptions, stream: bool = False) -> Any:
        """vLLM's sampling parameters; ``stream``: an output per engine step with what it added (DELTA), else the
        finished request only."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=o.n,
            temperature=o.temperature,
            top_p=o.top_p,
            top_k=o.top_k if o.top_k > 0 else 0,
            max_tokens=o.max_tokens,
            stop=list(o.stop) or None,
            stop_token_ids=list(o.stop_token_ids) or None,
            seed=o.seed,
            ignore_eos=o.ignore_eos,
            repetition_penalty=o.repetition_penalty,
            frequency_penalty=o.frequency_penalty,
            presence_penalty=o.presence_penalty,
            logprobs=o.top_logprobs,  # 0: the sampled token's only
            prompt_logprobs=o.prompt_logprobs,  # None: off; computed from the raw logits (temperature 1)
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            skip_special_tokens=True,
        )

    def _stops(self, o: SamplingOptions) -> tuple[str, ...] | None:
        """Partial rollouts: a request a swap may stop gets its stop strings (see :func:`_stoppable`), else None.
        Not with frequency or presence penalties: vLLM counts them over the output only, and a resumed request's
        earlier tokens are its prompt, so it would decode as no uninterrupted request does; such a request runs to
        its end on the weights it started with (the swap waits for it). The repetition penalty counts prompt and
        output alike, so it stays as it was."""
        if not self.partial_rollouts or o.frequency_penalty or o.presence_penalty:
            return None
        return tuple(o.stop)

    async def _generate(self, prompts: list[list[int]], params: SamplingOptions, version: int) -> list[PromptResult]:
        # vLLM refuses n > 1 with greedy decoding: send n requests of one sample each instead
        reps = params.n if params.greedy and params.n > 1 else 1
        sp = self._sampling_params(replace(params, n=1) if reps > 1 else params)
        flat = [p for p in prompts for _ in range(reps)]
        if params.adapter is not None:  # a named adapter over the base: not stopped by a swap (no _continue)
            assert self.named is not None  # validate checked it
            if params.prompt_logprobs is not None and params.n > 1:
                # vLLM 0.32's CPU LoRA logits (lm_head) fail the whole engine on this (an einsum over rows of
                # prompt and samples; tests/integration/test_training_fleet_sampling.py): refused, the engine lives
                raise InvalidArgument(
                    "prompt log-probs of n > 1 samples on a named adapter: not served by the vllm engine; ask n=1 "
                    "for the prompt's log-probs",
                    field="prompt_logprobs",
                )
            named = self.named.store.pin(params.adapter)
            try:
                outs = await self._submit(self._items(flat, [sp] * len(flat), None), named.request)
            finally:
                self.named.store.unpin(named)
            return self._results(prompts, params, version, reps, outs)
        items = self._items(flat, [sp] * len(flat), self._stops(params))
        if self.adapters is None:
            return self._results(prompts, params, version, reps, await self._submit(items, None))
        # bound to the adapter of the version it was admitted under (before any await: no swap comes in between)
        lora = self.adapters.acquire(version)
        try:
            outs = await self._submit(items, lora)
        finally:
            await self.adapters.release(version)
        return self._results(prompts, params, version, reps, outs)

    async def _submit(self, items: list[tuple], lora: Any) -> list[Any]:
        if self.mode == "inproc":
            return await self._submit_many(items, lora)
        tasks = [asyncio.ensure_future(self._submit_async(item, lora)) for item in items]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    def _results(
        self, prompts: list[list[int]], params: SamplingOptions, version: int, reps: int, outs: list[Any]
    ) -> list[PromptResult]:
        results = []
        for i, prompt in enumerate(prompts):
            samples = []
            group = outs[i * reps : (i + 1) * reps]
            for out in group:
                stopped = self._was_preempted(out)
                for c in sorted(out.outputs, key=lambda c: c.index):
                    ids = list(c.token_ids)
                    lps, top = _token_logprobs(ids, c.logprobs, params.top_logprobs)
                    samples.append(_sample(ids, lps, top, c.text, c, version, stopped))
            result = PromptResult(prompt_token_ids=list(prompt), samples=samples)
            if params.prompt_logprobs is not None:
                lps, tops = _prompt_logprobs(prompt, group[0].prompt_logprobs, params.prompt_logprobs)
                result.prompt_logprobs, result.prompt_top_logprobs = lps, tops
            results.append(result)
        return results

    def _was_preempted(self, out: Any) -> bool:
        """Whether a swap stopped ``out``'s request (its samples that end with ``abort``; those that finished before
        keep their finish reason). Its last output forgets the id."""
        if out.request_id not in self._preempted:
            return False
        if out.finished:  # a streamed request of n > 1 samples: its last output
            self._preempted.discard(out.request_id)
        return True

    async def _continue(
        self, prompts: list[list[int]], outputs: list[list[int]], opts: list[SamplingOptions], version: int
    ) -> list[Sample]:
        """Each sample as a request of its own whose prompt is its prompt + its tokens so far (vLLM's stop-string
        check reads the new text only: :func:`_stoppable` keeps the cut out of a stop string)."""
        flat = [[*p, *out] for p, out in zip(prompts, outputs, strict=True)]
        items = [
            item
            for o, f in zip(opts, flat, strict=True)
            for item in self._items([f], [self._sampling_params(o)], self._stops(o))
        ]
        outs = await self._submit(items, None)
        samples = []
        for out, before, o in zip(outs, outputs, opts, strict=True):
            stopped = self._was_preempted(out)
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps, top = _token_logprobs(ids, c.logprobs, o.top_logprobs)
            samples.append(_sample(ids, lps, top, self._text_before(before) + c.text, c, version, stopped))
        return samples

    def _text_before(self, tokens: list[int]) -> str:
        """The text of a stopped sample's tokens: what its resumed part's text (vLLM's, of the new tokens) follows."""
        return decode_text(self._tokenizer, tokens) if tokens else ""

    def _generate_stream(
        self, prompts: list[list[int]], params: SamplingOptions, version: int
    ) -> AsyncIterator[StreamEvent]:
        """What each engine step adds to each sample, as vLLM hands it out (``RequestOutputKind.DELTA``: new tokens,
        their log-probs and the new text, a stop string held back; several steps merged when this consumer falls
        behind, as vLLM's own server gets them); a sample's last event carries the whole sample, the first of each
        sample the prompt's log-probs when asked. Greedy ``n > 1`` is ``n`` requests, as in :meth:`_generate`."""
        if params.adapter is not None:
            raise FailedPrecondition("named adapters are not streamed by the vllm engine: send a whole request")
        reps = params.n if params.greedy and params.n > 1 else 1
        sp = self._sampling_params(replace(params, n=1) if reps > 1 else params, stream=True)
        flat = [p for p in prompts for _ in range(reps)]
        items = self._items(flat, [sp] * len(flat), self._stops(params))
        return self._stream(items, [(k // reps, k % reps) for k in range(len(flat))], params, version, prompts=flat)

    def _continue_stream(
        self, prompts: list[list[int]], outputs: list[list[int]], opts: list[SamplingOptions], version: int
    ) -> AsyncIterator[StreamEvent]:
        items = [
            item
            for p, out, o in zip(prompts, outputs, opts, strict=True)
            for item in self._items([[*p, *out]], [self._sampling_params(o, stream=True)], self._stops(o))
        ]
        texts = [self._text_before(out) for out in outputs]
        return self._stream(items, [(k, 0) for k in range(len(items))], opts[0], version, texts=texts)

    async def _stream(
        self,
        items: list[tuple],
        where: list[tuple[int, int]],
        params: SamplingOptions,
        version: int,
        prompts: list[list[int]] | None = None,
        texts: list[str] | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """The events of ``items``' requests: request k's samples are (prompt index, first sample index) ``where[k]``
        (+ vLLM's sample index); ``prompts``: theirs, for prompt log-probs; ``texts``: the text each sample's
        finished text follows (a resumed sample's so far)."""
        adapters = self.adapters
        lora = None if adapters is None else adapters.acquire(version)  # as in _generate
        outputs = self._stream_inproc(items, lora) if self.mode == "inproc" else self._stream_async(items, lora)
        partial: dict[tuple[int, int], _Partial] = {}
        prompt_lps: dict[int, dict[str, Any]] = {}  # per request: the prompt's log-probs, from its first output
        try:
            async for k, out in outputs:
                i, j0 = where[k]
                if params.prompt_logprobs is not None and k not in prompt_lps and out.prompt_logprobs:
                    assert prompts is not None
                    lps, tops = _prompt_logprobs(prompts[k], out.prompt_logprobs, params.prompt_logprobs)
                    prompt_lps[k] = {"prompt_logprobs": lps, "prompt_top_logprobs": tops}
                stopped = self._was_preempted(out)
                for c in out.outputs:
                    if not c.token_ids and c.finish_reason is None:
                        continue  # nothing new (a prefill chunk)
                    j = j0 + c.index  # several requests of one prompt: one sample each; else vLLM's sample index
                    opening: dict[str, Any] = {}
                    if (i, j) not in partial and params.prompt_logprobs is not None:
                        if k not in prompt_lps:
                            raise Internal("vLLM returned no prompt log-probs for a request that asked for them")
                        opening = prompt_lps[k]
                    acc = partial.setdefault((i, j), _Partial(text=texts[k] if texts else ""))
                    ids = list(c.token_ids)
                    lps, top = _token_logprobs(ids, c.logprobs, params.top_logprobs)
                    acc.add(ids, lps, top, c.text)
                    smp = acc.sample(c, version, stopped) if c.finish_reason is not None else None
                    yield StreamEvent(i, j, ids, lps, top, smp, text=c.text, **opening)
        finally:
            await outputs.aclose()  # aborts what is still running
            if adapters is not None:
                await adapters.release(version)


@dataclass
class _Partial:
    """A streamed sample so far."""

    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] | None = None
    text: str = ""

    def add(self, ids: list[int], lps: list[float], top: list[list[tuple[int, float]]] | None, text: str) -> None:
        self.ids += ids
        self.lps += lps
        if top is not None:
            if self.top is None:
                self.top = []
            self.top += top
        self.text += text

    def sample(self, c: Any, version: int, stopped: bool = False) -> Sample:
        return _sample(self.ids, self.lps, self.top, self.text, c, version, stopped)


def _stoppable(detokenizer: Any, stops: tuple[str, ...]) -> bool:
    """Whether a swap may stop a request now (partial rollouts), from its vLLM output state: it has a token since
    it was admitted (each admission makes progress, however often swaps come), and its text ends neither inside one
    of its stop strings (vLLM's check of the resumed request reads the new text only, so a stop string across the cut
    would be missed) nor inside a character (its text so far and the resumed part's are decoded apart)."""
    if detokenizer is None or detokenizer.num_output_tokens() < 1:
        return False
    text = getattr(detokenizer, "output_text", "")
    return not text.endswith("\ufffd") and not any(text.endswith(s[:k]) for s in stops for k in range(1, len(s)))


def _token_logprobs(ids: list[int], positions: Any, k: int) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """vLLM's sample log-probs (per generated token a dict holding it and the top k by rank) -> the sampled tokens'
    log-probs and, with ``k``, their alternatives."""
    lps = [float(d[t].logprob) for t, d in zip(ids, positions or [], strict=True)] if ids else []
    return lps, ([_top(d, k) for d in (positions or [])] if k else None)


def _sample(
    ids: list[int],
    lps: list[float],
    top: list[list[tuple[int, float]]] | None,
    text: str,
    c: Any,
    version: int,
    stopped: bool = False,
) -> Sample:
    """A finished sample; ``c``: its last CompletionOutput (the finish and stop reasons); ``stopped``: its request
    was aborted by a swap (partial rollouts), so the sample is ``preempted`` unless it had finished before."""
    reason = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "length"
    return Sample(
        preempted=stopped and reason == "abort",
        token_ids=ids,
        logprobs=lps,
        finish_reason=reason,
        text=text,
        policy_version=version,
        stop_reason=c.stop_reason,
        top_logprobs=top,
    )


def _prompt_logprobs(
    prompt: list[int], positions: list[dict[int, Any] | None] | None, k: int
) -> tuple[list[float | None], list[list[tuple[int, float]] | None] | None]:
    """vLLM's ``prompt_logprobs`` (per prompt position, None first, else a dict holding the prompt token and the k
    most probable ones) -> the prompt's log-probs and, with ``k``, the alternatives (PromptResult's fields)."""
    if positions is None:
        raise Internal("vLLM returned no prompt log-probs for a request that asked for them")
    lps: list[float | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    for t, d in zip(prompt[1:], positions[1:], strict=True):
        lps.append(float(d[t].logprob))
        tops.append(_top(d, k))
    return lps, (tops if k else None)
