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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf.config_rules import VLLM_LORA_RANKS
from rlhf.lora import adapter_manifest, write_adapter
from rlhf.serving.errors import Internal
from services.rollout.engine_types import SwapResult
from services.rollout.swap import check_state_dict

if TYPE_CHECKING:  # pragma: no cover
    from rlhf.transport.weights.version import ServedVersion

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
        from vllm.lora.request import LoRARequest  # noqa: PLC0415 - optional dependency (the vllm extra)

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
    """The adapter path of :class:`~services.rollout.vllm_engine.VllmEngine`, a part the engine makes at start when
    it serves adapters (``engine.adapters``; None: pushes are whole models): every push is an adapter, checked
    against :attr:`manifest` (the base checkpoint's, narrowed to the adapter's names and shapes), written to a
    private folder and loaded by vLLM. The engine routes its swaps and its generations' adapters here.

    ``served``: the engine's served version, which an adapter swap checks and advances; ``lora_call(method, arg)``:
    vLLM's ``add_lora`` / ``remove_lora`` on the engine's driver; ``serving_again``: called once a swap is in (a
    replica that waited for a complete update serves again)."""

    def __init__(
        self,
        spec: LoraSpec,
        base_path: Path,
        base_manifest: dict[str, tuple[int, ...]],
        *,
        served: ServedVersion,
        lora_call: Callable[[str, Any], Awaitable[Any]],
        serving_again: Callable[[], None],
    ):
        self.manifest = adapter_manifest(base_manifest, spec.r, list(spec.target_modules))
        self.slots = AdapterSlots(spec, str(base_path))
        self._served = served
        self._lora_call = lora_call
        self._serving_again = serving_again
        self._lock = asyncio.Lock()

    async def swap(
        self, tensors: dict[str, Any], version: int, checksum: str, parent_version: int | None = None
    ) -> SwapResult:
        """The engine's ``swap_weights`` for an adapter push: no pause (see the module docstring)."""
        parent = version - 1 if parent_version is None else parent_version
        async with self._lock:  # one adapter swap at a time; generation goes on throughout
            self._served.check(version, parent)
            check_state_dict(tensors, self.manifest)
            t0 = time.perf_counter()
            request = await asyncio.to_thread(self.slots.write, tensors, version)
            del tensors
            try:
                await self._lora_call("add_lora", request)  # loaded now, not by the first request that needs it
            except Exception as err:
                self.slots.remove_folder(request)
                what = f"{type(err).__name__}: {err}"
                raise Internal(f"vLLM could not load the adapter of version {version} ({what})") from err
            t1 = time.perf_counter()
            unload = self.slots.switch(version, request)
            self._served.advance(version, parent, checksum)
            self._serving_again()
        log.info(
            "serving the LoRA adapter of weights version %d (%d tensors, %.1f KiB written in %.3f s)",
            version,
            len(self.manifest),
            sum(f.stat().st_size for f in Path(request.lora_path).iterdir()) / 1024,
            t1 - t0,
        )
        for old in unload:
            await self._unload(old)
        return SwapResult(
            version=version,
            checksum=checksum,
            swapped=True,
            wait_seconds=0.0,
            swap_seconds=0.0,
            prepare_seconds=t1 - t0,
        )

    def acquire(self, version: int) -> Any:
        """The adapter request a generation admitted under ``version`` runs on (None: the base), held until
        :meth:`release`."""
        return self.slots.acquire(version)

    async def release(self, version: int) -> None:
        """A generation on ``version`` finished: unload the adapters no request needs any more."""
        for done in self.slots.release(version):
            await self._unload(done)

    async def _unload(self, request: Any) -> None:
        """Drop an adapter whose last request has finished, from the engine and from disk. A failure only costs
        memory (vLLM evicts least recently used adapters past max_cpu_loras), so it is logged, not raised."""
        try:
            await self._lora_call("remove_lora", request.lora_int_id)
            log.info("unloaded the adapter of weights version %d (its requests are done)", request.lora_int_id)
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.warning("unloading the adapter %s failed: %s", request.lora_name, err)
        self.slots.remove_folder(request)

    def close(self) -> None:
        self.slots.close()
