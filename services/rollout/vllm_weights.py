"""How weight updates go into the ``vllm`` engine's worker: :class:`VllmWeights`, a part that
:class:`services.rollout.vllm_engine.VllmEngine` holds (``engine.weights``).

Parts of at most ``load_bucket_bytes`` go through vLLM's weight-transfer API (:mod:`services.rollout.vllm_transfer`),
into a staged swap's shadow (:mod:`services.rollout.vllm_shadow`) or through the worker extension
(:mod:`services.rollout.vllm_ext`); large updates are installed as they arrive, and a collective push is received by
the worker itself (:meth:`VllmWeights.receive_collective`). Design: docs/weight-sync.md#the-update and
docs/weight-sync.md#large-updates-installed-as-they-arrive-vllm.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rlhf.serving.errors import Internal

log = logging.getLogger("rlhf.rollout.vllm")  # the engine's logger: one log for the engine and its weight paths


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
    from rlhf.transport.weights.pack import plan_sizes

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


class VllmDriver(Protocol):
    """What the weight path uses of the driver it runs on (:class:`~services.rollout.vllm_engine.VllmEngine`)."""

    mode: str  # "inproc": vLLM's LLMEngine on the engine thread; "async": AsyncLLM, its engine core a subprocess
    engine_kwargs: dict[str, Any]  # what vLLM's engine is built with
    _async: Any  # the AsyncLLM (async mode, once started)

    @property
    def device_type(self) -> str: ...

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(llm)`` on the engine thread, between two steps (inproc)."""
        ...

    async def _rpc(self, method: str, *args: Any) -> Any:
        """One worker call; the first worker's answer."""
        ...


