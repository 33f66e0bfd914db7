"""Adapter-only weight sync into vLLM (``actor_rollout.lora_sync: adapter``): each push of a LoRA actor is the
adapter's tensors alone, which this replica writes as a PEFT adapter folder and serves as a vLLM LoRA adapter whose
id is the policy version.

Unlike a full push, an adapter swap needs no pause: a request is bound to the adapter of the version it was admitted
under and finishes on it, requests admitted after the swap get the new one, and an old adapter is unloaded from the
engine (and its folder deleted) once its last request has finished. Version 0 is the base model (no adapter): PEFT
starts B at zero, so the untrained adapter is the base.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.config_rules import VLLM_LORA_RANKS
from rlhf.lora import adapter_manifest, write_adapter
from rlhf.serving.errors import Internal
from services.rollout.engine import EngineBase
from services.rollout.engine_types import SwapResult
from services.rollout.swap import check_state_dict

log = logging.getLogger("rlhf.rollout.vllm")


@dataclass(frozen=True)
class LoraSpec:
    """The adapter every push carries (``actor_rollout.lora_r``, ``lora_alpha``, ``lora_target_modules``)."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]

    @property
    def max_lora_rank(self) -> int:
        """The vLLM engine's ``max_lora_rank``: the smallest of vLLM's choices that holds ``r``."""
        for rank in VLLM_LORA_RANKS:
            if rank >= self.r:
                return rank
        raise ValueError(f"actor_rollout.lora_r {self.r}: vLLM serves adapters of rank at most {VLLM_LORA_RANKS[-1]}")

    def engine_args(self) -> dict[str, Any]:
        # Two adapters at once: the current one and the one its predecessor's requests still finish on.
        return {"enable_lora": True, "max_lora_rank": self.max_lora_rank, "max_loras": 2, "max_cpu_loras": 4}


