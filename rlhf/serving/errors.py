"""Domain errors of every service and the ONE table that maps them to gRPC status codes and HTTP statuses.

Engines raise these (``raise InvalidArgument("items[2].response is empty: send at least one token", field=...)``);
the gRPC layer turns them into ``context.abort(code, message)`` (:func:`abort_grpc` / :func:`grpc_errors`) and the
HTTP layer into ``{"error": {"type", "message", "param", "field", "code"}}`` with the matching status
(:func:`install_http_errors`).
A message names the field and says what to change. Anything that is not an ``RLHFError`` is an internal error: its
details go to the log, not to the client.
"""

from __future__ import annotations

import functools
import http
import inspect
import logging
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

if TYPE_CHECKING:  # pragma: no cover
    from fastapi import FastAPI

    from rlhf.serving.metrics import ServiceMetrics

log = logging.getLogger("rlhf.serving")


class RLHFError(Exception):
    """Base class: a message for the client and, when known, the request field at fault (``items[0].prompt``)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field

    @property
    def kind(self) -> str:
        """snake_case name of the class: the ``type`` in HTTP error bodies and the ``kind`` label of error metrics."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()

    def __str__(self) -> str:
        return self.message


class InvalidArgument(RLHFError):
    """The request is wrong (empty, too long, out-of-vocab ids, bad values)."""


class RequestValidationFailed(InvalidArgument):
    """An HTTP body that does not match the schema (pydantic): 422, as FastAPI users expect."""


class MethodNotAllowed(InvalidArgument):
    """An HTTP method the path does not serve (405, with an ``Allow`` header naming the ones it does)."""


class ResourceExhausted(RLHFError):
    """Too many requests / queue full (429)."""


class PayloadTooLarge(ResourceExhausted):
    """A message or body larger than the configured limit (413)."""


class Unauthenticated(RLHFError):
    """No token, or a token that does not match (401)."""


class PermissionDenied(RLHFError):
    """The call is not allowed on this server (for example: no RLHF_API_TOKEN configured, so admin calls are off)."""


class NotReady(RLHFError):
    """The service is starting (model loading) or shutting down: retry later (503 / UNAVAILABLE)."""


class FailedPrecondition(RLHFError):
    """The request conflicts with the server state (stale weights version, paused trainer): 409."""


class NotFound(RLHFError):
    """An unknown resource (scorer, checkpoint, version)."""


class DeadlineExceeded(RLHFError):
    """The work did not finish in time (504)."""


class Internal(RLHFError):
    """A bug or an unexpected failure inside the service (500)."""


class ClientDisconnected(RLHFError):
    """The client went away before the answer; its work was cancelled (499, nginx's "client closed request")."""


