"""The ``vllm`` rollout engine: vLLM with continuous batching, sampling log-probs and in-place weight reloads.

Two drivers, one behaviour:

- ``inproc`` (default when ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which the service sets on CPU): vLLM's
  ``LLMEngine`` with the in-process engine core, stepped by one dedicated thread. Requests from the asyncio side are
  queued to that thread, which adds them between steps, so concurrent requests join the running batch (continuous
  batching); a finished request resolves its future on the event loop. Starts in about 5 s on CPU, no subprocess.
  (vLLM 0.32's ``AsyncLLM`` always starts its engine core in a subprocess, whatever that variable says.)
- ``async`` (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, GPU/NPU images): vLLM's ``AsyncLLM`` (engine core in a
  subprocess, overlapping scheduling with the device).

Both use ``RequestOutputKind.FINAL_ONLY`` (one output per request: per-token streaming costs ~20x throughput),
``logprobs=0`` (the sampled token's log-prob only) and ``logprobs_mode="processed_logprobs"`` (log-probs after
temperature and top-k/top-p: the distribution sampled from; the default ``raw_logprobs`` ignores the temperature),
a seed per request, and the engine settings of ``actor_rollout`` (``max_model_len``, ``gpu_memory_utilization``,
``tensor_model_parallel_size``, ``enforce_eager``: :func:`services.rollout.factory.vllm_engine_kwargs`).

Weights: the state dict reaches the worker in parts of at most ``load_bucket_bytes`` (128 MiB), one worker call each,
never whole (vLLM's msgpack RPC stops a bytes object at 4 GiB, and the worker would hold a second copy): as the
tensors themselves in-process, as one safetensors file per part for the engine-core subprocess. They go through
vLLM's weight-transfer API (one ``update_weights`` per part, loaded at once in place inside the swap gate;
:mod:`services.rollout.vllm_transfer`), into the shadow model of a staged swap (:mod:`services.rollout.vllm_shadow`),
or on a worker without the API through the worker extension (:mod:`services.rollout.vllm_ext`); the prefix cache is
reset afterwards (cached KV blocks belong to the old weights). Updates of at least ``inplace_load_bytes``
(``RLHF_WEIGHTS_INPLACE_LOAD_BYTES``, 2 GiB by default) are installed as they arrive instead
(:meth:`EngineBase.install_streamed`): each verified bucket goes into the serving model with one ``update_weights``,
generation paused for the whole transfer, about two buckets of memory instead of a copy of the model.
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
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rlhf.serving.errors import Internal, NotReady
from services.rollout.engine import EngineBase, EngineHooks, PromptResult, Sample, read_checkpoint_manifest
from services.rollout.options import SamplingOptions

log = logging.getLogger("rlhf.rollout.vllm")

EXTENSION = "services.rollout.vllm_ext.WorkerExtension"


def set_vllm_env_defaults(device: str | None = None) -> None:
    """Environment vLLM (and the OpenMP runtime) read at start-up; values already set are kept.

    - ``OMP_NUM_THREADS=1``: vLLM's own default for serving. In-process on CPU it matters most: vLLM's CPU kernels
      otherwise run OpenMP teams across every core, and on a busy or small machine each barrier waits for a time
      slice (measured here: 25-45 ms per decode step instead of 3 ms). OpenMP reads it once, when torch loads, so
      this must run before anything imports torch (``services.rollout.main`` keeps torch out of its imports).
    - on CPU: ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; start-up refuses without it or a memory fraction),
      ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine core in-process: the ``inproc`` driver), and
      ``TORCH_COMPILE_DISABLE=1``: enforce_eager runs the model eagerly, but vLLM still torch.compile()s a sampler
      helper on the first request with log-probs (20-60 s of inductor work on a 2-core machine).
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


# An update received but never committed (expired, aborted) is still open in the worker: these calls end it and start
# a new one (start_weight_update refused with "already active").
_END_UNCOMMITTED = (
    ("update_weights", ({"index": -1, "nbytes": 0, "sha256": "", "discard": True},)),
    ("finish_weight_update", ()),
    ("start_weight_update", ()),
)


