"""The FastAPI base every service's ``build_app`` starts from: :func:`create_app`.

It adds ``GET /healthz``, ``GET /readyz`` (``app.state.readiness``, which :class:`ServiceRunner.set_http_app` points
at the runner), ``GET /metrics``, the error handlers of :mod:`rlhf.serving.errors`, a body-size limit (413 before the
body is read) and request counting. Hot routes answer with :func:`json_response` (rendered once, the schema kept in
OpenAPI through ``responses={200: {"model": ...}}``). The OpenAPI document is the contract: :class:`ContractRoute`
lists each route's error statuses, and :class:`Declared` states a constraint the engine checks (400) in the schema.

Design: docs/services.md#common-to-every-service; adding a route: docs/code-tour.md#where-to-change-x.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import get_flat_params
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.utils import create_model_field
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, StrictInt
from starlette.routing import Match, Router

from rlhf.serving.errors import (
    ClientDisconnected,
    PayloadTooLarge,
    error_body,
    http_error_responses,
    install_http_errors,
)
from rlhf.serving.metrics import ServiceMetrics
from rlhf.serving.settings import ServiceSettings

T = TypeVar("T")

HEALTH_PATHS = ("/healthz", "/readyz", "/metrics")
# A refused body up to this size is read and dropped so that the client sees the 413; a larger one is cut off.
DRAIN_LIMIT = 256 * 1024 * 1024


class BodyLimitMiddleware:
    """Pure ASGI middleware: 413 for bodies over ``max_bytes``, decided from Content-Length before reading.

    Without a Content-Length (chunked), the body is buffered up to the limit and refused as soon as it passes it.
    """

    def __init__(self, app: Any, max_bytes: int, metrics: ServiceMetrics | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    async def _refuse(
        self, receive: Callable, send: Callable, declared: int | None, seen: int = 0, more: bool = True
    ) -> None:
        """Answer 413. The app never sees the body; the rest of it is read and dropped first (up to
        ``DRAIN_LIMIT``) so the client, still sending, gets the answer instead of a connection reset."""
        size = f"{declared} bytes" if declared is not None else "more"
        err = PayloadTooLarge(
            f"request body is {size}, over the limit of {self.max_bytes} bytes; send smaller batches "
            "(or raise RLHF_MAX_BODY_BYTES on the server)",
            field="body",
        )
        if self.metrics is not None:
            self.metrics.count_error(err.kind)
        if declared is None or declared <= DRAIN_LIMIT:
            while more and seen <= DRAIN_LIMIT:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return
                seen += len(msg.get("body", b""))
                more = msg.get("more_body", False)
        body = json.dumps(error_body(err)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = None
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = None
                break
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(receive, send, declared)
                return
            await self.app(scope, receive, send)
            return
        # No Content-Length: read (bounded), then replay.
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            data = msg.get("body", b"")
            total += len(data)
            if total > self.max_bytes:
                await self._refuse(receive, send, None, total, msg.get("more_body", False))
                return
            chunks.append(data)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class MetricsMiddleware:
    """Counts requests, latency and requests in flight per route template (unknown paths are one label: ``other``).

    The route is matched here, before the app runs, so that the in-flight gauge has its label while the call runs
    (the router's own match is only known after it)."""

    def __init__(self, app: Any, metrics: ServiceMetrics, router: Router | None = None):
        self.app = app
        self.metrics = metrics
        self.router = router

    def _template(self, scope: dict) -> str:
        for route in self.router.routes if self.router is not None else ():
            if route.matches(scope)[0] is Match.FULL:
                return getattr(route, "path", None) or "other"
        return "other"

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in HEALTH_PATHS:
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_wrapper(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                status["code"] = msg["status"]
            await send(msg)

        method = self._template(scope)
        gauge = self.metrics.inflight_gauge(method, "http")
        gauge.inc()
        t0 = time.perf_counter()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            gauge.dec()
            route = scope.get("route")
            method = getattr(route, "path", None) or method
            self.metrics.observe_request(method, "http", time.perf_counter() - t0, status["code"])


def _utf8(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid UTF-8 (it contains a lone surrogate)") from None
    return v


# A JSON string may escape a lone surrogate ("\\ud800"), which no tokenizer or encoder takes: refused with 422.
Utf8Text = Annotated[str, AfterValidator(_utf8)]


def _integral(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


def json_int(**bounds: int) -> Any:
    """An integer as JSON Schema (and so OpenAPI 3.1) means one: any number without a fractional part, so 7.0 is 7;
    a string ("7"), a boolean or 7.5 is refused with 422. ``bounds``: ``ge``, ``gt``, ``le``, ``lt``.

    Bounds go here rather than in the field's ``Field()``: on a union (``json_int() | None``) pydantic would
    publish them as ``ge``/``le``, which JSON Schema does not know, instead of ``minimum``/``maximum``."""
    if bounds:
        return Annotated[StrictInt, Field(**bounds), BeforeValidator(_integral)]
    return Annotated[StrictInt, BeforeValidator(_integral)]


JsonInt = json_int()
TokenId = json_int(ge=0, le=2**31 - 1)


class Declared:
    """JSON Schema keywords for a constraint the code checks itself (the engine's 400 naming the field) rather than
    the request model (422): ``Annotated[str, Declared(minLength=1)]``. The published schema then says what is
    refused, and the status stays what clients were told."""

    def __init__(self, **keywords: Any):
        self.keywords = keywords

    def __get_pydantic_json_schema__(self, core_schema: Any, handler: Any) -> dict[str, Any]:
        schema = handler(core_schema)
        schema.update(self.keywords)
        return schema

    def __repr__(self) -> str:
        return f"Declared({self.keywords})"


def _requires_token(dependant: Dependant) -> bool:
    return any(getattr(d.call, "rlhf_requires_token", False) or _requires_token(d) for d in dependant.dependencies)


class ContractRoute(APIRoute):
    """A route whose OpenAPI responses list the errors its kind answers with, in :class:`ErrorBody`'s schema: 500
    (any route: an internal error); 413 (a method with a body: over ``max_body_bytes``); 422 (input: a body, query or
    header that does not match the schema; FastAPI's own 422 schema is not what this service sends); 400 (a body:
    values valid by the schema that the service refuses); 401 and 403 (behind :func:`http_token_dependency`).
    A route's own ``responses`` come first."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any):
        super().__init__(path, endpoint, **kwargs)
        statuses = {500}
        if self.methods - {"GET", "HEAD", "OPTIONS"}:
            statuses.add(413)
        if self.body_field is not None:
            statuses |= {400, 422}
        elif get_flat_params(self.dependant):
            statuses.add(422)
        if _requires_token(self.dependant):
            statuses |= {401, 403}
        declared = {str(k) for k in self.responses}
        added = {k: v for k, v in http_error_responses(*statuses).items() if str(k) not in declared}
        self.responses = {**self.responses, **added}
        for status, response in added.items():
            self.response_fields[status] = create_model_field(
                name=f"Response_{status}_{self.unique_id}", type_=response["model"], mode="serialization"
            )


class HealthOut(BaseModel):
    status: str = Field(description="alive")
    service: str


class ReadinessOut(BaseModel):
    status: str = Field(description="ready, or not ready")
    service: str
    reason: str | None = Field(None, description="why not ready: starting, loading, shutting down")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` (an engine call) unless the HTTP client disconnects first: then ``work`` is cancelled, so the
    engine stops generating for nobody, and :class:`ClientDisconnected` is raised (its 499 reaches no one).

    Call it after the body has been read (a FastAPI body parameter has been): from then on the only message
    uvicorn's ``receive()`` delivers is ``http.disconnect``, when the connection closes.
    """
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (shutdown): the work goes too
        watcher.cancel()
        task.cancel()
        raise
    watcher.cancel()
    if not task.done():  # the client left: stop the work
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise ClientDisconnected("the client closed the connection before the answer; the request was cancelled")
    return task.result()


def _finite(v: Any) -> Any:
    """NaN / inf -> None, recursively: what pydantic's JSON serialisation did for these fields."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def json_response(data: Any, status_code: int = 200) -> Response:
    """A JSON response of plain data (dicts, lists, str, int, float, bool, None), rendered once with the stdlib.

    Non-finite floats are not JSON: they become null (the rare case pays a second pass).
    """
    try:
        body = json.dumps(data, allow_nan=False, separators=(",", ":"))
    except ValueError:
        body = json.dumps(_finite(data), allow_nan=False, separators=(",", ":"))
    return Response(body.encode(), status_code=status_code, media_type="application/json")


async def _call_readiness(fn: Callable[[], Any] | None) -> bool:
    if fn is None:
        return True
    r = fn()
    if inspect.isawaitable(r):
        r = await r
    return bool(r)


def create_app(
    name: str,
    settings: ServiceSettings,
    metrics: ServiceMetrics | None = None,
    *,
    title: str | None = None,
    description: str = "",
    version: str = "1",
    readiness: Callable[[], Any] | None = None,
) -> FastAPI:
    """A FastAPI app with health, readiness, metrics, error mapping and the body-size limit."""
    metrics = metrics or ServiceMetrics(name)
    app = FastAPI(title=title or f"rlhf {name}", description=description, version=version)
    app.router.route_class = ContractRoute  # every route documents the errors it can answer with
    app.state.service_name = name
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.readiness = readiness
    app.state.not_ready_reason = "starting"
    install_http_errors(app, metrics)
    # Starlette runs the last added middleware first: the body limit sees the request before anything else.
    app.add_middleware(MetricsMiddleware, metrics=metrics, router=app.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, metrics=metrics)

    @app.get("/healthz", tags=["health"], summary="liveness: 200 while the process runs", response_model=HealthOut)
    async def healthz() -> dict[str, str]:
        return {"status": "alive", "service": name}

    @app.get(
        "/readyz",
        tags=["health"],
        summary="readiness: 200 when ready to serve, else 503",
        response_model=ReadinessOut,
        response_model_exclude_none=True,
        responses={503: {"model": ReadinessOut, "description": "not ready (starting, loading, or shutting down)"}},
    )
    async def readyz():
        if await _call_readiness(app.state.readiness):
            return {"status": "ready", "service": name}
        reason = getattr(app.state, "not_ready_reason", "") or "not ready"
        return JSONResponse({"status": "not ready", "service": name, "reason": reason}, status_code=503)

    @app.get(
        "/metrics",
        tags=["health"],
        summary="Prometheus metrics (text format)",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"}},
    )
    async def prometheus_metrics() -> Response:
        body, ctype = metrics.render()
        return Response(content=body, media_type=ctype)

    return app
