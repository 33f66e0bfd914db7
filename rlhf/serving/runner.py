"""One process, one asyncio loop: a grpc.aio server and a FastAPI app under uvicorn, on the configured ports (life
cycle: docs/services.md#common-to-every-service)::

    runner = ServiceRunner("reward", settings, metrics)
    runner.add_grpc(reward_pb2_grpc.add_RewardServiceServicer_to_server, ["rlhf.v1.RewardService"], servicer)
    runner.set_http_app(build_app(engine, settings, metrics))
    await runner.run(startup=engine.load_async)   # returns after SIGTERM/SIGINT and a graceful stop
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from rlhf.serving.errors import DecodeErrorInterceptor
from rlhf.serving.http_deadline import deadline_protocol
from rlhf.serving.metrics import ServiceMetrics
from rlhf.serving.settings import ServiceSettings

log = logging.getLogger("rlhf.serving")

ReadinessCheck = Callable[[], "bool | Awaitable[bool]"]

# An idle keep-alive connection is closed after this (uvicorn's default, stated here because it bounds idle fds).
KEEP_ALIVE_S = 5
# Request line + headers (h11; httptools has its own fixed limit): ours are a few hundred bytes.
MAX_HEADER_BYTES = 16 * 1024


def grpc_options(settings: ServiceSettings) -> list[tuple[str, Any]]:
    """Channel/server options: bounded message sizes, keepalive suited to long-lived peers."""
    n = settings.max_message_bytes
    return [
        ("grpc.max_receive_message_length", n),
        ("grpc.max_send_message_length", n),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def client_credentials(settings: ServiceSettings | None) -> grpc.ChannelCredentials | None:
    """The credentials of this service's gRPC clients: TLS (roots ``RLHF_TLS_CA``, else the system's) when the
    settings say the ring runs TLS (:attr:`ServiceSettings.client_tls`), else None (plaintext)."""
    if settings is None or not settings.client_tls:
        return None
    roots = Path(settings.tls_ca).read_bytes() if settings.tls_ca else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def client_ssl_context(settings: ServiceSettings | None) -> ssl.SSLContext | None:
    """The same choice for HTTP clients (``rlhf up`` polling ``/readyz``): an ``ssl.SSLContext`` or None."""
    if settings is None or not settings.client_tls:
        return None
    return ssl.create_default_context(cafile=settings.tls_ca)


def open_channel(
    target: str, settings: ServiceSettings | None = None, *, tls_ca: str | None = None, server_name: str | None = None
) -> grpc.aio.Channel:
    """Client side: a grpc.aio channel to a peer service with the same message-size bounds; TLS when the settings
    say so (:func:`client_credentials`) or when ``tls_ca`` names a CA bundle. Every client channel of the services
    is opened here (the trainer's weight pushes pass :func:`client_credentials` to ``push_weights``).
    ``server_name``: the name the peer's certificate must carry when ``target`` is one resolved address of it."""
    settings = settings or ServiceSettings()
    options = grpc_options(settings)
    if tls_ca:
        settings = settings.model_copy(update={"tls_ca": tls_ca})
    creds = client_credentials(settings)
    if creds is not None:
        if server_name:
            options = [*options, ("grpc.ssl_target_name_override", server_name)]
        return grpc.aio.secure_channel(target, creds, options=options)
    return grpc.aio.insecure_channel(target, options=options)


class _Uvicorn:
    """uvicorn.Server that leaves signals to the runner (uvicorn's own handlers would re-raise SIGTERM on exit)."""

    @staticmethod
    def make(config: Any) -> Any:
        import uvicorn  # noqa: PLC0415 - uvicorn: only HTTP-serving processes

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # uvicorn hook
                yield

        return Server(config)


def _bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY on accepted connections only then (else Nagle + delayed ACK add
    # 40 ms to every keep-alive response)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot bind HTTP port {host}:{port}: {err.strerror} (set --http-port)") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class ServiceRunner:
    """Runs one service: gRPC (+ grpc.health.v1) and HTTP in the current asyncio loop."""

    def __init__(self, name: str, settings: ServiceSettings, metrics: ServiceMetrics | None = None):
        self.name = name
        self.settings = settings
        self.metrics = metrics or ServiceMetrics(name)
        self._grpc_adders: list[tuple[Callable, Any]] = []
        self._service_names: list[str] = []
        self._app: Any = None
        self._ready = False
        self._reason = "starting"
        self._checks: list[ReadinessCheck] = []
        self._stop_hooks: list[Callable[[], Any]] = []
        self._stop = asyncio.Event()  # not bound to a loop until first awaited (3.10+)
        self._health: HealthServicer | None = None
        self._health_status: int | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.http_server: Any = None
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self.started = asyncio.Event()

    # ------------------------------------------------------------------------------------------------ registration

    def add_grpc(self, add_fn: Callable, service_full_names: Iterable[str], servicer: Any = None) -> None:
        """Register a servicer: ``add_fn(servicer, server)`` (the generated ``add_XServicer_to_server``) when
        ``servicer`` is given, else ``add_fn(server)``. ``service_full_names`` (``rlhf.v1.RewardService``) get a
        grpc.health.v1 status."""
        self._grpc_adders.append((add_fn, servicer))
        self._service_names.extend(service_full_names)

    def set_http_app(self, app: Any) -> None:
        """The FastAPI app (from :func:`rlhf.serving.create_app`); its ``/readyz`` will follow this runner."""
        self._app = app
        app.state.readiness = self.is_ready
        app.state.runner = self

    def add_readiness_check(self, check: ReadinessCheck) -> None:
        """An extra condition for readiness (Redis reachable, peers up); sync or async, returning bool."""
        self._checks.append(check)

    def add_stop_hook(self, hook: Callable[[], Any]) -> None:
        """``hook()`` runs as a stop begins, with readiness off and before the servers stop: what must stop taking
        work at once (the rollout worker's queue reads) rather than after the servers' grace period."""
        self._stop_hooks.append(hook)

    # ------------------------------------------------------------------------------------------------ readiness

    def set_ready(self, ready: bool, reason: str = "") -> None:
        self._ready = bool(ready)
        self._reason = "" if ready else (reason or "not ready")
        if self._app is not None:
            self._app.state.not_ready_reason = self._reason
        self.metrics.set_ready(self._ready)
        self._schedule_health_update(self._ready)

    async def is_ready(self) -> bool:
        if not self._ready:
            return False
        for check in self._checks:
            try:
                r = check()
                if inspect.isawaitable(r):
                    r = await r
            except Exception:  # a failing check means not ready
                log.debug("%s: readiness check raised", self.name, exc_info=True)
                r = False
            if not r:
                if self._app is not None:
                    self._app.state.not_ready_reason = "a readiness check failed (peer or Redis not reachable?)"
                return False
        return True

    def _schedule_health_update(self, serving: bool) -> None:
        if self._health is None:
            return
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if status == self._health_status:
            return
        self._health_status = status
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        loop.create_task(self._set_health(status))

    async def _set_health(self, status: int) -> None:
        if self._health is None:
            return
        for svc in ["", *self._service_names]:
            await self._health.set(svc, status)

    async def _watch_readiness(self) -> None:
        """Keep grpc.health in step with the readiness checks."""
        while True:
            await asyncio.sleep(1.0)
            if self._checks and self._ready:
                ok = await self.is_ready()
                self.metrics.set_ready(ok)
                self._schedule_health_update(ok)

    # ------------------------------------------------------------------------------------------------ stop

    def request_stop(self) -> None:
        """Begin the graceful stop (what SIGTERM does)."""
        self._stop.set()

    # ------------------------------------------------------------------------------------------------ run

    async def _start_grpc(self) -> None:
        s = self.settings
        # so_reuseport 0: a second process on the same port is an error, not a silent load-balancing partner
        # min_recv_ping_interval: accept the 60 s keepalive pings of open_channel() clients (the default 5 min
        # would answer them with GOAWAY "too_many_pings")
        server_options = [
            *grpc_options(s),
            ("grpc.so_reuseport", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 30_000),
        ]
        if s.grpc_max_connection_age_s:  # no max_connection_age_grace: a call in flight is never cut
            server_options.append(("grpc.max_connection_age_ms", int(s.grpc_max_connection_age_s * 1000)))
        server = grpc.aio.server(options=server_options, interceptors=[DecodeErrorInterceptor()])
        for add_fn, servicer in self._grpc_adders:
            if servicer is not None:
                add_fn(servicer, server)
            else:
                add_fn(server)
        self._health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        hc = health_pb2.HealthCheckResponse
        self._health_status = hc.SERVING if self._ready else hc.NOT_SERVING  # set_ready() may have come first
        await self._set_health(self._health_status)
        addr = f"[{s.host}]:{s.grpc_port}" if ":" in s.host else f"{s.host}:{s.grpc_port}"
        try:
            if s.tls:
                creds = grpc.ssl_server_credentials([(Path(s.tls_key).read_bytes(), Path(s.tls_cert).read_bytes())])
                port = server.add_secure_port(addr, creds)
            else:
                port = server.add_insecure_port(addr)
        except RuntimeError as err:
            raise OSError(f"cannot bind gRPC port {addr}: {err} (set --grpc-port)") from None
        if port == 0:
            raise OSError(f"cannot bind gRPC port {addr} (in use?); set --grpc-port")
        await server.start()
        self.grpc_server, self.grpc_port = server, port

    async def _start_http(self) -> asyncio.Task | None:
        if self._app is None:
            return None
        import uvicorn  # noqa: PLC0415 - uvicorn: only HTTP-serving processes

        s = self.settings
        sock = _bind_socket(s.host, s.http_port)
        self.http_port = sock.getsockname()[1]

        config = uvicorn.Config(
            self._app,
            # slow clients: a request's headers and body must arrive within these (uvicorn has no such limit)
            http=deadline_protocol(s.http_header_timeout_s, s.http_body_timeout_s),
            timeout_keep_alive=KEEP_ALIVE_S,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            log_level=s.log_level if s.log_level != "info" else "warning",
            access_log=s.log_level == "debug",
            timeout_graceful_shutdown=max(1, int(round(s.shutdown_grace_s))) if s.shutdown_grace_s else None,
            ssl_certfile=s.tls_cert if s.tls else None,
            ssl_keyfile=s.tls_key if s.tls else None,
            lifespan="off",
            server_header=False,
            log_config=None,
        )
        self.http_server = _Uvicorn.make(config)
        task = asyncio.create_task(self.http_server.serve(sockets=[sock]), name=f"{self.name}-http")
        while not self.http_server.started:
            if task.done():
                task.result()  # raises the start-up error
                raise RuntimeError("HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        return task

    async def run(
        self,
        startup: Callable[[], Awaitable[Any]] | None = None,
        shutdown: Callable[[], Awaitable[Any] | Any] | None = None,
        *,
        install_signal_handlers: bool = True,
    ) -> None:
        """Start both servers, run ``startup``, become ready, serve until SIGTERM/SIGINT, stop gracefully."""
        loop = asyncio.get_running_loop()
        installed: list[int] = []
        if install_signal_handlers:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError):  # not the main thread
                    pass
        http_task = None
        watcher = None
        startup_task = None
        try:
            await self._start_grpc()
            http_task = await self._start_http()
            log.info(
                "%s: gRPC on %s:%s, HTTP on %s:%s%s",
                self.name,
                self.settings.host,
                self.grpc_port,
                self.settings.host,
                self.http_port,
                " (TLS)" if self.settings.tls else "",
            )
            self.started.set()
            watcher = asyncio.create_task(self._watch_readiness())
            if startup is not None:
                startup_task = asyncio.create_task(startup())
                stop_wait = asyncio.create_task(self._stop.wait())
                done, _ = await asyncio.wait({startup_task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
                if startup_task in done:
                    startup_task.result()  # start-up failure: raise (the process exits non-zero)
                    startup_task = None
            if not self._stop.is_set():
                if startup is not None or not self._ready:
                    self.set_ready(True)
                log.info("%s: ready", self.name)
                stop_wait = asyncio.create_task(self._stop.wait())
                waits = {stop_wait} | ({http_task} if http_task else set())
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
                if http_task in done and not self._stop.is_set():
                    http_task.result()
                    raise RuntimeError("the HTTP server stopped unexpectedly")
        finally:
            await self._graceful_stop(http_task, startup_task, watcher, shutdown)
            for sig in installed:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        if self._stop.is_set():
            log.warning("%s: second %s: stopping now", self.name, signal.Signals(sig).name)
            if self.http_server is not None:
                self.http_server.force_exit = True
            return
        log.info(
            "%s: %s received: stopping gracefully (grace %.1fs)",
            self.name,
            signal.Signals(sig).name,
            self.settings.shutdown_grace_s,
        )
        self.request_stop()

    async def _graceful_stop(self, http_task, startup_task, watcher, shutdown) -> None:
        self.set_ready(False, "shutting down")
        for hook in self._stop_hooks:
            try:
                hook()
            except Exception:
                log.exception("%s: error in a stop hook", self.name)
        if self._health is not None:
            with contextlib.suppress(Exception):
                await self._health.enter_graceful_shutdown()
        for t in (startup_task, watcher):
            if t is not None and not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        grace = self.settings.shutdown_grace_s
        stops: list[Awaitable] = []
        if self.grpc_server is not None:
            stops.append(self.grpc_server.stop(grace))
        if http_task is not None and self.http_server is not None:
            self.http_server.should_exit = True

            async def _wait_http() -> None:
                try:
                    await asyncio.wait_for(asyncio.shield(http_task), timeout=grace + 5)
                except TimeoutError:
                    self.http_server.force_exit = True
                    with contextlib.suppress(BaseException):
                        await http_task
                except BaseException:  # noqa: BLE001 - already stopping
                    pass

            stops.append(_wait_http())
        if stops:
            await asyncio.gather(*stops, return_exceptions=True)
        if shutdown is not None:
            try:
                r = shutdown()
                if inspect.isawaitable(r):
                    await r
            except Exception:
                log.exception("%s: error in shutdown hook", self.name)
        log.info("%s: stopped", self.name)


def run_service(coro_factory: Callable[[], Awaitable[Any]]) -> None:
    """Run a service coroutine as the process's main loop (what ``rlhf serve`` does)."""
    asyncio.run(coro_factory())


__all__: Sequence[str] = ("ServiceRunner", "grpc_options", "open_channel", "run_service")
