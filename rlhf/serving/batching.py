"""Cross-request micro-batching: concurrent requests waiting for one model are merged into one engine call.

:class:`MicroBatcher` keeps a FIFO of the waiting requests; whenever the model becomes free it takes the head and every
queued request with the same key (same temperature, ...) within a row and token budget, runs them as one call in a
worker thread, and hands each caller back its own slice of the results. With ``regather_s`` > 0 (a model in this
process) it waits, briefly and bounded, for the callers of the last call, so callers served together stay together;
beside a model process the engines turn that off (``regather_s=0``).
Design: docs/services.md#reference (merging, regathering); measured by bench.serving and bench.service_ab
(docs/benchmarks.md, serving section).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

# The cap of a regathering wait; the wait is also at most half the last call's time.
REGATHER_S = 0.02

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Pending:
    key: Hashable
    rows: Sequence[Any]
    cost: int
    fut: asyncio.Future


class MicroBatcher(Generic[T, R]):
    """``await submit(key, rows, cost)`` -> ``run(key, merged_rows)[own slice]``, with ``run`` in a thread.

    - ``max_rows`` / ``max_cost``: a merged call takes requests (in arrival order, same key) until the next one
      would pass either bound; the head request always goes, however large.
    - ``on_batch(requests, rows)``: called per merged call (metrics).
    - ``regather_s``: the longest a call waits for the callers of the last calls (module docstring); 0 turns it off.

    Read at any time (:meth:`rlhf.serving.metrics.ServiceMetrics.watch_batcher` publishes them): :meth:`queued`
    (requests and rows waiting for the model), ``running_rows`` (rows in the call running now), ``calls`` and
    ``fill_sum`` (merged calls so far, and the sum of their fill: the larger of rows / ``max_rows`` and cost /
    ``max_cost``, at most 1).

    An exception from ``run`` goes to every request of that call. A caller that gives up (cancelled) before its call
    starts is dropped from it.
    """

    def __init__(
        self,
        run: Callable[[Hashable, list[T]], Sequence[R]],
        max_rows: int,
        max_cost: int,
        on_batch: Callable[[int, int], None] | None = None,
        regather_s: float = REGATHER_S,
    ):
        self._run = run
        self.regather_s = max(0.0, float(regather_s))
        self._owed: deque[list] = deque()  # [monotonic expiry, callers] per recent call: see the docstring
        self._last_call_s = 0.0
        self._gathered: asyncio.Event | None = None
        self.regathers = 0  # waits so far (tests, diagnostics)
        self.max_rows = max(1, int(max_rows))
        self.max_cost = max(1, int(max_cost))
        self._on_batch = on_batch
        self._queue: deque[_Pending] = deque()
        self._drainer: asyncio.Task | None = None
        self.running_rows = 0
        self.calls = 0
        self.fill_sum = 0.0

    async def submit(self, key: Hashable, rows: Sequence[T], cost: int) -> list[R]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append(_Pending(key, rows, cost, fut))
        owed = self._repay()
        if self._gathered is not None and (owed == 0 or self._queued_rows() >= self.max_rows):
            self._gathered.set()
        d = self._drainer
        # One drainer per loop at a time; a finished one (or one of a loop that has ended) is replaced.
        if d is None or d.done() or d.get_loop() is not loop:
            self._drainer = loop.create_task(self._drain())
        return await fut

    def _owed_now(self) -> int:
        """The places still owed, once the expired ones are dropped."""
        now, owed = time.monotonic(), self._owed
        while owed and owed[0][0] < now:
            owed.popleft()
        return sum(n for _, n in owed)

    def _repay(self) -> int:
        """A request arrived: it pays back the oldest unexpired place owed. Returns what is still owed."""
        if self._owed_now():
            self._owed[0][1] -= 1
            if self._owed[0][1] <= 0:
                self._owed.popleft()
        return sum(n for _, n in self._owed)

    def _queued_rows(self) -> int:
        return sum(len(p.rows) for p in self._queue if not p.fut.done())

    def queued(self) -> tuple[int, int]:
        """(requests, rows) waiting for the model now."""
        live = [p for p in list(self._queue) if not p.fut.done()]
        return len(live), sum(len(p.rows) for p in live)

    async def _regather(self) -> None:
        """Wait (bounded) for the callers of the last calls to be back in the queue (module docstring)."""
        owed = self._owed_now()
        wait = min(self.regather_s, 0.5 * self._last_call_s)
        queued = sum(1 for p in self._queue if not p.fut.done())
        # fewer owed than queued: waiting would delay many to merge a few (a one-off caller that ran alone while the
        # others queued behind it is not coming back)
        if not queued or owed < queued or wait <= 0 or self._queued_rows() >= self.max_rows:
            return
        self._gathered = asyncio.Event()
        self.regathers += 1
        try:
            await asyncio.wait_for(self._gathered.wait(), wait)
        except TimeoutError:
            pass
        finally:
            self._gathered = None

    def _take(self) -> list[_Pending]:
        """The head (first live request) and the queued requests with its key that fit the budget."""
        q = self._queue
        while q and q[0].fut.done():  # given up before it started
            q.popleft()
        if not q:
            return []
        head = q.popleft()
        batch, rows, cost = [head], len(head.rows), head.cost
        keep: deque[_Pending] = deque()
        while q:
            p = q.popleft()
            if p.fut.done():
                continue
            if p.key == head.key and rows + len(p.rows) <= self.max_rows and cost + p.cost <= self.max_cost:
                batch.append(p)
                rows += len(p.rows)
                cost += p.cost
            else:
                keep.append(p)
        q.extendleft(reversed(keep))  # the rest keep their order
        return batch

    async def _drain(self) -> None:
        batch: list[_Pending] = []
        try:
            while True:
                await self._regather()
                batch = self._take()
                if not batch:
                    return
                merged: list[T] = [r for p in batch for r in p.rows]
                if self._on_batch is not None:
                    self._on_batch(len(batch), len(merged))
                cost = sum(p.cost for p in batch)
                self.calls += 1
                self.fill_sum += min(1.0, max(len(merged) / self.max_rows, cost / self.max_cost))
                self.running_rows = len(merged)
                t0 = time.monotonic()
                try:
                    out = await asyncio.to_thread(self._run, batch[0].key, merged)
                except Exception as err:  # noqa: BLE001 - handed to the callers, who decide
                    for p in batch:
                        if not p.fut.done():
                            p.fut.set_exception(err)
                    continue
                finally:
                    self.running_rows = 0
                end = time.monotonic()
                self._last_call_s = end - t0
                self._owed.append([end + 1.5 * self._last_call_s, len(batch)])
                if len(out) != len(merged):  # a broken run function must not hand out misaligned slices
                    err = RuntimeError(f"batched call returned {len(out)} results for {len(merged)} rows")
                    for p in batch:
                        if not p.fut.done():
                            p.fut.set_exception(err)
                    continue
                off = 0
                for p in batch:
                    n = len(p.rows)
                    if not p.fut.done():
                        p.fut.set_result(list(out[off : off + n]))
                    off += n
        except BaseException:
            # Cancelled (loop shutting down): nobody is left to run the queue, so its callers must not hang.
            for p in [*batch, *self._queue]:
                if not p.fut.done():
                    p.fut.cancel()
            self._queue.clear()
            raise