# The one table: domain error -> (gRPC status code, HTTP status). Looked up along the MRO, so a subclass
# defined elsewhere inherits its parent's row.
ERROR_TABLE: dict[type[RLHFError], tuple[grpc.StatusCode, int]] = {
    RLHFError: (grpc.StatusCode.INTERNAL, 500),
    InvalidArgument: (grpc.StatusCode.INVALID_ARGUMENT, 400),
    RequestValidationFailed: (grpc.StatusCode.INVALID_ARGUMENT, 422),
    MethodNotAllowed: (grpc.StatusCode.UNIMPLEMENTED, 405),
    ResourceExhausted: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    PayloadTooLarge: (grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
    Unauthenticated: (grpc.StatusCode.UNAUTHENTICATED, 401),
    PermissionDenied: (grpc.StatusCode.PERMISSION_DENIED, 403),
    NotReady: (grpc.StatusCode.UNAVAILABLE, 503),
    FailedPrecondition: (grpc.StatusCode.FAILED_PRECONDITION, 409),
    NotFound: (grpc.StatusCode.NOT_FOUND, 404),
    DeadlineExceeded: (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
    Internal: (grpc.StatusCode.INTERNAL, 500),
    ClientDisconnected: (grpc.StatusCode.CANCELLED, 499),
}


def status_for(err: BaseException) -> tuple[grpc.StatusCode, int]:
    """(gRPC code, HTTP status) of an exception; anything that is not an RLHFError is INTERNAL/500."""
    for cls in type(err).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return grpc.StatusCode.INTERNAL, 500


def as_rlhf_error(err: BaseException) -> RLHFError:
    """Wrap a foreign exception as Internal (logged with its traceback; the client sees a generic message)."""
    if isinstance(err, RLHFError):
        return err
    log.exception("internal error", exc_info=err)
    return Internal(f"internal error ({type(err).__name__}); see the service log")


def error_body(err: RLHFError) -> dict[str, Any]:
    """The HTTP error body, OpenAI's shape: ``param`` is OpenAI's name for the field at fault (the ``openai`` client
    reads it into ``APIError.param``); ``field`` carries the same value for this project's existing clients."""
    _, http_status = status_for(err)
    return {
        "error": {"type": err.kind, "message": err.message, "param": err.field, "field": err.field, "code": http_status}
    }


class ErrorDetail(BaseModel):
    type: str = Field(description="the error's kind, snake_case: invalid_argument, request_validation_failed, ...")
    message: str = Field(description="what is wrong and what to change")
    param: str | None = Field(description="the request field at fault (OpenAI's name for it), when there is one")
    field: str | None = Field(description="the same as param")
    code: int = Field(description="the HTTP status")


class ErrorBody(BaseModel):
    """Every error answer of every service (OpenAI's shape)."""

    error: ErrorDetail


def _http_descriptions() -> dict[int, str]:
    """HTTP status -> what it means here: the docstrings of the error classes that map to it, from ERROR_TABLE."""
    out: dict[int, list[str]] = {}
    for cls, (_, http_status) in ERROR_TABLE.items():
        if cls is not RLHFError and cls.__doc__:
            out.setdefault(http_status, []).append(" ".join(cls.__doc__.split()))
    return {s: " ".join(docs) for s, docs in out.items()}


def http_error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries for error statuses: the :class:`ErrorBody` schema and what the status means.

    ``create_app``'s routes list the statuses every route of their kind can answer with on their own (500; 413 with a
    body; 400 and 422 with input; 401 and 403 behind the token); a route adds the ones particular to it::

        @app.post("/v1/score", responses={200: {...}, **http_error_responses(503)})
    """
    descriptions = _http_descriptions()
    return {
        s: {"model": ErrorBody, "description": descriptions.get(s, http.HTTPStatus(s).phrase)} for s in sorted(statuses)
    }


def grpc_details(err: RLHFError) -> str:
    return f"{err.message} (field: {err.field})" if err.field and err.field not in err.message else err.message


# ----------------------------------------------------------------------------------------------------------------- gRPC


async def abort_grpc(context: grpc.aio.ServicerContext, err: BaseException) -> None:
    """Abort a grpc.aio call with the code of ``err`` (never returns: ``context.abort`` raises)."""
    rerr = as_rlhf_error(err)
    code, _ = status_for(rerr)
    # the error's class travels too, so a client can tell refusals no retry fixes from ones that may pass next time
    meta = [("rlhf-error-type", type(rerr).__name__)]
    if rerr.field:
        meta.append(("rlhf-error-field", rerr.field))
    context.set_trailing_metadata(tuple(meta))
    await context.abort(code, grpc_details(rerr))


def grpc_errors(metrics: ServiceMetrics | str | None = None, method: str | None = None) -> Callable:
    """Decorator for async servicer methods: RLHFError -> abort with its code; other exceptions -> INTERNAL.

    It also records the request count, latency, errors and calls in flight (protocol ``grpc``) in ``metrics``, or,
    when that is not given, in the servicer's ``self.metrics`` attribute if it has one::

        class RewardServicer(reward_pb2_grpc.RewardServiceServicer):
            def __init__(self, engine, metrics):
                self.engine, self.metrics = engine, metrics

            @grpc_errors("Score")          # or grpc_errors(metrics, "Score")
            async def Score(self, request, context): ...

    Unary-unary and stream-unary methods are supported (the request may be an async iterator).
    """
    if isinstance(metrics, str):
        metrics, method = None, metrics
    fixed_metrics = metrics

    def deco(fn: Callable) -> Callable:
        name = method or fn.__name__
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"grpc_errors wraps async servicer methods; {fn.__qualname__} is not async")

        @functools.wraps(fn)
        async def wrapper(self, request, context):
            metrics = fixed_metrics if fixed_metrics is not None else getattr(self, "metrics", None)
            inflight = metrics.inflight_gauge(name, "grpc") if metrics is not None else None
            if inflight is not None:
                inflight.inc()
            t0 = time.perf_counter()
            code = "OK"
            try:
                return await fn(self, request, context)
            except RLHFError as err:
                code = status_for(err)[0].name
                if metrics is not None:
                    metrics.count_error(err.kind)
                await abort_grpc(context, err)
            except Exception as err:  # everything else is internal
                # context.abort raises an AbortError; let it through untouched.
                if type(err).__name__ == "AbortError" or isinstance(err, grpc.aio.AbortError):
                    code = "ABORTED_BY_HANDLER"
                    raise
                code = "INTERNAL"
                if metrics is not None:
                    metrics.count_error("internal")
                await abort_grpc(context, err)
            finally:
                if metrics is not None:
                    inflight.dec()
                    metrics.observe_request(name, "grpc", time.perf_counter() - t0, code)

        return wrapper

    return deco


class _Undecodable:
    """What a request deserializer returns instead of raising (see :class:`DecodeErrorInterceptor`)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _safe_deserializer(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def decode(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as err:  # noqa: BLE001 - DecodeError, or whatever a parser throws at garbage
            return _Undecodable(f"{type(err).__name__}: {err}")

    return decode


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Undecodable request bytes -> INVALID_ARGUMENT (the code of :class:`InvalidArgument`), on every method.

    grpc answers a deserializer that raises with UNKNOWN or INTERNAL, which says "server bug" for what is a client's
    mistake. Each handler's deserializer is wrapped to return a marker instead of raising; the behaviour refuses the
    marker (for client streams: when the iterator reaches it) before any servicer code sees it.
    """

    def __init__(self) -> None:
        # method -> (the handler grpc found, its wrapped copy): the wrapping costs ~30 closures and lookups, and the
        # registered handler of a method is the same object on every call
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        hit = self._wrapped.get(details.method)
        if hit is not None and hit[0] is handler:
            return hit[1]
        wrapped = self._wrap(handler, details.method)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(handler: Any, method: str) -> Any:
        code, _ = status_for(InvalidArgument(""))

        async def refuse(context: grpc.aio.ServicerContext, bad: _Undecodable) -> None:
            await context.abort(
                code,
                f"the request to {method} is not a valid protobuf message ({bad.reason}); "
                "send the message type its .proto file declares",
            )

        def unary(inner: Callable) -> Callable:
            if inspect.isasyncgenfunction(inner):

                async def gen(request, context):
                    if isinstance(request, _Undecodable):
                        await refuse(context, request)
                    async for r in inner(request, context):
                        yield r

                return gen

            async def call(request, context):
                if isinstance(request, _Undecodable):
                    await refuse(context, request)
                return await inner(request, context)

            return call

        def streaming(inner: Callable) -> Callable:
            def checked(requests, context):
                async def it():
                    async for r in requests:
                        if isinstance(r, _Undecodable):
                            await refuse(context, r)
                        yield r

                return it()

            if inspect.isasyncgenfunction(inner):

                async def gen(requests, context):
                    async for r in inner(checked(requests, context), context):
                        yield r

                return gen

            async def call(requests, context):
                return await inner(checked(requests, context), context)

            return call

        kind = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
        name = next(k for k in kind if getattr(handler, k) is not None)
        wrap = streaming if handler.request_streaming else unary
        return handler._replace(
            request_deserializer=_safe_deserializer(handler.request_deserializer),
            **{name: wrap(getattr(handler, name))},
        )


# ----------------------------------------------------------------------------------------------------------------- HTTP


def _loc_to_field(loc: tuple | list) -> str:
    """pydantic ``('body', 'items', 0, 'prompt')`` -> ``items[0].prompt``."""
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        else:
            out += ("." if out else "") + str(p)
    return out or "body"


def validation_error_from_pydantic(errors: list[dict[str, Any]]) -> RequestValidationFailed:
    """FastAPI/pydantic validation errors -> one RequestValidationFailed naming the first bad field."""
    msgs = []
    for e in errors[:5]:
        field = _loc_to_field(e.get("loc", ()))
        if e.get("type") == "extra_forbidden":
            msgs.append(f"{field}: unknown field; remove it (see /openapi.json for the accepted fields)")
        elif e.get("type") == "json_invalid":
            msgs.append(f"{field}: the body is not valid JSON; send a JSON object")
        else:
            msgs.append(f"{field}: {e.get('msg', 'invalid value')}")
    first = _loc_to_field(errors[0].get("loc", ())) if errors else "body"
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return RequestValidationFailed("; ".join(msgs) + more, field=first)


def http_error_response(err: BaseException):
    """A JSONResponse with the error body and status for ``err``."""
    rerr = as_rlhf_error(err)
    _, http_status = status_for(rerr)
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(rerr, Unauthenticated) else None
    return JSONResponse(error_body(rerr), status_code=http_status, headers=headers)


def install_http_errors(app: FastAPI, metrics: ServiceMetrics | None = None) -> None:
    """Exception handlers: RLHFError -> its status; body validation -> 422; HTTPException -> same shape; else 500."""

    def _count(err: RLHFError) -> None:
        if metrics is not None:
            metrics.count_error(err.kind)

    async def on_rlhf(request, exc: RLHFError):
        _count(exc)
        return http_error_response(exc)

    async def on_validation(request, exc: RequestValidationError):
        err = validation_error_from_pydantic(list(exc.errors()))
        _count(err)
        return http_error_response(err)

    async def on_http(request, exc: StarletteHTTPException):
        """Starlette's and FastAPI's own refusals (404 unknown path, 405 method, a body that is not UTF-8) in the same
        body; their headers are kept (405 carries ``Allow``)."""
        if exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            allow = (exc.headers or {}).get("Allow")
            err: RLHFError = MethodNotAllowed(message + (f"; use {allow}" if allow else ""))
        elif exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI: not UTF-8
            err = RequestValidationFailed(
                "body: the body is not valid JSON (not UTF-8 text); send a JSON object", "body"
            )
            return http_error_response(err)  # 422, as for any other body that is not JSON
        else:
            by_status = {cls_status: cls for cls, (_, cls_status) in ERROR_TABLE.items() if cls is not RLHFError}
            cls = by_status.get(exc.status_code) or (InvalidArgument if exc.status_code < 500 else Internal)
            err = cls(str(exc.detail))

        body = error_body(err)
        body["error"]["code"] = exc.status_code
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def on_other(request, exc: Exception):
        err = as_rlhf_error(exc)
        _count(err)
        return http_error_response(err)

    app.add_exception_handler(RLHFError, on_rlhf)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_other)