class VllmWeights:
    """The whole-model weight path of :class:`~services.rollout.vllm_engine.VllmEngine`, a part the engine holds
    (``engine.weights``): how an update goes into vLLM's worker (staged, installed, or streamed in as it arrives), the
    worker sessions behind it, and its settings and state. The engine's weight hooks of
    :class:`~services.rollout.engine.EngineBase` call it; the swap gate and the served version stay the engine's.

    ``staged_swap``, ``inplace_load_bytes`` and ``load_bucket_bytes``: the engine's ``__init__`` arguments of the same
    names."""

    def __init__(
        self, driver: VllmDriver, *, staged_swap: bool | None, inplace_load_bytes: int | None, load_bucket_bytes: int
    ):
        self._driver = driver
        self.features: dict[str, bool] = {}  # what the worker offers (rlhf_features), asked at start
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

    async def start(self) -> None:
        """Once the driver runs: what the worker offers, and so whether updates are staged."""
        self.features = await self._worker_features()
        self.staged_swap = self.decide_staged_swap()

    # ------------------------------------------------------------------------------------------------ weights
    #
    # Weights go in through vLLM's weight-transfer API (init / start / update / finish, our backend of
    # services/rollout/vllm_transfer.py) wherever the worker has it, else through the worker extension's
    # reload_weights (vllm_ext.py). Which, and whether the transfer engine can stage an update while the model
    # generates, is asked of the worker once at start (``rlhf_features``): decided by feature, never by version.

    async def _worker_features(self) -> dict[str, bool]:
        try:
            return dict(await self._driver._rpc("rlhf_features"))
        except Exception as err:  # noqa: BLE001 - an older worker extension: the reload path only
            log.warning("the vLLM worker does not report its features (%s); loading through reload_weights", err)
            return {"weight_transfer": False, "engine_sessions": False, "reload_weights": True}

    async def _session(self, updates: list[dict], *, start: bool = True, finish: bool = True) -> None:
        """(``start``) start_weight_update, one update_weights per entry of ``updates``, then (``finish``)
        finish_weight_update and a prefix-cache reset: on the engine thread in one call in-process, else call by
        call."""
        if self._driver.mode == "inproc":

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

            await self._driver._call(run)
            return
        rpc = self._driver._async.collective_rpc
        try:
            if start:
                await rpc("start_weight_update")
        except Exception as err:  # as above, across the engine-core process
            if "already active" not in str(err):
                raise
            for method, args in _END_UNCOMMITTED:
                await rpc(method, args=args)
        for u in updates:
            await rpc("update_weights", args=(u,))
        if finish:
            await rpc("finish_weight_update")
            await areset_prefix_cache(self._driver._async)

    def decide_staged_swap(self) -> bool:
        """Whether updates are staged beside the live model: the setting, and what the worker can do."""
        want = self.staged_swap_setting
        if want is False:
            return False
        if not self.features.get("staged_swap"):
            why = self.features.get("staged_swap_unsupported") or "the worker extension is older"
            if want:
                raise ValueError(f"actor_rollout.staged_weight_swap is on but this vLLM worker cannot stage: {why}")
            log.info("weight updates load inside the swap gate (no staged swap: %s)", why)
            return False
        return bool(want) or self._driver.device_type == "cpu"

    @property
    def receives_collective(self) -> bool:
        """Whether vLLM's worker receives a collective push itself (:meth:`receive_collective`); else the buckets
        come into this process (EngineBase.receive_collective) and the commit hands them over."""
        return bool(self.features.get("engine_sessions"))

    @property
    def collective_ranks(self) -> int:
        """How many ranks this replica joins a collective push's group with (reported at Open): one per vLLM worker
        (tensor x pipeline parallel, as the workers report it) when the workers receive the buckets, else one (this
        process receives)."""
        if not self.receives_collective:
            return 1
        reported = self.features.get("parallel_world_size")
        if reported:
            return int(reported)
        kw = self._driver.engine_kwargs  # a worker extension that does not report it: what the engine was built with
        return int(kw.get("tensor_parallel_size", 1) or 1) * int(kw.get("pipeline_parallel_size", 1) or 1)

    async def receive_collective(self, group: Any, ticket: bytes, header: Any, per_bucket: list) -> tuple[Any, int]:
        """A collective push received by vLLM's worker through vLLM's weight-transfer API (backend
        ``rlhf_collective``): join the push's group (gloo, or nccl/hccl on the worker's own device), start an update,
        one ``update_weights`` per bucket (received, verified and staged in the worker's host memory; the model
        untouched). :meth:`load` finishes it at the commit. Only where :attr:`receives_collective` (a worker without
        engine sessions, vLLM 0.23, loads every update into the model as it arrives: it cannot receive while the model
        generates)."""
        from rlhf.transport.weights.collective import GROUP_ERRORS
        from rlhf.transport.weights.errors import IncompleteUpdate
        from rlhf.transport.weights.receive import StagedInEngine

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
                "device_digest": b.device_digest,  # an nccl/hccl push's: checked on the worker's device
                "tensors": [[name, dt, list(shape)] for name, (dt, shape) in per_bucket[i].items()],
            }
            for i, b in enumerate(header.buckets)
        ]
        try:
            await self._driver._rpc("init_weight_transfer_engine", init)
            await self._session(buckets, finish=False)
        except GROUP_ERRORS as err:
            raise IncompleteUpdate(
                f"the collective transfer into vLLM failed ({type(err).__name__}: {err}); nothing was installed"
            ) from None
        return StagedInEngine.fromkeys(t.name for t in header.tensors), header.total_bytes

    def update_lock(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """Held around a whole swap or streamed install: with the staged swap on, the shadow holds one update, so the
        staging and swap of the next wait for this one; else nothing to wait for."""
        return self._stage_lock if self.staged_swap else contextlib.nullcontext()

    async def prepare(self, tensors: dict[str, Any]) -> Any:
        """EngineBase's ``_prepare_weights``: stage an update while the old weights serve."""
        if self.staged_swap:
            return await self._stage_in_shadow(tensors)
        if getattr(tensors, "in_engine", False):  # already in the worker (receive_collective)
            return tensors
        # Outside the gate, while the old weights still serve: the update in parts of at most load_bucket_bytes, one
        # worker call each. In-process the parts are the tensors themselves (nothing crosses a process); the
        # engine-core subprocess gets one safetensors file per part (vLLM's RPC carries bytes intact, tensors nested
        # in an update's fields it does not).
        groups = _groups(tensors, self.load_bucket_bytes)
        if self._driver.mode == "inproc":
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
            await self._driver._rpc("rlhf_shadow_stage_transfer", uid)
        else:
            steps: list[tuple[str, Any]] = [("rlhf_shadow_begin", None)]
            steps += [("rlhf_shadow_add", g) for g in _groups(tensors, self.load_bucket_bytes)]
            del tensors
            for method, group in [*steps, ("rlhf_shadow_end", None)]:
                args: tuple = (uid,)
                if group is not None and self._driver.mode == "inproc":  # the tensors themselves: nothing is serialised
                    method, args = "rlhf_shadow_add_tensors", (uid, group)
                elif group is not None:  # serialised one part at a time: one part's copy at most
                    args = (uid, await asyncio.to_thread(_safetensors_bytes, dict(group)))
                await self._driver._rpc(method, *args)
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
            state = await self._driver._rpc("rlhf_shadow_poll")
            if state["done"]:
                return state
            await asyncio.sleep(0.005)

    async def load(self, staged: Any) -> None:
        """EngineBase's ``_load_weights``: install what :meth:`prepare` staged (inside the gate)."""
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
        if self.features.get("weight_transfer"):  # one update_weights per part, loaded as it comes
            await self._session([self._part_info(i, p) for i, p in enumerate(parts)])
            self.load_path = "weight_transfer"
            log.info("vLLM weights loaded through the weight-transfer API (%d parts)", len(parts))
            return
        # A worker without the API: the worker extension gathers the parts and reloads them in one reload_weights
        if self._driver.mode == "inproc":

            def _reload(llm: Any) -> Any:
                rpc = llm.collective_rpc
                rpc("rlhf_load_begin")
                for p in parts:
                    rpc("rlhf_load_part_tensors", args=(p,))
                r = rpc("rlhf_load_end")
                reset_prefix_cache(llm)
                return r

            info = await self._driver._call(_reload)
        else:
            rpc = self._driver._async.collective_rpc
            await rpc("rlhf_load_begin")
            for p in parts:
                await rpc("rlhf_load_part", args=(p,))
            info = await rpc("rlhf_load_end")
            await areset_prefix_cache(self._driver._async)
        self.load_path = "reload"
        log.info("vLLM weights reloaded: %s", info)

    # ---- updates installed as they arrive (EngineBase.install_streamed): in place, one update_weights per bucket

    def streams_update(self, total_bytes: int) -> bool:
        return (
            self.inplace_load_bytes is not None
            and total_bytes >= self.inplace_load_bytes
            and bool(self.features.get("weight_transfer"))  # incremental update_weights into the live model
        )

    async def stream_begin(self, header: Any) -> None:
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
            await self._driver._rpc("rlhf_shadow_drop")
        await self._session([], finish=False)

    async def stream_bucket(self, bucket: Any) -> None:
        if self._driver.mode == "inproc":  # the verified bucket's tensors, views into the received buffer: no copy
            info = {"index": bucket.index, "nbytes": 0, "sha256": "", "items": list(bucket.tensors.items())}
        else:
            info = {"index": bucket.index, "nbytes": 0, "sha256": "", "data": bucket.data}
        await self._session([info], start=False, finish=False)

    async def stream_end(self) -> None:
        await self._session([], start=False)
        self.load_path = "inplace_streamed"

    async def stream_abort(self) -> None:
        # finish_weight_update ends the layer-wise load (layers that got nothing get their old tensors back) so the
        # model runs again; a worker whose update_weights raised has closed the session itself: open and end one
        try:
            await self._session([], start=False)
        except Exception:  # noqa: BLE001 - "without a matching start_weight_update"
            await self._session([])

    async def _swap_shadow(self, staged: _Shadowed) -> None:
        if self._driver.mode == "inproc":

            def _swap(llm: Any) -> Any:
                r = llm.collective_rpc("rlhf_shadow_swap", args=(staged.update_id,))
                if staged.in_engine:  # end the collective session: its buckets went to the shadow, nothing to install
                    llm.collective_rpc("finish_weight_update")
                reset_prefix_cache(llm)
                return r[0]

            info = await self._driver._call(_swap)
        else:
            llm = self._driver._async
            info = (await llm.collective_rpc("rlhf_shadow_swap", args=(staged.update_id,)))[0]
            if staged.in_engine:
                await llm.collective_rpc("finish_weight_update")
            await areset_prefix_cache(llm)
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
