"""Named adapters beside the policy on the ``vllm`` engine (``LoadAdapter``; a request names one in ``adapter``): each
is a PEFT adapter folder loaded as a vLLM ``LoRARequest`` of its own (LoRA on ``lm_head`` too: vLLM's
``LogitsProcessorWithLoRA``), held in the same store as the hf engine's (:class:`AdapterStore`: pinned while
requests use it, the least recently used evicted past ``RLHF_ROLLOUT_MAX_ADAPTERS``, then removed from vLLM and
from disk). On only when ``RLHF_ROLLOUT_MAX_ADAPTERS`` is set for a vLLM replica: it turns on vLLM's LoRA
(``enable_lora``), whose CPU kernels slow every decoded token. Design: docs/tinker.md (Sampling through the fleet).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlhf.lora import adapter_manifest, write_adapter
from rlhf.serving.errors import InvalidArgument
from services.rollout.hf_adapters import NAME_RE, AdapterStore

log = logging.getLogger("rlhf.rollout.vllm")

ID_BASE = 1 << 30  # named adapters' LoRA ids: above any policy version's (those are the versions)
DEFAULT_MAX_RANK = 64


@dataclass
class NamedLora:
    name: str
    request: Any  # vllm LoRARequest
    pins: int = 0


class VllmNamedAdapters:
    """The named adapters of one vLLM engine. ``manifest``: the checkpoint's tensor names and shapes (what an
    adapter is checked against); ``lora_call(method, arg)``: vLLM's ``add_lora`` / ``remove_lora``."""

    def __init__(
        self,
        max_adapters: int,
        max_rank: int,
        manifest: dict[str, tuple[int, ...]],
        base: str,
        lora_call: Callable[[str, Any], Awaitable[Any]],
    ):
        self.max_rank = max_rank
        self.store = AdapterStore(max_adapters, on_evict=self._evicted)
        self._manifest, self._base, self._lora_call = manifest, base, lora_call
        self._ids = itertools.count(ID_BASE)
        self.root = Path(tempfile.mkdtemp(prefix="rlhf-named-lora-"))
        self._unloading: set[asyncio.Task] = set()

    @staticmethod
    def engine_args(max_adapters: int, max_rank: int, policy_slots: int) -> dict[str, Any]:
        # Two slots more than ever hold adapters (the held ones, the policy's, one being unloaded): vLLM 0.32's CPU
        # LoRA ops index the slot tensors with a row's LoRA index, and a row without LoRA (-1) reads the LAST slot:
        # with every slot filled, the policy's requests were sampled with an adapter (tests/integration/
        # test_vllm_named_adapters.py). Empty slots are zeros, so the last one must stay empty.
        slots = max_adapters + policy_slots + 2
        return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": slots, "max_cpu_loras": slots}

    async def load(self, name: str, tensors: dict[str, Any], config: dict[str, Any]) -> list[str]:
        r, alpha, targets = self._check(name, tensors, config)
        from vllm.lora.request import LoRARequest  # noqa: PLC0415 - optional dependency (the vllm extra)

        lora_id = next(self._ids)
        folder = self.root / f"{lora_id}"
        await asyncio.to_thread(write_adapter, folder, tensors, r, alpha, targets, self._base)
        request = LoRARequest(f"named-{name}", lora_id, str(folder))
        try:
            await self._lora_call("add_lora", request)
        except Exception as err:  # noqa: BLE001 - vLLM's loader raises many kinds; the client gets the reason
            shutil.rmtree(folder, ignore_errors=True)
            raise InvalidArgument(f"vLLM refused adapter {name!r}: {err}", field="adapter_safetensors") from None
        held = self.store.put(NamedLora(name, request))
        log.info("vLLM engine: adapter %s loaded (LoRA id %d); holding %d", name, lora_id, len(held))
        return held

    def _check(self, name: str, tensors: dict[str, Any], config: dict[str, Any]) -> tuple[int, float, list[str]]:
        """The adapter's names and shapes against the checkpoint's (as an adapter push is checked)."""
        if not NAME_RE.match(name or ""):
            raise InvalidArgument(f"adapter name {name!r}: 1-128 characters of A-Z a-z 0-9 . _ : @ -", field="name")
        for key in ("use_dora", "use_rslora", "fan_in_fan_out", "modules_to_save"):
            if config.get(key):
                raise InvalidArgument(f"{key} adapters are not served by the vllm engine", field="adapter_config_json")
        try:
            r, alpha, targets = int(config["r"]), float(config["lora_alpha"]), list(config["target_modules"])
        except (KeyError, TypeError, ValueError):
            raise InvalidArgument(
                "adapter_config_json needs r, lora_alpha and target_modules", field="adapter_config_json"
            ) from None
        if not 1 <= r <= self.max_rank:
            raise InvalidArgument(
                f"r {r}: this vLLM replica serves adapters of rank 1..{self.max_rank}", field="adapter_config_json"
            )
        try:
            want = adapter_manifest(self._manifest, r, targets)
        except ValueError as err:
            raise InvalidArgument(str(err), field="adapter_config_json") from None
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != want:
            diff = sorted(set(got) ^ set(want)) or sorted(k for k in got if got[k] != want[k])
            raise InvalidArgument(
                f"the adapter's tensors do not match r {r} over {targets} on this model: {diff[:3]}",
                field="adapter_safetensors",
            )
        return r, alpha, targets

    def _evicted(self, adapter: NamedLora) -> None:
        task = asyncio.get_running_loop().create_task(self._unload(adapter.request))
        self._unloading.add(task)
        task.add_done_callback(self._unloading.discard)

    async def _unload(self, request: Any) -> None:
        try:
            await self._lora_call("remove_lora", request.lora_int_id)
        except Exception as err:  # noqa: BLE001 - vLLM evicts past max_cpu_loras itself: logged, not raised
            log.warning("unloading adapter %s failed: %s", request.lora_name, err)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