LOAD_BUCKET_BYTES = 128 << 20  # the most one worker call carries (rlhf.transport.weights' default bucket size)
INPLACE_ENV = "RLHF_WEIGHTS_INPLACE_LOAD_BYTES"
DEFAULT_INPLACE_LOAD_BYTES = 2 << 30


def inplace_load_bytes_from_env(env: dict[str, str] | None = None) -> int | None:
    """``RLHF_WEIGHTS_INPLACE_LOAD_BYTES``: updates of at least this many bytes are installed in place, bucket by
    bucket as they arrive (:meth:`EngineBase.install_streamed`); default 2 GiB, ``0``: every update, ``off``: none."""
    raw = (os.environ if env is None else env).get(INPLACE_ENV, "").strip().lower()
    if not raw:
        return DEFAULT_INPLACE_LOAD_BYTES
    if raw in ("off", "never", "none"):
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{INPLACE_ENV}={raw!r}: give a byte count (0: every update) or off")
    return value


def _safetensors_bytes(tensors: dict[str, Any]) -> bytes:
    from safetensors.torch import save

    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    try:
        return save(flat)
    except RuntimeError:  # tensors sharing storage (tied weights): give each its own copy
        return save({k: v.clone() for k, v in flat.items()})


def _groups(tensors: dict[str, Any], limit: int) -> list[list[tuple[str, Any]]]:
    """Whole tensors in order in groups of at most ``limit`` bytes (a larger tensor alone), planned as the push plans
    its buckets: what one worker call carries, so no message holds the whole update (msgpack's bin32 stops at 4 GiB)
    and the worker loads it bucket by bucket."""
    from rlhf.transport.weights.format import plan_sizes

    sizes = ((name, t.numel() * t.element_size()) for name, t in tensors.items())
    return [[(name, tensors[name]) for name in names] for names in plan_sizes(sizes, limit)]


def reset_prefix_cache(llm: Any) -> None:
    """Drop the prefix cache after new weights went in (its KV was computed with the old ones). vLLM returns False,
    resetting nothing, while any block is still held (an aborted request's): then again with running requests reset
    (the swap gate lets none run meanwhile); still False fails the swap rather than serve stale KV."""
    if not llm.reset_prefix_cache() and not llm.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("vLLM could not reset its prefix cache after a weight update (blocks still held)")


async def areset_prefix_cache(llm: Any) -> None:
    """:func:`reset_prefix_cache` for ``AsyncLLM``."""
    if not await llm.reset_prefix_cache() and not await llm.reset_prefix_cache(reset_running_requests=True):
        raise RuntimeError("vLLM could not reset its prefix cache after a weight update (blocks still held)")


def _top(position: dict[int, Any], k: int) -> list[tuple[int, float]]:
    """The k most probable tokens of one position of vLLM's log-probs (rank 1 first; -inf: masked by top-k/top-p)."""
    ranked = sorted((lp.rank, t, float(lp.logprob)) for t, lp in position.items() if lp.rank is not None)
    return [(t, v) for rank, t, v in ranked if rank <= k and v > float("-inf")]