class AdapterSlots:
    """Which adapter each policy version is served with, and how many requests use it (refcounts decide when an
    old adapter can go). Not thread-safe: used on the service's event loop only, with no await inside a method."""

    def __init__(self, spec: LoraSpec, base: str):
        self.spec, self.base = spec, base
        self.root = Path(tempfile.mkdtemp(prefix="rlhf-lora-"))
        self.current: int = 0
        self._requests: dict[int, Any] = {}  # version -> LoRARequest (version 0, the base, has none)
        self._users: dict[int, int] = {}

    def write(self, tensors: dict[str, Any], version: int) -> Any:
        """The adapter folder of ``version`` and its vLLM request (run in a thread: it writes a file)."""
        from vllm.lora.request import LoRARequest

        folder = self.root / f"v{version}"
        if folder.exists():  # a retried push of the same version: written afresh
            shutil.rmtree(folder)
        write_adapter(folder, tensors, self.spec.r, self.spec.alpha, list(self.spec.target_modules), self.base)
        # lora_int_id must be >= 1 and unique per adapter: versions of a push are >= 1 and never reused
        return LoRARequest(f"policy-v{version}", version, str(folder))

    def acquire(self, version: int) -> Any:
        """The adapter request for a generation admitted under ``version`` (None: the base), counted as in use."""
        self._users[version] = self._users.get(version, 0) + 1
        return self._requests.get(version)

    def release(self, version: int) -> list[Any]:
        """A generation on ``version`` finished; the adapters to unload now (an old one's last request ended)."""
        self._users[version] -= 1
        return self._collect()

    def switch(self, version: int, request: Any) -> list[Any]:
        """Serve ``version`` with ``request`` from now on; the adapters to unload now (old and unused)."""
        self._requests[version] = request
        self.current = version
        return self._collect()

    def _collect(self) -> list[Any]:
        gone = [v for v in self._requests if v != self.current and not self._users.get(v)]
        out = []
        for v in gone:
            out.append(self._requests.pop(v))
            self._users.pop(v, None)
        return out

    @property
    def loaded(self) -> list[int]:
        """The versions whose adapters are held (the current one and those still finishing requests)."""
        return sorted(self._requests)

    def remove_folder(self, request: Any) -> None:
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class VllmAdapters:
    """The adapter path of :class:`~services.rollout.vllm_engine.VllmEngine` (listed first in its bases): its
    overrides of the weight hooks when the engine serves adapters (``_slots`` set at start), else the full-model
    paths of :class:`~services.rollout.vllm_weights.VllmWeights`. Its state comes from :meth:`_init_adapters` and
    :meth:`_start_adapters`, which the driver calls; the driver provides ``mode``, ``_call`` and ``_async``, and
    EngineBase ``served``, ``model_path`` and ``_manifest``."""

    _slots: AdapterSlots | None
    _adapter_lock: asyncio.Lock

    def _init_adapters(self, lora: LoraSpec | None) -> None:
        """The adapter path's state, from the engine's ``lora`` argument (None: full-model pushes)."""
        self.lora = lora
        self._slots = None  # made at start (_start_adapters), once the checkpoint's manifest is read
        self._adapter_lock = asyncio.Lock()

    def _start_adapters(self) -> None:
        """At start, after the checkpoint's manifest is read: a push is the adapter, checked against its names and
        shapes, and its folders go in a private directory."""
        if self.lora is not None:
            self._manifest = adapter_manifest(self._manifest, self.lora.r, list(self.lora.target_modules))
            self._slots = AdapterSlots(self.lora, str(self.model_path))

    async def swap_weights(
        self, tensors: dict[str, Any], version: int, checksum: str, parent_version: int | None = None
    ) -> SwapResult:
        if self._slots is None:
            return await super().swap_weights(tensors, version, checksum, parent_version)
        parent = version - 1 if parent_version is None else parent_version
        async with self._adapter_lock:  # one adapter swap at a time; generation goes on throughout
            self.served.check(version, parent)
            check_state_dict(tensors, self._manifest)
            t0 = time.perf_counter()
            request = await asyncio.to_thread(self._slots.write, tensors, version)
            del tensors
            try:
                await self._engine_lora("add_lora", request)  # loaded now, not by the first request that needs it
            except Exception as err:
                self._slots.remove_folder(request)
                what = f"{type(err).__name__}: {err}"
                raise Internal(f"vLLM could not load the adapter of version {version} ({what})") from err
            t1 = time.perf_counter()
            unload = self._slots.switch(version, request)
            self.served.advance(version, parent, checksum)
            self._serving_again()
        log.info(
            "serving the LoRA adapter of weights version %d (%d tensors, %.1f KiB written in %.3f s)",
            version,
            len(self._manifest),
            sum(f.stat().st_size for f in Path(request.lora_path).iterdir()) / 1024,
            t1 - t0,
        )
        for old in unload:
            await self._unload_adapter(old)
        return SwapResult(
            version=version,
            checksum=checksum,
            swapped=True,
            wait_seconds=0.0,
            swap_seconds=0.0,
            prepare_seconds=t1 - t0,
        )

    @property
    def collective_ranks(self) -> int:
        # an adapter's collective push is received by this process alone, whatever vLLM's worker count
        return 1 if self._slots is not None else super().collective_ranks

    def streams_update(self, total_bytes: int) -> bool:
        return False if self._slots is not None else super().streams_update(total_bytes)

    async def receive_collective(self, group: Any, ticket: bytes, header: Any, per_bucket: list) -> tuple[Any, int]:
        if self._slots is None:
            return await super().receive_collective(group, ticket, header, per_bucket)
        # vLLM reads an adapter from its folder: the buckets come into this process (on the device for nccl/hccl)
        return await EngineBase.receive_collective(self, group, ticket, header, per_bucket)

    async def _engine_lora(self, method: str, arg: Any) -> Any:
        if self.mode == "inproc":
            return await self._call(lambda llm: getattr(llm, method)(arg))
        return await getattr(self._async, method)(arg)

    async def _unload_adapter(self, request: Any) -> None:
        """Drop an adapter whose last request has finished, from the engine and from disk. A failure only costs
        memory (vLLM evicts least recently used adapters past max_cpu_loras), so it is logged, not raised."""
        try:
            await self._engine_lora("remove_lora", request.lora_int_id)
            log.info("unloaded the adapter of weights version %d (its requests are done)", request.lora_int_id)
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.warning("unloading the adapter %s failed: %s", request.lora_name, err)
        self._slots.remove_folder(request)
