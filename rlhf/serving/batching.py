"""Cross-request micro-batching: concurrent requests waiting for one model are merged into one engine call.

The engines of the reward and reference services run one forward at a time (one model, one device). Without
merging, N concurrent requests of a few rows each make N small forwards in a row, each paying the fixed cost of a
call (thread hop, tensor building, kernel launches, Python per layer). :class:`MicroBatcher` keeps a FIFO of the
waiting requests; whenever the model becomes free it takes the head and every queued request with the same key
(same temperature, ...) within a row and token budget, runs them as one call in a worker thread, and hands each
caller back its own slice of the results. Nothing waits on a timer: an idle model starts on a request at once, so a
lone caller sees no added delay; merging only happens to requests that would have queued anyway.

The call must be row-independent (each row's result depends on that row alone, as with padded, masked forwards),
so that a merged result equals the unbatched one.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

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

    An exception from ``run`` goes to every request of that call. A caller that gives up (cancelled) before its call
    starts is dropped from it.
    """

    def __init__(
        self,
        run: Callable[[Hashable, list[T]], Sequence[R]],
        max_rows: int,
        max_cost: int,
        on_batch: Callable[[int, int], None] | None = None,
    ):
        self._run = run
        self.max_rows = max(1, int(max_rows))
        self.max_cost = max(1, int(max_cost))
        self._on_batch = on_batch
        self._queue: deque[_Pending] = deque()
        self._drainer: asyncio.Task | None = None

    async def submit(self, key: Hashable, rows: Sequence[T], cost: int) -> list[R]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append(_Pending(key, rows, cost, fut))
        d = self._drainer
        # One drainer per loop at a time; a finished one (or one of a loop that has ended) is replaced.
        if d is None or d.done() or d.get_loop() is not loop:
            self._drainer = loop.create_task(self._drain())
        return await fut

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
                batch = self._take()
                if not batch:
                    return
                merged: list[T] = [r for p in batch for r in p.rows]
                if self._on_batch is not None:
                    self._on_batch(len(batch), len(merged))
                try:
                    out = await asyncio.to_thread(self._run, batch[0].key, merged)
                except Exception as err:  # noqa: BLE001 - handed to the callers, who decide
                    for p in batch:
                        if not p.fut.done():
                            p.fut.set_exception(err)
                    continue
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
