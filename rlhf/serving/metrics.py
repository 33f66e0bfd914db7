"""Prometheus metrics of one service, in its own CollectorRegistry (several services can live in one test process).

Names (all labelled with ``service``): ``rlhf_requests_total{method, protocol, code}``,
``rlhf_request_seconds{method, protocol}`` (histogram), ``rlhf_batch_size{method}`` (items per request),
``rlhf_merged_requests{method}`` / ``rlhf_merged_rows{method}`` (per engine call: requests merged into it, their
rows), ``rlhf_tokens_total{kind}`` (prompt / response / generated), ``rlhf_errors_total{kind}`` (domain error kinds:
invalid_argument, payload_too_large, scorer_error, ...), ``rlhf_ready`` (1 when ready),
``rlhf_requests_in_flight{method, protocol}``.

``rlhf_requests_in_flight`` counts every call from its start to its answer, errors included: gRPC methods in
:func:`rlhf.serving.grpc_errors` (the decorator every servicer method has), HTTP routes in the app's middleware
(labelled with the route's template, as ``rlhf_requests_total``; health and metrics paths are not counted). Summed
over a reward or reference Service, it is the work in progress whatever the scorer (a model, a rule, an HTTP judge):
their scaling signal (docs/deploy.md#scaling-signals).

A service's micro-batchers (:meth:`ServiceMetrics.watch_batcher`), read at each scrape, labelled ``method``:
``rlhf_batcher_queued_requests`` / ``rlhf_batcher_queued_rows`` (waiting for the model), ``rlhf_batcher_running_rows``
(in the engine call now), ``rlhf_batcher_max_rows`` (a merged call's row budget) and ``rlhf_batch_fill`` (a summary:
per merged call, the share of its row or token budget it filled): how full a model scorer's calls are, for sizing
its batches (only model scorers have a batcher, so they are not the scaling signal).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # pragma: no cover
    from rlhf.serving.batching import MicroBatcher

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class BatcherCollector(Collector):
    """The watched micro-batchers' queues and fill at each scrape (module docstring)."""

    def __init__(self, service: str):
        self.service = service
        self.batchers: dict[str, MicroBatcher] = {}

    def collect(self) -> Iterator[GaugeMetricFamily | SummaryMetricFamily]:
        labels = ["service", "method"]
        q_req = GaugeMetricFamily("rlhf_batcher_queued_requests", "requests waiting for the model", labels=labels)
        q_rows = GaugeMetricFamily("rlhf_batcher_queued_rows", "rows waiting for the model", labels=labels)
        running = GaugeMetricFamily("rlhf_batcher_running_rows", "rows in the engine call running now", labels=labels)
        max_rows = GaugeMetricFamily("rlhf_batcher_max_rows", "row budget of one merged call", labels=labels)
        fill = SummaryMetricFamily(
            "rlhf_batch_fill", "share of its row or token budget a merged call filled (0-1)", labels=labels
        )
        for method, b in list(self.batchers.items()):
            key = [self.service, method]
            requests, rows = b.queued()
            q_req.add_metric(key, requests)
            q_rows.add_metric(key, rows)
            running.add_metric(key, b.running_rows)
            max_rows.add_metric(key, b.max_rows)
            fill.add_metric(key, count_value=b.calls, sum_value=b.fill_sum)
        yield from (q_req, q_rows, running, max_rows, fill)


class ServiceMetrics:
    """The metrics of one service. ``render()`` gives the Prometheus text exposition."""

    def __init__(self, name: str, registry: CollectorRegistry | None = None):
        self.name = name
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "rlhf_requests", "requests handled", ["service", "method", "protocol", "code"], registry=r
        )
        self.latency = Histogram(
            "rlhf_request_seconds",
            "request latency in seconds",
            ["service", "method", "protocol"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch = Histogram(
            "rlhf_batch_size", "items per request", ["service", "method"], buckets=BATCH_BUCKETS, registry=r
        )
        self.merged_requests = Histogram(
            "rlhf_merged_requests",
            "requests merged into one engine call",
            ["service", "method"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.merged_rows = Histogram(
            "rlhf_merged_rows",
            "rows (items) of one merged engine call",
            ["service", "method"],
            buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("rlhf_tokens", "tokens processed", ["service", "kind"], registry=r)
        self.errors = Counter("rlhf_errors", "errors by kind", ["service", "kind"], registry=r)
        self.ready = Gauge("rlhf_ready", "1 when the service is ready", ["service"], registry=r)
        self.inflight = Gauge(
            "rlhf_requests_in_flight",
            "requests started and not yet answered",
            ["service", "method", "protocol"],
            registry=r,
        )
        self.ready.labels(name).set(0)
        self._children: dict[tuple, Any] = {}
        self._batchers: BatcherCollector | None = None
        self._fn_gauges: dict[str, Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(service, *labels)``, remembered: ``labels()`` checks and locks on every call, which is a
        visible share of a small request's serving cost; the label sets are few (methods x codes)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.name, *labels)
        return child

    def observe_request(self, method: str, protocol: str, seconds: float, code: str | int) -> None:
        self._child(self.requests, method, protocol, str(code)).inc()
        self._child(self.latency, method, protocol).observe(seconds)

    def inflight_gauge(self, method: str, protocol: str) -> Any:
        return self._child(self.inflight, method, protocol)

    def observe_batch(self, method: str, size: int) -> None:
        self._child(self.batch, method).observe(size)

    def observe_merged(self, method: str, requests: int, rows: int) -> None:
        self._child(self.merged_requests, method).observe(requests)
        self._child(self.merged_rows, method).observe(rows)

    def gauge_of(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge ``name{service}`` whose value is ``fn()`` at each scrape. Called again (a component made anew in
        the same process), the gauge reads the new ``fn``."""
        g = self._fn_gauges.get(name)
        if g is None:
            g = self._fn_gauges[name] = Gauge(name, doc, ["service"], registry=self.registry).labels(self.name)
        g.set_function(fn)

    def watch_batcher(self, method: str, batcher: MicroBatcher) -> None:
        """Publish ``batcher``'s queue and fill under ``method`` (module docstring)."""
        if self._batchers is None:
            self._batchers = BatcherCollector(self.name)
            self.registry.register(self._batchers)
        self._batchers.batchers[method] = batcher

    def add_tokens(self, kind: str, n: int) -> None:
        if n:
            self._child(self.tokens, kind).inc(n)

    def count_error(self, kind: str, n: int = 1) -> None:
        if n:
            self._child(self.errors, kind).inc(n)

    def set_ready(self, ready: bool) -> None:
        self.ready.labels(self.name).set(1 if ready else 0)

    @contextlib.contextmanager
    def track(self, method: str, protocol: str) -> Iterator[dict]:
        """Time a block; set ``box["code"]`` inside to record the outcome (default ``OK``)."""
        box: dict = {"code": "OK"}
        g = self.inflight_gauge(method, protocol)
        g.inc()
        t0 = time.perf_counter()
        try:
            yield box
        except BaseException:
            if box["code"] == "OK":
                box["code"] = "ERROR"
            raise
        finally:
            g.dec()
            self.observe_request(method, protocol, time.perf_counter() - t0, box["code"])

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
