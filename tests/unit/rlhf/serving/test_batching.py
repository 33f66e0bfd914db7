"""rlhf.serving.batching.MicroBatcher: concurrent requests are merged into one call, each caller gets its own slice,
idle requests start at once, keys and budgets split calls, errors and cancellations stay with their callers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlhf.serving.batching import MicroBatcher


class Recorder:
    """A run function that records each call's (key, rows) and can be held (to let requests queue)."""

    def __init__(self, fail_on: object = None):
        self.calls: list[tuple[object, list]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on = fail_on

    def __call__(self, key, rows):
        self.gate.wait(5)
        self.calls.append((key, list(rows)))
        if self.fail_on in rows:
            raise ValueError(f"bad row {self.fail_on}")
        return [(key, r * 10) for r in rows]


async def _hold_then(rec: Recorder, b: MicroBatcher, first, *rest):
    """Submit ``first`` while the model is held, queue the ``rest`` behind it, then release."""
    rec.gate.clear()
    t0 = asyncio.ensure_future(b.submit(*first))
    while not b._queue and not rec.calls and b._drainer is None:
        await asyncio.sleep(0)
    await asyncio.sleep(0.05)  # the first call is now inside run(), blocked on the gate
    tasks = [asyncio.ensure_future(b.submit(*r)) for r in rest]
    await asyncio.sleep(0.01)
    rec.gate.set()
    return await asyncio.gather(t0, *tasks, return_exceptions=True)


def test_lone_request_runs_alone_and_at_once():
    rec = Recorder()
    b = MicroBatcher(rec, max_rows=100, max_cost=100)
    assert asyncio.run(b.submit("k", [1, 2], 2)) == [("k", 10), ("k", 20)]
    assert rec.calls == [("k", [1, 2])]


def test_queued_requests_merge_into_one_call_in_order():
    rec = Recorder()
    seen: list[tuple[int, int]] = []
    b = MicroBatcher(rec, max_rows=100, max_cost=100, on_batch=lambda n, rows: seen.append((n, rows)))
    out = asyncio.run(_hold_then(rec, b, ("k", [1], 1), ("k", [2, 3], 2), ("k", [4], 1), ("k", [5, 6, 7], 3)))
    assert out == [[("k", 10)], [("k", 20), ("k", 30)], [("k", 40)], [("k", 50), ("k", 60), ("k", 70)]]
    assert rec.calls == [("k", [1]), ("k", [2, 3, 4, 5, 6, 7])]
    assert seen == [(1, 1), (3, 6)]


def test_keys_and_budgets_split_calls():
    rec = Recorder()
    b = MicroBatcher(rec, max_rows=3, max_cost=100)
    out = asyncio.run(
        _hold_then(rec, b, ("a", [0], 1), ("a", [1], 1), ("b", [2], 1), ("a", [3, 4], 2), ("a", [5], 1), ("b", [6], 1))
    )
    assert [len(o) for o in out] == [1, 1, 1, 2, 1, 1]
    assert out[2] == [("b", 20)] and out[5] == [("b", 60)]
    # head 'a'[1] takes 'a'[3,4] (3 rows), 'a'[5] would pass max_rows; then 'b' (both), then the last 'a'
    assert rec.calls == [("a", [0]), ("a", [1, 3, 4]), ("b", [2, 6]), ("a", [5])]

    rec2 = Recorder()
    b2 = MicroBatcher(rec2, max_rows=100, max_cost=5)
    asyncio.run(_hold_then(rec2, b2, ("k", [0], 1), ("k", [1], 4), ("k", [2], 4), ("k", [3], 1)))
    assert rec2.calls == [("k", [0]), ("k", [1, 3]), ("k", [2])]


def test_head_over_budget_still_runs():
    rec = Recorder()
    b = MicroBatcher(rec, max_rows=1, max_cost=1)
    assert asyncio.run(b.submit(None, [1, 2, 3], 99)) == [(None, 10), (None, 20), (None, 30)]


def test_error_goes_to_the_callers_of_that_call_only():
    rec = Recorder(fail_on=3)
    b = MicroBatcher(rec, max_rows=2, max_cost=100)
    out = asyncio.run(_hold_then(rec, b, ("k", [1], 1), ("k", [2], 1), ("k", [3], 1), ("k", [4], 1)))
    assert out[0] == [("k", 10)]
    assert isinstance(out[1], ValueError) and isinstance(out[2], ValueError)  # [2, 3] ran together
    assert out[3] == [("k", 40)]


def test_cancelled_waiter_is_dropped():
    rec = Recorder()
    b = MicroBatcher(rec, max_rows=100, max_cost=100)

    async def main():
        rec.gate.clear()
        first = asyncio.ensure_future(b.submit("k", [1], 1))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(b.submit("k", [2], 1))
        kept = asyncio.ensure_future(b.submit("k", [3], 1))
        await asyncio.sleep(0.01)
        gone.cancel()
        rec.gate.set()
        return await first, await kept, gone.cancelled()

    assert asyncio.run(main()) == ([("k", 10)], [("k", 30)], True)
    assert rec.calls == [("k", [1]), ("k", [3])]


def test_wrong_result_count_is_an_error():
    b = MicroBatcher(lambda key, rows: rows[:-1], max_rows=10, max_cost=10)
    with pytest.raises(RuntimeError, match="2 rows"):
        asyncio.run(b.submit(None, [1, 2], 2))


def test_works_across_event_loops():
    rec = Recorder()
    b = MicroBatcher(rec, max_rows=10, max_cost=10)
    assert asyncio.run(b.submit(1, [1], 1)) == [(1, 10)]
    assert asyncio.run(b.submit(2, [2], 1)) == [(2, 20)]


def test_callers_served_together_are_merged_again_when_they_come_back_staggered():
    """Four callers served by one call return 0-30 ms apart: with regathering their next requests make one call
    again (the model waits for them); without, the first to return starts alone and the group splits."""

    def run_round(regather_s: float) -> tuple[list[int], int]:
        sizes: list[int] = []

        def slow(key, rows):
            time.sleep(0.1)
            return rows

        b = MicroBatcher(
            slow, max_rows=100, max_cost=100, on_batch=lambda n, rows: sizes.append(n), regather_s=regather_s
        )

        async def caller(i: int) -> None:
            await b.submit("k", [i], 1)  # round 1: all at once
            await asyncio.sleep(0.01 * i)  # the trip back and the next request: staggered
            await b.submit("k", [i], 1)

        async def main() -> None:
            await asyncio.gather(*(caller(i) for i in range(4)))

        asyncio.run(main())
        return sizes, b.regathers

    with_wait, waits = run_round(1.0)
    assert with_wait == [4, 4] and waits == 1
    without, waits = run_round(0.0)
    assert without[0] == 4 and without[1] == 1 and len(without) >= 3 and waits == 0


def test_a_lone_caller_never_waits_to_regather():
    def quick(key, rows):
        return rows

    b = MicroBatcher(quick, max_rows=100, max_cost=100, regather_s=1.0)

    async def main() -> None:
        for i in range(5):
            assert await b.submit("k", [i], 1) == [i]

    asyncio.run(main())
    assert b.regathers == 0


def test_a_regathering_wait_ends_when_the_budget_is_full():
    """Callers expected back, but the queued rows already fill a call: no wait."""

    def slow(key, rows):
        time.sleep(0.05)
        return rows

    b = MicroBatcher(slow, max_rows=2, max_cost=100, regather_s=1.0)

    async def caller(i: int) -> None:
        await b.submit("k", [i], 1)
        await asyncio.sleep(0.005 * i)
        await b.submit("k", [i, i], 2)

    async def main() -> None:
        await asyncio.gather(*(caller(i) for i in range(2)))

    asyncio.run(main())
    assert b.regathers == 0


def test_requests_queued_behind_a_one_off_call_do_not_wait_for_its_caller():
    """The ring's pattern: one job's request runs alone, the batch's others queue behind it; its caller is not coming
    back, so the queued call starts as soon as the model is free."""

    def slow(key, rows):
        time.sleep(0.05)
        return rows

    sizes: list[int] = []
    b = MicroBatcher(slow, max_rows=100, max_cost=100, on_batch=lambda n, rows: sizes.append(n), regather_s=1.0)

    async def main() -> None:
        first = asyncio.ensure_future(b.submit("k", [0], 1))
        await asyncio.sleep(0.01)  # the first call is running
        await asyncio.gather(first, *(b.submit("k", [i], 1) for i in range(1, 4)))

    asyncio.run(main())
    assert sizes == [1, 3] and b.regathers == 0


def _sample(metrics, name: str, method: str = "m") -> float:
    value = metrics.registry.get_sample_value(name, {"service": "svc", "method": method})
    assert value is not None, name
    return value


def test_watched_batcher_publishes_its_queue_running_rows_and_fill():
    """The scaling signals of a batching service (docs/deploy.md#scaling-signals) follow the batcher's queue: rows
    wait while the model is busy, the running call's rows show, and each call adds its fill to the summary."""
    from rlhf.serving.metrics import ServiceMetrics  # noqa: PLC0415 - the metrics layer, only for this test

    rec = Recorder()
    b = MicroBatcher(rec, max_rows=4, max_cost=100)
    metrics = ServiceMetrics("svc")
    metrics.watch_batcher("m", b)
    assert _sample(metrics, "rlhf_batcher_max_rows") == 4
    seen: dict[str, float] = {}

    async def main():
        rec.gate.clear()
        first = asyncio.ensure_future(b.submit("k", [1], 1))
        while not b.running_rows:
            await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(b.submit("k", [2, 3], 2)), asyncio.ensure_future(b.submit("k", [4], 1))]
        await asyncio.sleep(0.01)
        for name in ("rlhf_batcher_queued_requests", "rlhf_batcher_queued_rows", "rlhf_batcher_running_rows"):
            seen[name] = _sample(metrics, name)
        rec.gate.set()
        await asyncio.gather(first, *rest)

    asyncio.run(main())
    assert seen == {"rlhf_batcher_queued_requests": 2, "rlhf_batcher_queued_rows": 3, "rlhf_batcher_running_rows": 1}
    assert _sample(metrics, "rlhf_batcher_queued_rows") == _sample(metrics, "rlhf_batcher_running_rows") == 0
    # two calls: 1 of 4 rows, then 3 of 4
    assert _sample(metrics, "rlhf_batch_fill_count") == 2
    assert _sample(metrics, "rlhf_batch_fill_sum") == pytest.approx(0.25 + 0.75)
    # a call cut by its token budget is full even with few rows; a head over both budgets counts as 1, not more
    b2 = MicroBatcher(rec, max_rows=100, max_cost=4)
    metrics.watch_batcher("t", b2)
    asyncio.run(b2.submit("k", [1], 4))
    asyncio.run(b2.submit("k", [1], 9))
    assert _sample(metrics, "rlhf_batch_fill_sum", "t") == pytest.approx(2.0)
    assert "rlhf_batch_fill_count" in metrics.render()[0].decode()
