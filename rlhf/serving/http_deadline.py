"""Read deadlines for uvicorn's HTTP connections: a client must send each request in time, or it is closed.

uvicorn's ``timeout_keep_alive`` only covers the idle time after a response, so a client trickling a header byte by
byte (slowloris) would hold a connection, a task and a file descriptor as long as it likes. This wraps uvicorn's
protocol class (httptools or h11) with ``header_timeout`` (late: 408 and closed) and ``body_timeout`` (late: closed,
the app gets ``http.disconnect``); a request received completely is not limited.

Settings (``RLHF_HTTP_HEADER_TIMEOUT_S``, ``RLHF_HTTP_BODY_TIMEOUT_S``): docs/services.md#common-to-every-service.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("rlhf.serving")

_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
)
_408_BODY = (
    b'{"error":{"type":"request_timeout","message":"the request was not received in time","param":null,"field":null,'
    b'"code":408}}'
)


def _base_protocol() -> type:
    """The class uvicorn's ``http="auto"`` would use: httptools when installed, else h11."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # noqa: PLC0415 - uvicorn: only HTTP-serving processes

    return AutoHTTPProtocol


def deadline_protocol(header_timeout: float, body_timeout: float, base: type | None = None) -> type:
    """A subclass of uvicorn's HTTP protocol (``base``, default the auto choice) with the read deadlines; pass it
    as ``uvicorn.Config(http=...)``."""
    base = base or _base_protocol()

    class DeadlineProtocol(base):  # type: ignore[misc, valid-type]
        # Both uvicorn protocols keep the request being served in ``self.cycle`` (a new object once a request's
        # headers are parsed; ``more_body`` False once its body is complete), which is all this relies on.
        _deadline: asyncio.TimerHandle | None = None
        _seen_cycle: Any = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm(header_timeout, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is None or cycle is self._seen_cycle and cycle.response_complete:
                return  # still reading the (next) request's headers: the header deadline runs on
            if cycle is not self._seen_cycle:  # a new request's headers are complete
                self._seen_cycle = cycle
                if cycle.more_body:
                    self._arm(body_timeout, "body")
                else:
                    self._disarm()
            elif not cycle.more_body:
                self._disarm()  # the body is complete

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # a pipelined request may already be in (self.cycle is then the new, unfinished one)
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm(header_timeout, "headers")

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, what: str, seconds: float) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            client = "{}:{}".format(*self.client) if self.client else "a client"
            log.info("closing the connection of %s: its request %s took over %.0f s", client, what, seconds)
            if what == "headers":  # no request started: nothing else will answer
                self.transport.write(_408 % len(_408_BODY) + _408_BODY)
            self.transport.close()

    DeadlineProtocol.__name__ = DeadlineProtocol.__qualname__ = f"Deadline{base.__name__}"
    return DeadlineProtocol
