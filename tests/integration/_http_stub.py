"""A local JSON-over-HTTP server for tests of the HTTP scorers: a threaded ``http.server`` on a free loopback port
(real sockets, real timeouts), with the handler's routes written by each test module."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import threading
from collections.abc import Iterator


class StubServer(http.server.ThreadingHTTPServer):
    daemon_threads = True


class JSONHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):  # quiet
        pass

    def read_json(self):
        return json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the client gave up (a timeout test)
            self.wfile.write(data)


@contextlib.contextmanager
def serve(handler: type[JSONHandler]) -> Iterator[StubServer]:
    """``handler`` served on 127.0.0.1 (``srv.server_port``) until the block ends."""
    srv = StubServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def score_and_close(engine, items):
    """``engine.score(items)`` on a fresh event loop, then the engine's HTTP clients closed (they belong to it)."""

    async def go():
        try:
            return await engine.score(items)
        finally:
            await engine.close()

    return asyncio.run(go())
