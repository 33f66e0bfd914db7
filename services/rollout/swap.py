"""What a weight swap rests on, whatever the engine: the gate that keeps generation and swaps apart
(:class:`SwapGate`), and the check that an update is the model's full state dict, against the names and shapes of
the checkpoint the engine loaded (:func:`read_checkpoint_manifest`, :func:`check_state_dict`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from rlhf.serving.errors import InvalidArgument


class SwapGate:
    """Generation and weight swaps exclude each other; a pending swap stops new admissions (no starvation).

    ``async with gate.generation():`` around each request; ``async with gate.exclusive():`` around a swap, which
    waits until every admitted request has finished. While a swap waits, :attr:`preempt` is set: an engine with
    partial rollouts stops its requests at the next token boundary, leaves the gate, and resumes them once the swap
    is done (docs/weight-sync.md#partial-rollouts).

    It also keeps the replica's busy time (:meth:`busy_seconds`: seconds with at least one request admitted), the
    ``rlhf_rollout_busy_seconds_total`` metric an idle fraction is read from (bench.long_tail).
    """

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._busy_s = 0.0  # closed busy intervals
        self._busy_since: float | None = None  # monotonic start of the open one (a request is admitted)
        self._swapping = False
        # a threading.Event: the hf engine's decode loop (and vLLM's engine thread) reads it from its own thread
        self.preempt = threading.Event()
        # called (in the event loop) as preempt is set: an engine that must act rather than poll (vLLM's AsyncLLM)
        self._on_preempt: list[Callable[[], None]] = []

    def on_preempt(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` whenever :attr:`preempt` is set."""
        self._on_preempt.append(fn)

    @property
    def active(self) -> int:
        return self._active

    def busy_seconds(self) -> float:
        """Seconds so far with at least one request admitted (a swap's install and the gaps between requests are
        not busy; a request waiting for admission is not yet)."""
        since = self._busy_since
        return self._busy_s + (time.monotonic() - since if since is not None else 0.0)

    @contextlib.asynccontextmanager
    async def generation(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._active += 1
            if self._active == 1:
                self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._active -= 1
            if self._active == 0 and self._busy_since is not None:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None
            await self._notify()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._swapping = True
            self.preempt.set()
            for fn in self._on_preempt:
                fn()
            try:
                await self._cond.wait_for(lambda: self._active == 0)
            except BaseException:
                self.preempt.clear()
                self._swapping = False
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            self.preempt.clear()  # before admissions reopen: the resumed requests must not stop again at once
            self._swapping = False
            await self._notify()

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()


def read_checkpoint_manifest(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the safetensors checkpoint in ``model_dir`` (headers only; no tensor is read)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors checkpoint")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                shapes[name] = tuple(st.get_slice(name).get_shape())
    return shapes


def check_state_dict(tensors: dict[str, Any], expected: dict[str, tuple[int, ...]]) -> None:
    """A weight update must be the model's full state dict: same names, same shapes (else nothing is loaded)."""
    if not tensors:
        raise InvalidArgument("the weight update holds no tensors", field="header.tensors")
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown:
        raise InvalidArgument(
            f"the weight update has {len(unknown)} tensor(s) the model does not have (first: {unknown[0]!r}); "
            "send the policy's state dict with Hugging Face parameter names",
            field="header.tensors",
        )
    if missing:
        raise InvalidArgument(
            f"the weight update lacks {len(missing)} of the model's tensor(s) (first: {missing[0]!r}); "
            "send the full state dict",
            field="header.tensors",
        )
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name]):
            raise InvalidArgument(
                f"tensor {name!r} has shape {list(t.shape)}, the model's is {list(expected[name])}",
                field="header.tensors",
            )
