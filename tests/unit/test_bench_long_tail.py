"""bench.long_tail's pure parts: the length distribution, and the idle fraction and push waits read from the
rollout service's own metrics (its registry as `rlhf serve rollout` builds it)."""

from __future__ import annotations

import asyncio

import pytest

from bench._common import percentile
from bench.long_tail import Mark, long_tail_lengths, read_mark, step_windows, summarise
from rlhf.serving import ServiceMetrics
from services.rollout import swap
from services.rollout.engine_types import SwapResult
from services.rollout.main import GateCollector, engine_hooks
from services.rollout.swap import SwapGate


def test_the_lengths_have_the_asked_median_and_99th_percentile():
    xs = long_tail_lengths(20_000, 64, 512, cap=1024, seed=3)
    assert abs(percentile(xs, 50) - 64) <= 3
    assert abs(percentile(xs, 99) - 512) <= 40
    assert percentile(xs, 99) / percentile(xs, 50) > 7  # the long tail: p99 eight times the median
    assert long_tail_lengths(50, 64, 512, cap=1024, seed=3) == xs[:50]  # a seed gives the same lengths
    capped = long_tail_lengths(2_000, 16, 128, cap=100, seed=0)
    assert max(capped) == 100 and min(capped) >= 1
    with pytest.raises(ValueError, match="median < p99"):
        long_tail_lengths(10, 64, 32, cap=100)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_busy_time_is_the_union_of_the_requests_admitted(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(swap.time, "monotonic", clock)

    async def main():
        gate = SwapGate()
        a, b = gate.generation(), gate.generation()
        await a.__aenter__()  # t=100: busy from here
        clock.now = 102.0
        await b.__aenter__()  # overlaps a: not counted twice
        clock.now = 103.0
        await a.__aexit__(None, None, None)
        assert gate.busy_seconds() == pytest.approx(3.0)  # b still running: the open interval counts
        clock.now = 104.0
        await b.__aexit__(None, None, None)  # idle from t=104
        clock.now = 110.0
        assert gate.busy_seconds() == pytest.approx(4.0) and gate.active == 0
        async with gate.generation():
            clock.now = 111.5
        return gate.busy_seconds()

    assert asyncio.run(main()) == pytest.approx(5.5)


def test_the_rollout_metrics_read_back_as_a_mark(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(swap.time, "monotonic", clock)
    metrics = ServiceMetrics("rollout")
    hooks = engine_hooks(metrics)
    gate = SwapGate()
    metrics.registry.register(GateCollector(metrics.name, gate))
    empty = read_mark(metrics.render()[0].decode(), 1.0)  # before any push or token: zeros
    assert (empty.busy_s, empty.wait_s, empty.pushes, empty.generated) == (0.0, 0.0, 0.0, 0.0)

    async def busy():
        async with gate.generation():
            clock.now += 2.5

    asyncio.run(busy())
    hooks.swapped(SwapResult(version=1, checksum="", swapped=True, wait_seconds=0.75, swap_seconds=0.25))
    hooks.swapped(SwapResult(version=2, checksum="", swapped=True, wait_seconds=0.5, swap_seconds=0.25))
    hooks.tokens("generated", 300)
    hooks.tokens("prompt", 40)  # not generated: left out
    m = read_mark(metrics.render()[0].decode(), 7.0)
    assert m == Mark(t=7.0, busy_s=2.5, wait_s=1.25, pause_s=0.5, pushes=2.0, generated=300.0)


def test_idle_fraction_and_push_wait_per_step():
    marks = [
        Mark(t=10.0, busy_s=5.0, wait_s=1.0, pause_s=0.1, pushes=1, generated=1000),
        Mark(t=20.0, busy_s=14.5, wait_s=1.5, pause_s=0.2, pushes=2, generated=1600),  # busy 9.5 of 10 s
        Mark(t=25.0, busy_s=15.5, wait_s=3.5, pause_s=0.3, pushes=3, generated=1800),  # busy 1 of 5 s
    ]
    w = step_windows(marks)
    assert [x["wall_s"] for x in w] == [10.0, 5.0]
    assert [x["idle_fraction"] for x in w] == pytest.approx([0.05, 0.8])
    assert [x["push_wait_s"] for x in w] == pytest.approx([0.5, 2.0])
    assert [x["push_pause_s"] for x in w] == pytest.approx([0.1, 0.1])
    assert [x["pushes"] for x in w] == [1, 1] and [x["generated_tokens"] for x in w] == [600, 200]
    rows = [
        {"time/iteration_s": 10.0, "samples": 32, "response_length/mean": 20.0},
        {"time/iteration_s": 6.0, "samples": 32, "response_length/mean": 40.0},
    ]
    s = summarise(w, rows)
    assert s["idle_fraction"] == pytest.approx((0.5 + 4.0) / 15)  # idle seconds over wall seconds, not a mean
    assert s["push_stall_fraction"] == pytest.approx((0.5 + 0.1 + 2.0 + 0.1) / 15)
    assert s["samples_per_s"] == pytest.approx(64 / 16)
    assert s["generated_tokens_per_s"] == pytest.approx(800 / 15)
    assert s["push_wait_s_per_step"] == pytest.approx(1.25) and s["response_length_mean"] == pytest.approx(30.0)
    with pytest.raises(ValueError, match="out of order"):
        step_windows([marks[1], marks[0]])
