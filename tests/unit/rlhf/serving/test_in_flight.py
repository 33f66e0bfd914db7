"""``rlhf_requests_in_flight``: the reward and reference services' scaling signal (docs/deploy.md#scaling-signals).
It must rise while a call runs, whatever protocol carries it, and fall back when the call ends, answered or failed:
a gauge that leaked on errors would keep a fleet scaled out forever."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from rlhf.serving import InvalidArgument, ServiceMetrics, ServiceSettings, grpc_errors
from rlhf.serving.http import create_app


def in_flight(metrics: ServiceMetrics, method: str, protocol: str) -> float:
    value = metrics.registry.get_sample_value(
        "rlhf_requests_in_flight", {"service": metrics.name, "method": method, "protocol": protocol}
    )
    return value or 0.0


class Aborted(Exception):
    pass


class Context:
    """What grpc_errors uses of a grpc.aio context: abort raises, as the real one does."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    def set_trailing_metadata(self, _meta) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, _details: str) -> None:
        self.code = code
        raise Aborted(code)


class Servicer:
    def __init__(self, metrics: ServiceMetrics):
        self.metrics = metrics
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    @grpc_errors("Score")
    async def Score(self, request: str, context) -> str:
        self.started.set()
        await self.release.wait()
        if request == "bad":
            raise InvalidArgument("items is empty: send at least one item", "items")
        if request == "boom":
            raise RuntimeError("a scorer's bug")
        return "ok"


@pytest.mark.parametrize(("request_", "code"), [("fine", None), ("bad", "INVALID_ARGUMENT"), ("boom", "INTERNAL")])
def test_grpc_calls_are_in_flight_until_answered_or_failed(request_, code):
    async def main() -> None:
        metrics = ServiceMetrics("reward")
        svc = Servicer(metrics)
        ctx = Context()
        call = asyncio.create_task(svc.Score(request_, ctx))
        second = asyncio.create_task(svc.Score("fine", Context()))
        await svc.started.wait()
        await asyncio.sleep(0)
        assert in_flight(metrics, "Score", "grpc") == 2
        svc.release.set()
        if code is None:
            assert await call == "ok"
        else:
            with pytest.raises(Aborted):
                await call
            assert ctx.code == getattr(grpc.StatusCode, code)
        await second
        assert in_flight(metrics, "Score", "grpc") == 0

    asyncio.run(main())


def test_http_calls_are_in_flight_under_their_route_until_answered_or_failed():
    async def main() -> None:
        metrics = ServiceMetrics("reference")
        settings = ServiceSettings.from_env({}, max_body_bytes=10_000)
        app = create_app("reference", settings, metrics=metrics)
        started, release = asyncio.Event(), asyncio.Event()

        @app.post("/v1/logprobs/{kind}")
        async def logprobs(kind: str) -> dict:
            started.set()
            await release.wait()
            if kind == "bad":
                raise InvalidArgument("items is empty", "items")
            if kind == "boom":
                raise RuntimeError("a bug")
            return {"ok": True}

        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            calls = [asyncio.create_task(client.post(f"/v1/logprobs/{k}")) for k in ("fine", "bad", "boom")]
            await started.wait()
            for _ in range(20):  # the three reach the handler
                await asyncio.sleep(0.01)
            assert in_flight(metrics, "/v1/logprobs/{kind}", "http") == 3, "labelled by the route, not the path"
            assert await client.get("/metrics") is not None  # a scrape is not a call in flight
            assert in_flight(metrics, "/v1/logprobs/{kind}", "http") == 3
            release.set()
            codes = [(await c).status_code for c in calls]
        assert codes == [200, 400, 500]
        assert in_flight(metrics, "/v1/logprobs/{kind}", "http") == 0
        assert in_flight(metrics, "other", "http") == 0

    asyncio.run(main())