class VllmEngine(EngineBase):
    kind = "vllm"

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
    ):
        super().__init__(model_path, model_name, hooks)
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
        self._dead: BaseException | None = None
        # async driver
        self._async: Any = None
        self._inflight = 0
        self._features: dict[str, bool] = {}  # what the worker offers (rlhf_features), asked at start
        self.load_path = ""  # how the last update went in: "staged_swap", "weight_transfer" or "reload"
        # Staged swaps (vllm_shadow.py): None = where the worker supports them, on the CPU; True = wherever the worker
        # supports them (a second copy of the weights in device memory); False = never.
        self.staged_swap_setting = staged_swap
        self.staged_swap = False  # decided at start
        self._stage_lock = asyncio.Lock()  # one update in the shadow at a time, from staging until its swap
        # Updates of at least this many bytes go into the serving model in place, bucket by bucket as they arrive
        # (install_streamed: generation paused for the transfer, a bucket or two of memory); None: never.
        # services.rollout.factory.make_engine sets it from RLHF_WEIGHTS_INPLACE_LOAD_BYTES.
        self.inplace_load_bytes = inplace_load_bytes
        self.load_bucket_bytes = load_bucket_bytes  # what one worker call carries of an update received whole

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
        kw.update(self.engine_kwargs)
        return cls(**kw)

    async def start(self) -> None:
        from rlhf.models import load_tokenizer

        loop = asyncio.get_running_loop()
        if os.environ.get("TORCH_COMPILE_DISABLE") == "1":  # also when torch was imported before the variable was set
            import torch._dynamo

            torch._dynamo.config.disable = True
        self._manifest = await asyncio.to_thread(read_checkpoint_manifest, self.model_path)
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
        self._features = await self._worker_features()
        self.staged_swap = self._decide_staged_swap()
        self._mark_loaded()
        log.info(
            "vLLM engine (%s) ready: %s, max_model_len %d; weight loading: %s",
            self.mode,
            self.model_path,
            self.max_model_len,
            self._features,
        )

    def default_enforce_eager(self) -> bool:
        """Eager unless on CUDA with the staged swap off: vLLM's in-place reload copies each update into the
        tensors the captured CUDA graphs read, so graphs stay valid across pushes, while the staged swap installs
        another copy of the model that no graph was captured on. The CPU stages by default, and Ascend's graph mode
        has not been run with a reload here, so both stay eager."""
        return self.device_type != "cuda" or bool(self.staged_swap_setting)

    def _decide_staged_swap(self) -> bool:
        want = self.staged_swap_setting
        if want is False:
            return False
        if not self._features.get("staged_swap"):
            why = self._features.get("staged_swap_unsupported") or "the worker extension is older"
            if want:
                raise ValueError(f"actor_rollout.staged_weight_swap is on but this vLLM worker cannot stage: {why}")
            log.info("weight updates load inside the swap gate (no staged swap: %s)", why)
            return False
        return bool(want) or self.device_type == "cpu"

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
                if llm.has_unfinished_requests():
                    self.hooks.step(llm.get_num_unfinished_requests())
                    for out in llm.step():
                        if out.finished:
                            entry = self._futures.pop(out.request_id, None)
                            if entry is not None:
                                self._resolve(entry[0], entry[1], out)
        except BaseException as err:  # noqa: BLE001 - the engine is dead: fail everything, stop being ready
            log.exception("vLLM engine thread failed")
            self._dead = err
            self._ready = False
            self._fail_all(Internal(f"the vLLM engine failed ({type(err).__name__}); see the service log"))
        finally:
            del llm

    def _command(self, llm: Any, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":  # all prompts of one request join the batch in the same step
            _, items, sp, loop, futs = cmd
            for (rid, prompt), fut in zip(items, futs, strict=True):
                try:
                    llm.add_request(rid, {"prompt_token_ids": prompt}, sp)  # outputs carry this (external) id
                    self._futures[rid] = (loop, fut)
                except BaseException as err:  # noqa: BLE001 - reported to the caller
                    self._resolve(loop, fut, error=err)
        elif kind == "abort":
            rids = [rid for rid in cmd[1] if self._futures.pop(rid, None) is not None]
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

    def _fail_all(self, err: BaseException) -> None:
        entries, self._futures = list(self._futures.values()), {}
        for loop, fut in entries:
            self._resolve(loop, fut, error=err)
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                for fut in cmd[-1]:
                    self._resolve(cmd[-2], fut, error=err)
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

    async def _submit_many(self, prompts: list[list[int]], sp: Any) -> list[Any]:
        """One vLLM request per prompt, added to the engine together (so they share the same steps)."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        tag = uuid.uuid4().hex[:8]
        items = [(f"r{next(self._ids)}-{tag}", p) for p in prompts]
        futs = [loop.create_future() for _ in prompts]
        self._cmds.put(("add", items, sp, loop, futs))
        try:
            return list(await asyncio.gather(*futs))
        except BaseException:
            for f in futs:
                f.cancel()
            self._cmds.put(("abort", [rid for rid, _ in items]))
            raise

    async def _submit_async(self, prompt: list[int], sp: Any) -> Any:
        rid = f"r{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self._inflight += 1
        self.hooks.step(self._inflight)  # async driver: requests in flight when this one joins
        final = None
        try:
            async for out in self._async.generate({"prompt_token_ids": prompt}, sp, request_id=rid):
                final = out
        finally:
            self._inflight -= 1
        return final

    # ------------------------------------------------------------------------------------------------ generation

    def _sampling_params(self, o: SamplingOptions) -> Any:
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
            output_kind=RequestOutputKind.FINAL_ONLY,
            skip_special_tokens=True,
        )

    async def _generate(self, prompts: list[list[int]], params: SamplingOptions, version: int) -> list[PromptResult]:
        # vLLM refuses n > 1 with greedy decoding: send n requests of one sample each instead
        reps = params.n if params.greedy and params.n > 1 else 1
        sp = self._sampling_params(replace(params, n=1) if reps > 1 else params)
        flat = [p for p in prompts for _ in range(reps)]
        if self.mode == "inproc":
            outs = await self._submit_many(flat, sp)
        else:
            tasks = [asyncio.ensure_future(self._submit_async(p, sp)) for p in flat]
            try:
                outs = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                raise
        results = []
        for i, prompt in enumerate(prompts):
            samples = []
            group = outs[i * reps : (i + 1) * reps]
            completions = [c for out in group for c in sorted(out.outputs, key=lambda c: c.index)]
            for c in completions:
                ids = list(c.token_ids)
                lps = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [], strict=True)] if ids else []
                top = None
                if params.top_logprobs:  # each position's dict holds the sampled token and the top k by rank
                    top = [_top(d, params.top_logprobs) for d in (c.logprobs or [])]
                reason = c.finish_reason if c.finish_reason in ("stop", "length", "abort") else "length"
                samples.append(
                    Sample(
                        token_ids=ids,
                        logprobs=lps,
                        finish_reason=reason,
                        text=c.text,
                        policy_version=version,
                        stop_reason=c.stop_reason,
                        top_logprobs=top,
                    )
                )
            results.append(PromptResult(prompt_token_ids=list(prompt), samples=samples))
        return results

    # ------------------------------------------------------------------------------------------------ weights
    #
    # Weights go in through vLLM's weight-transfer API (init / start / update / finish, our backend of
    # services/rollout/vllm_transfer.py) wherever the worker has it, else through the worker extension's
    # reload_weights (vllm_ext.py). Which, and whether the transfer engine can stage an update while the model
    # generates, is asked of the worker once at start (``rlhf_features``): decided by feature, never by version.

    async def _rpc(self, method: str, *args: Any) -> Any:
        """One worker call (the first worker's answer)."""
        if self.mode == "inproc":
            return (await self._call(lambda llm: llm.collective_rpc(method, args=args)))[0]
        return (await self._async.collective_rpc(method, args=args))[0]

    async def _worker_features(self) -> dict[str, bool]:
        try:
            return dict(await self._rpc("rlhf_features"))
        except Exception as err:  # noqa: BLE001 - an older worker extension: the reload path only
            log.warning("the vLLM worker does not report its features (%s); loading through reload_weights", err)
            return {"weight_transfer": False, "engine_sessions": False, "reload_weights": True}

    async def _session(self, updates: list[dict], *, start: bool = True, finish: bool = True) -> None:
        """(``start``) start_weight_update, one update_weights per entry of ``updates``, then (``finish``)
        finish_weight_update and a prefix-cache reset: on the engine thread in one call in-process, else call by
        call."""
        if self.mode == "inproc":

            def run(llm: Any) -> None:  # generation waits meanwhile
                rpc = llm.collective_rpc
                try:
                    if start:
                        rpc("start_weight_update")
                except RuntimeError as err:
                    if "already active" not in str(err):
                        raise
                    for method, args in _END_UNCOMMITTED:
                        rpc(method, args=args)
                for u in updates:
                    rpc("update_weights", args=(u,))
                if finish:
                    rpc("finish_weight_update")
                    reset_prefix_cache(llm)

            await self._call(run)
            return
        rpc = self._async.collective_rpc
        try:
            if start:
                await rpc("start_weight_update")
        except Exception as err:  # noqa: BLE001 - as above, across the engine-core process
            if "already active" not in str(err):
                raise
            for method, args in _END_UNCOMMITTED:
                await rpc(method, args=args)
        for u in updates:
            await rpc("update_weights", args=(u,))
        if finish:
            await rpc("finish_weight_update")
            await areset_prefix_cache(self._async)

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
        import torch

        return torch.device(self.device_type)

    @property
    def collective_ranks(self) -> int:
        """How many ranks this replica joins a collective push's group with (reported at Open): one per vLLM worker
        (tensor x pipeline parallel, as the workers report it) when the workers receive the buckets, else one (this
        process receives, :meth:`receive_collective`)."""
        features = getattr(self, "_features", None) or {}
        if not features.get("engine_sessions"):
            return 1
        reported = features.get("parallel_world_size")
        if reported:
            return int(reported)
        kw = self.engine_kwargs  # a worker extension that does not report it: what the engine was built with
        return int(kw.get("tensor_parallel_size", 1) or 1) * int(kw.get("pipeline_parallel_size", 1) or 1)

    async def receive_collective(self, group: Any, ticket: bytes, header: Any, per_bucket: list) -> tuple[Any, int]:
        """A collective push received by vLLM's worker through vLLM's weight-transfer API (backend
        ``rlhf_collective``): join the push's group (gloo, or nccl/hccl on the worker's own device), start an update,
        one ``update_weights`` per bucket (received, verified and staged in the worker's host memory; the model
        untouched). :meth:`_load_weights` finishes it at the commit. A worker that loads every update into the model
        as it arrives (no engine sessions: vLLM 0.23) cannot receive while the model generates: the buckets then come
        into this process, and the commit hands them over."""
        from rlhf.transport.weights.collective import GROUP_ERRORS
        from rlhf.transport.weights.errors import IncompleteUpdate
        from rlhf.transport.weights.receive import StagedInEngine

        if not self._features.get("engine_sessions"):
            return await super().receive_collective(group, ticket, header, per_bucket)
        init = {
            "address": group.address,
            "port": group.port,
            "key": group.key,
            "timeout_s": group.timeout_s,
            "ticket": ticket.hex(),
            "backend": group.backend,
        }
        buckets = [
            {
                "index": i,
                "nbytes": b.nbytes,
                "sha256": b.sha256,
                "tensors": [[name, dt, list(shape)] for name, (dt, shape) in per_bucket[i].items()],
            }
            for i, b in enumerate(header.buckets)
        ]
        try:
            await self._rpc("init_weight_transfer_engine", init)
            await self._session(buckets, finish=False)
        except GROUP_ERRORS as err:
            raise IncompleteUpdate(
                f"the collective transfer into vLLM failed ({type(err).__name__}: {err}); nothing was installed"
            ) from None
        return StagedInEngine.fromkeys(t.name for t in header.tensors), header.total_bytes

    async def swap_weights(self, *args: Any, **kwargs: Any) -> Any:
        if not self.staged_swap:
            return await super().swap_weights(*args, **kwargs)
        async with self._stage_lock:  # the shadow holds one update: staging and swap of the next wait for this one
            return await super().swap_weights(*args, **kwargs)

    async def _prepare_weights(self, tensors: dict[str, Any]) -> Any:
        if self.staged_swap:
            return await self._stage_in_shadow(tensors)
        if getattr(tensors, "in_engine", False):  # already in the worker (receive_collective)
            return tensors
        # Outside the gate, while the old weights still serve: the update in parts of at most load_bucket_bytes, one
        # worker call each. In-process the parts are the tensors themselves (nothing crosses a process); the
        # engine-core subprocess gets one safetensors file per part (vLLM's RPC carries bytes intact, tensors nested
        # in an update's fields it does not).
        groups = _groups(tensors, self.load_bucket_bytes)
        if self.mode == "inproc":
            return _Parts(groups)
        return _Parts([await asyncio.to_thread(_safetensors_bytes, dict(g)) for g in groups])

    def _part_info(self, index: int, part: Any) -> dict:
        """One update_weights call of the rlhf_collective backend: a part the service holds, loaded at once."""
        info: dict[str, Any] = {"index": index, "nbytes": 0, "sha256": ""}
        if isinstance(part, list):
            info["items"] = part
        else:
            info["data"] = part
        return info

    async def _stage_in_shadow(self, tensors: Any) -> _Shadowed:
        """Load the update into the worker's shadow model while the live one generates (vllm_shadow.py), one part
        of at most load_bucket_bytes per call; wait until it is loaded. A failure leaves the live model as it was."""
        await self._shadow_idle()  # a staging left running by a cancelled push ends first
        uid = uuid.uuid4().hex
        in_engine = bool(getattr(tensors, "in_engine", False))
        state: dict = {}
        if in_engine:  # what the worker received itself (a collective push): staged there in one go
            await self._rpc("rlhf_shadow_stage_transfer", uid)
        else:
            steps: list[tuple[str, Any]] = [("rlhf_shadow_begin", None)]
            steps += [("rlhf_shadow_add", g) for g in _groups(tensors, self.load_bucket_bytes)]
            del tensors
            for method, group in [*steps, ("rlhf_shadow_end", None)]:
                args: tuple = (uid,)
                if group is not None and self.mode == "inproc":  # the tensors themselves: nothing is serialised
                    method, args = "rlhf_shadow_add_tensors", (uid, group)
                elif group is not None:  # serialised one part at a time: one part's copy at most
                    args = (uid, await asyncio.to_thread(_safetensors_bytes, dict(group)))
                await self._rpc(method, *args)
                del group, args
                state = await self._shadow_idle()  # one part in the worker at a time
                if state["error"]:
                    break
            steps.clear()
        state = await self._shadow_idle()
        if state["error"] or state["staged"] != uid:
            raise Internal(
                f"the update could not be staged beside the live weights ({state['error']}); nothing was installed"
            )
        return _Shadowed(uid, in_engine, float(state["seconds"]))

    async def _shadow_idle(self) -> dict:
        """Poll the worker (between engine steps) until no update is loading into its shadow; its last state."""
        while True:
            state = await self._rpc("rlhf_shadow_poll")
            if state["done"]:
                return state
            await asyncio.sleep(0.005)

    async def _load_weights(self, staged: Any) -> None:
        if isinstance(staged, _Shadowed):  # loaded beside the live model: swap the two between two steps
            await self._swap_shadow(staged)
            return
        # Installing rewrites the serving model's parameters in place (checkpoint loader, then the CPU backend's
        # repacking): it cannot run while the model generates, so it stays inside the gate.
        if getattr(staged, "in_engine", False):  # staged in the worker by receive_collective: install it
            await self._session([], start=False)
            self.load_path = "weight_transfer"
            log.info("vLLM weights installed through the weight-transfer API (%d tensors)", len(staged))
            return
        parts = staged.parts
        if self._features.get("weight_transfer"):  # one update_weights per part, loaded as it comes
            await self._session([self._part_info(i, p) for i, p in enumerate(parts)])
            self.load_path = "weight_transfer"
            log.info("vLLM weights loaded through the weight-transfer API (%d parts)", len(parts))
            return
        # A worker without the API: the worker extension gathers the parts and reloads them in one reload_weights
        if self.mode == "inproc":

            def _reload(llm: Any) -> Any:
                rpc = llm.collective_rpc
                rpc("rlhf_load_begin")
                for p in parts:
                    rpc("rlhf_load_part_tensors", args=(p,))
                r = rpc("rlhf_load_end")
                reset_prefix_cache(llm)
                return r

            info = await self._call(_reload)
        else:
            rpc = self._async.collective_rpc
            await rpc("rlhf_load_begin")
            for p in parts:
                await rpc("rlhf_load_part", args=(p,))
            info = await rpc("rlhf_load_end")
            await areset_prefix_cache(self._async)
        self.load_path = "reload"
        log.info("vLLM weights reloaded: %s", info)

    # ---- updates installed as they arrive (EngineBase.install_streamed): in place, one update_weights per bucket

    def streams_update(self, total_bytes: int) -> bool:
        return (
            self.inplace_load_bytes is not None
            and total_bytes >= self.inplace_load_bytes
            and bool(self._features.get("weight_transfer"))  # incremental update_weights into the live model
        )

    async def install_streamed(self, header: Any, buckets: Any) -> Any:
        if not self.staged_swap:
            return await super().install_streamed(header, buckets)
        async with self._stage_lock:  # after any update still loading into the shadow
            return await super().install_streamed(header, buckets)

    async def _stream_begin(self, header: Any) -> None:
        log.info(
            "weight update %d (%.2f GB, %d buckets, %s=%s): loading into the serving model bucket by bucket as "
            "it arrives; generation paused until it is complete",
            header.version,
            header.total_bytes / 1e9,
            len(header.buckets),
            INPLACE_ENV,
            self.inplace_load_bytes,
        )
        if self.staged_swap:  # its second copy of the weights is what this path avoids: give it back
            await self._rpc("rlhf_shadow_drop")
        await self._session([], finish=False)

    async def _stream_bucket(self, bucket: Any) -> None:
        if self.mode == "inproc":  # the verified bucket's tensors, views into the received buffer: no copy
            info = {"index": bucket.index, "nbytes": 0, "sha256": "", "items": list(bucket.tensors.items())}
        else:
            info = {"index": bucket.index, "nbytes": 0, "sha256": "", "data": bucket.data}
        await self._session([info], start=False, finish=False)

    async def _stream_end(self) -> None:
        await self._session([], start=False)
        self.load_path = "inplace_streamed"

    async def _stream_abort(self) -> None:
        # finish_weight_update ends the layer-wise load (layers that got nothing get their old tensors back) so the
        # model runs again; a worker whose update_weights raised has closed the session itself: open and end one
        try:
            await self._session([], start=False)
        except Exception:  # noqa: BLE001 - "without a matching start_weight_update"
            await self._session([])

    async def _swap_shadow(self, staged: _Shadowed) -> None:
        if self.mode == "inproc":

            def _swap(llm: Any) -> Any:
                r = llm.collective_rpc("rlhf_shadow_swap", args=(staged.update_id,))
                if staged.in_engine:  # end the collective session: its buckets went to the shadow, nothing to install
                    llm.collective_rpc("finish_weight_update")
                reset_prefix_cache(llm)
                return r[0]

            info = await self._call(_swap)
        else:
            info = (await self._async.collective_rpc("rlhf_shadow_swap", args=(staged.update_id,)))[0]
            if staged.in_engine:
                await self._async.collective_rpc("finish_weight_update")
            await areset_prefix_cache(self._async)
        self.load_path = "staged_swap"
        log.info(
            "vLLM weights swapped in (staged beside the live model in %.3fs, swap %.4fs)",
            staged.seconds,
            info["seconds"],
        )


@dataclass
class _Parts:
    """An update received whole, in parts of at most load_bucket_bytes: (name, tensor) lists in-process, safetensors
    bytes for the engine-core subprocess. Loaded one worker call per part inside the gate."""

    parts: list


@dataclass
class _Shadowed:
    """An update loaded into the worker's shadow model, waiting for its swap."""

    update_id: str
    in_engine: bool
    seconds: float
