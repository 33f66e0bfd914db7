"""rlhf.serving: gRPC + HTTP in one loop, health, readiness, errors, auth, limits, metrics, TLS, graceful stop.

Most tests run a toy service in-process (no model); the SIGTERM tests run the reward service as a real process.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time

import grpc
import httpx
import pytest
from fastapi import Depends
from grpc_health.v1 import health_pb2, health_pb2_grpc
from uvicorn.protocols.http.h11_impl import H11Protocol

from rlhf.procs import free_port as _free_port
from rlhf.serving import (
    ERROR_TABLE,
    KNOWN_ENV_VARS,
    InvalidArgument,
    NotReady,
    PayloadTooLarge,
    RLHFError,
    ServiceMetrics,
    ServiceRunner,
    ServiceSettings,
    grpc_auth_metadata,
    grpc_errors,
    http_token_dependency,
    require_grpc_token,
    unknown_env_vars,
)
from rlhf.serving import errors as errors_mod
from rlhf.serving.http import create_app
from rlhf.v1 import common_pb2, reward_pb2, reward_pb2_grpc
from services import cli

TOKEN = "s3cret-token"


# ---------------------------------------------------------------- unit-ish


def test_error_table_covers_every_error_class():
    classes = [c for c in vars(errors_mod).values() if isinstance(c, type) and issubclass(c, RLHFError)]
    for cls in classes:
        assert cls in ERROR_TABLE, f"{cls.__name__} has no row in ERROR_TABLE"
    assert ERROR_TABLE[InvalidArgument] == (grpc.StatusCode.INVALID_ARGUMENT, 400)
    assert ERROR_TABLE[PayloadTooLarge] == (grpc.StatusCode.RESOURCE_EXHAUSTED, 413)
    assert ERROR_TABLE[NotReady] == (grpc.StatusCode.UNAVAILABLE, 503)
    assert errors_mod.status_for(ValueError("x")) == (grpc.StatusCode.INTERNAL, 500)


def test_settings_from_env_and_flags():
    env = {
        "RLHF_GRPC_PORT": "6000",
        "RLHF_HTTP_PORT": "7000",
        "RLHF_ROLLOUT_ADDRS": "a:1, b:2,",
        "RLHF_API_TOKEN": TOKEN,
        "RLHF_MAX_BODY_BYTES": "1234",
        "RLHF_LOG_LEVEL": "DEBUG",
    }
    s = ServiceSettings.from_env(env, http_port=7001, host=None)
    assert (s.grpc_port, s.http_port, s.host) == (6000, 7001, "0.0.0.0")
    assert s.rollout_addrs == ["a:1", "b:2"]
    assert s.max_body_bytes == 1234 and s.log_level == "debug"
    assert TOKEN not in repr(s)  # secrets stay out of logs
    d = ServiceSettings.from_env({})
    assert (d.grpc_port, d.http_port, d.max_message_bytes, d.max_body_bytes, d.shutdown_grace_s) == (
        50051,
        8000,
        64 << 20,
        8 << 20,
        10.0,
    )
    with pytest.raises(ValueError, match="RLHF_GRPC_PORT"):
        ServiceSettings.from_env({"RLHF_GRPC_PORT": "http"})
    with pytest.raises(ValueError, match="--http-port"):
        ServiceSettings.from_env({}, http_port=-1)
    with pytest.raises(ValueError, match="RLHF_TLS_KEY"):
        ServiceSettings.from_env({"RLHF_TLS_CERT": "/x.pem"})
    for name in ServiceSettings.model_fields:
        assert "RLHF_" + name.upper() in KNOWN_ENV_VARS
    assert unknown_env_vars({"RLHF_GRPC_PROT": "1", "RLHF_GRPC_PORT": "1", "PATH": "/"}) == ["RLHF_GRPC_PROT"]


def test_settings_from_the_process_environment(monkeypatch):
    """Without a mapping the process's environment is read (pydantic-settings' source); a flag still wins, and a
    mapping given to another call does not leak into it."""
    monkeypatch.setenv("RLHF_GRPC_PORT", "6100")
    monkeypatch.setenv("RLHF_ROLLOUT_ADDRS", "r0:1,r1:2")
    monkeypatch.setenv("RLHF_RUN_DIR", "/runs/a")
    s = ServiceSettings.from_env(grpc_port=6200)
    assert (s.grpc_port, s.rollout_addrs, s.run_dir) == (6200, ["r0:1", "r1:2"], "/runs/a")
    assert ServiceSettings.from_env({"RLHF_HTTP_PORT": "7100"}).grpc_port == 50051  # the mapping alone
    assert ServiceSettings.from_env().grpc_port == 6100
    with pytest.raises(ValueError, match="RLHF_RUN_ID"):
        ServiceSettings.from_env({"RLHF_RUN_ID": ["not", "text"]})


# ---------------------------------------------------------------- toy service


class ToyServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, settings: ServiceSettings, metrics: ServiceMetrics):
        self.settings, self.metrics = settings, metrics
        self.peers: list[str] = []  # the client address of each call

    @grpc_errors("Score")
    async def Score(self, request, context):
        self.peers.append(context.peer())
        if not request.items:
            raise InvalidArgument("items is empty: send at least one item", "items")
        prompt = request.items[0].prompt
        if prompt == "admin":
            require_grpc_token(context, self.settings)
        elif prompt == "boom":
            raise RuntimeError("kaboom with internals")
        elif prompt == "slow":
            await asyncio.sleep(1.0)
        return reward_pb2.ScoreResponse(results=[reward_pb2.ScoreResult(score=1.0, status=common_pb2.ITEM_STATUS_OK)])


def toy_runner(**overrides) -> ServiceRunner:
    base = dict(
        host="127.0.0.1", grpc_port=0, http_port=0, shutdown_grace_s=3, max_body_bytes=1000, max_message_bytes=4096
    )
    base.update(overrides)
    settings = ServiceSettings.from_env({}, **base)
    metrics = ServiceMetrics("toy")
    app = create_app("toy", settings, metrics)

    @app.post("/echo")
    async def echo(body: dict) -> dict:
        return body

    @app.post("/slow")
    async def slow() -> dict:
        await asyncio.sleep(1.0)
        return {"done": True}

    @app.post("/boom")
    async def boom() -> dict:
        raise RuntimeError("kaboom with internals")

    @app.post("/admin", dependencies=[Depends(http_token_dependency(settings))])
    async def admin() -> dict:
        return {"ok": True}

    runner = ServiceRunner("toy", settings, metrics)
    runner.servicer = ToyServicer(settings, metrics)
    runner.add_grpc(reward_pb2_grpc.add_RewardServiceServicer_to_server, ["rlhf.v1.RewardService"], runner.servicer)
    runner.set_http_app(app)
    return runner


def run_with(runner: ServiceRunner, body, startup=None, client_kw=None):
    """Run ``runner`` and ``await body(runner, http, channel_factory)``, then stop gracefully."""

    async def main():
        task = asyncio.create_task(runner.run(startup=startup, install_signal_handlers=False))
        await asyncio.wait_for(runner.started.wait(), 10)
        scheme = "https" if runner.settings.tls else "http"
        async with httpx.AsyncClient(base_url=f"{scheme}://127.0.0.1:{runner.http_port}", **(client_kw or {})) as http:
            try:
                return await body(runner, http)
            finally:
                runner.request_stop()
                await asyncio.wait_for(task, 15)

    return asyncio.run(main())


def channel(runner: ServiceRunner) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{runner.grpc_port}")


def test_health_readiness_and_metrics():
    release = asyncio.Event()

    async def startup():
        await release.wait()

    async def body(runner, http):
        assert (await http.get("/healthz")).status_code == 200
        r = await http.get("/readyz")
        assert r.status_code == 503 and r.json()["reason"] == "starting"
        async with channel(runner) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            resp = await health.Check(health_pb2.HealthCheckRequest(service="rlhf.v1.RewardService"))
            assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
            release.set()
            for _ in range(100):
                if (await http.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            assert (await http.get("/readyz")).status_code == 200
            resp = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            await stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="p")]))
        await http.post("/echo", json={"a": 1})
        text = (await http.get("/metrics")).text
        assert 'rlhf_requests_total{code="200",method="/echo",protocol="http",service="toy"} 1.0' in text
        assert 'rlhf_requests_total{code="OK",method="Score",protocol="grpc",service="toy"} 1.0' in text
        assert "rlhf_request_seconds_bucket" in text and 'rlhf_ready{service="toy"} 1.0' in text

    run_with(toy_runner(), body, startup=startup)


def test_errors_map_to_grpc_and_http_and_service_keeps_serving():
    async def body(runner, http):
        async with channel(runner) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Score(reward_pb2.ScoreRequest())
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "items" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="boom")]))
            assert e.value.code() == grpc.StatusCode.INTERNAL and "internals" not in e.value.details()
            # over RLHF_MAX_MESSAGE_BYTES (4096 here)
            big = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="x" * 10_000)])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Score(big)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            ok = await stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="p")]))
            assert ok.results[0].score == 1.0
        r = await http.post("/boom")
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal"
        assert "internals" not in r.text
        r = await http.post("/echo", content=b"[1, 2")
        assert r.status_code == 422 and r.json()["error"]["field"] == "body"
        r = await http.get("/nowhere")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found"
        r = await http.get("/echo")
        assert r.status_code == 405
        assert (await http.post("/echo", json={"a": 1})).json() == {"a": 1}
        text = (await http.get("/metrics")).text
        assert 'rlhf_errors_total{kind="invalid_argument",service="toy"} 1.0' in text
        assert 'rlhf_errors_total{kind="internal",service="toy"}' in text

    run_with(toy_runner(), body)


def test_body_limit_413_before_reading():
    async def body(runner, http):
        r = await http.post(
            "/echo", content=b'{"a": "' + b"x" * 5000 + b'"}', headers={"content-type": "application/json"}
        )
        assert r.status_code == 413
        err = r.json()["error"]
        assert err["type"] == "payload_too_large" and "1000" in err["message"] and err["field"] == "body"

        async def chunks():  # no Content-Length: counted while streaming
            for _ in range(10):
                yield b" " * 300

        r = await http.post("/echo", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        # a huge declared length is answered at once, without waiting for (or reading) the body
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", runner.http_port)
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000000000\r\n\r\n{"
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert head.startswith(b"HTTP/1.1 413"), head
        assert time.perf_counter() - t0 < 2
        assert 'rlhf_errors_total{kind="payload_too_large",service="toy"} 3.0' in (await http.get("/metrics")).text

    run_with(toy_runner(), body)


def test_token_required_for_protected_calls():
    async def body(runner, http):
        assert (await http.post("/admin")).status_code == 401
        r = await http.post("/admin", headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["field"] == "authorization"
        assert r.headers["www-authenticate"] == "Bearer"
        assert (await http.post("/admin", headers={"Authorization": f"Bearer {TOKEN}"})).json() == {"ok": True}
        async with channel(runner) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            req = reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="admin")])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Score(req)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Score(req, metadata=grpc_auth_metadata("wrong"))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await stub.Score(req, metadata=grpc_auth_metadata(TOKEN))

    run_with(toy_runner(api_token=TOKEN), body)


def test_protected_calls_refused_when_server_has_no_token():
    async def body(runner, http):
        r = await http.post("/admin", headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403 and "RLHF_API_TOKEN" in r.json()["error"]["message"]
        async with channel(runner) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await reward_pb2_grpc.RewardServiceStub(ch).Score(
                    reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="admin")]),
                    metadata=grpc_auth_metadata("anything"),
                )
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED

    run_with(toy_runner(), body)


def test_graceful_stop_lets_inflight_requests_finish():
    seen: list = []  # the stop hook's view: readiness, and whether the requests in flight were still running

    async def body(runner, http):
        runner.add_stop_hook(lambda: seen.append((runner._ready, g.done(), h.done())))
        async with channel(runner) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            g = asyncio.ensure_future(stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="slow")])))
            h = asyncio.create_task(http.post("/slow"))
            await asyncio.sleep(0.3)
            t0 = time.perf_counter()
            runner.request_stop()
            await asyncio.sleep(0.1)
            with pytest.raises(httpx.ConnectError):  # no new connections while draining
                await httpx.AsyncClient().get(f"http://127.0.0.1:{runner.http_port}/readyz")
            assert (await h).json() == {"done": True}
            assert (await g).results[0].score == 1.0
            assert time.perf_counter() - t0 < 3
            # readiness off first, then the hook (the rollout worker stops reading), then the drain
            assert seen == [(False, False, False)]

    run_with(toy_runner(), body)


@pytest.mark.parametrize("age_s", [None, 0.4])
def test_max_connection_age_moves_a_client_to_new_connections(age_s):
    """RLHF_GRPC_MAX_CONNECTION_AGE_S: the server ends each client connection after about that age, so a long-lived
    channel (a rollout replica's to reward) reconnects through the Service and reaches replicas added since (the
    chart sets it on reward and reference, docs/deploy.md#scaling-signals). A call in flight is not cut."""
    item = reward_pb2.ScoreItem(prompt="p")

    async def body(runner, http):
        async with channel(runner) as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            slow = asyncio.ensure_future(
                stub.Score(reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="slow")]))
            )
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                assert (await stub.Score(reward_pb2.ScoreRequest(items=[item]))).results[0].score == 1.0
                await asyncio.sleep(0.05)
            assert (await slow).results[0].score == 1.0  # 1 s, across an age: finished, not cut
        return runner.servicer.peers

    peers = run_with(toy_runner(grpc_max_connection_age_s=age_s), body)
    assert len(peers) > 20
    if age_s is None:
        assert len(set(peers)) == 1, "one connection for the channel's life"
    else:
        assert len(set(peers)) >= 3, f"a new connection about every {age_s} s: {sorted(set(peers))}"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_for_grpc_and_http(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subj = ["-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]
    key_args = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    cmd = ["openssl", "req", "-x509", *key_args, "-keyout", str(key), "-out", str(cert), "-days", "1", *subj]
    subprocess.run(cmd, check=True, capture_output=True)

    async def body(runner, http):
        assert (await http.get("/healthz")).status_code == 200
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{runner.grpc_port}", creds, options=[("grpc.ssl_target_name_override", "localhost")]
        ) as ch:
            resp = await reward_pb2_grpc.RewardServiceStub(ch).Score(
                reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="p")])
            )
            assert resp.results[0].score == 1.0
        async with httpx.AsyncClient(verify=False) as plain:  # only checks plain HTTP is refused
            with pytest.raises(httpx.HTTPError):
                await plain.get(f"http://127.0.0.1:{runner.http_port}/healthz")

    ctx = ssl.create_default_context(cafile=str(cert))
    # grace 1 s: an idle keep-alive TLS connection holds the stop for the grace period (close_notify)
    run_with(toy_runner(tls_cert=str(cert), tls_key=str(key), shutdown_grace_s=1), body, client_kw={"verify": ctx})


def test_undecodable_protobuf_is_invalid_argument():
    """Garbage request bytes are the client's mistake: INVALID_ARGUMENT on every method (it was UNKNOWN/INTERNAL)."""

    async def body(runner, http):
        async with channel(runner) as ch:
            for method in ("/rlhf.v1.RewardService/Score", "/grpc.health.v1.Health/Check"):
                raw = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await raw(b"\xff\xff\xff\x0f")
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value)
                assert "not a valid protobuf message" in e.value.details()
            # still serving, and a valid message still decodes
            resp = await reward_pb2_grpc.RewardServiceStub(ch).Score(
                reward_pb2.ScoreRequest(items=[reward_pb2.ScoreItem(prompt="p")])
            )
            assert resp.results[0].score == 1.0

    run_with(toy_runner(), body)


async def _raw_http(port: int, chunks: list[bytes], pause: float, deadline: float) -> tuple[bytes, float]:
    """Send ``chunks`` with ``pause`` between them (stopping when the server closes); returns what the server sent
    and how long the connection stayed open (up to ``deadline`` s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.perf_counter()
    got = b""

    async def trickle():
        for c in chunks:
            writer.write(c)
            await writer.drain()
            await asyncio.sleep(pause)

    sender = asyncio.create_task(trickle())
    try:
        while time.perf_counter() - t0 < deadline:
            data = await asyncio.wait_for(reader.read(65536), deadline)
            if not data:
                break
            got += data
    except (TimeoutError, ConnectionError):
        pass
    finally:
        sender.cancel()
        writer.close()
    return got, time.perf_counter() - t0


@pytest.mark.parametrize("impl", ["auto", "h11"])
def test_slow_clients_are_closed_within_the_read_timeouts(impl, monkeypatch):
    """Slowloris: headers sent one byte at a time get 408 and a closed connection after the header timeout; a body
    that trickles is cut after the body timeout. A complete request that is slow to serve is not affected. On both
    of uvicorn's HTTP implementations (auto: httptools when installed)."""
    if impl == "h11":
        monkeypatch.setattr("rlhf.serving.http_deadline._base_protocol", lambda: H11Protocol)
    request = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 20\r\n\r\n"

    async def body(runner, http):
        port = runner.http_port
        headers = [request[i : i + 1] for i in range(len(request))]
        got, held = await _raw_http(port, headers, pause=0.1, deadline=10)
        assert got.startswith(b"HTTP/1.1 408"), got
        assert 0.9 < held < 2.5, held
        got, held = await _raw_http(port, [request] + [b" "] * 20, pause=0.2, deadline=10)
        assert got == b"" and 0.9 < held < 2.5, (got, held)  # cut: the app never answered
        # idle connections (nothing sent at all) are closed too
        got, held = await _raw_http(port, [], pause=0, deadline=10)
        assert got.startswith(b"HTTP/1.1 408") and held < 2.5, (got, held)
        # received in time, slow to serve (1 s, like the body timeout): answered
        r = await http.post("/slow")
        assert r.status_code == 200 and r.json() == {"done": True}
        # a keep-alive connection serves request after request
        for _ in range(3):
            assert (await http.post("/echo", json={"a": 1})).json() == {"a": 1}
            await asyncio.sleep(0.5)

    run_with(toy_runner(http_header_timeout_s=1.0, http_body_timeout_s=1.0), body)


# ---------------------------------------------------------------- real process


SLOW_RULE_CONFIG = {
    "reward": {"scorers": [{"type": "rule", "name": "_slow_rule:slow", "kwargs": {"delay": 1.5}}]},
}


def test_sigterm_graceful_shutdown_of_a_real_service(start_service, tmp_path):
    rule_dir = tmp_path / "rules"
    rule_dir.mkdir()
    (rule_dir / "_slow_rule.py").write_text(
        "import time\n\ndef slow(prompt, response, label, delay=1.0):\n    time.sleep(delay)\n    return 1.0\n"
    )

    env = {
        "PYTHONPATH": os.pathsep.join([str(rule_dir), os.environ.get("PYTHONPATH", "")]),
        "RLHF_BOGUS_SETTING": "1",
        "RLHF_SHUTDOWN_GRACE_S": "5",
    }
    svc = start_service("reward", SLOW_RULE_CONFIG, env=env)
    result: dict = {}

    def call():
        r = httpx.post(svc.http_url + "/v1/score", json={"items": [{"prompt": "p", "response": "r"}]}, timeout=10)
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=call)
    t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    svc.signal()
    t.join(10)
    code = svc.wait(10)
    elapsed = time.monotonic() - t0
    assert result["status"] == 200 and result["body"]["results"][0] == {
        "score": 1.0,
        "status": "ok",
        "error": None,
        "components": {"slow": 1.0},
    }
    assert code == 0, svc.log_tail()
    assert elapsed < 5, elapsed
    log = svc.log_text()
    assert "SIGTERM received" in log and "stopped" in log
    assert "unknown environment variable RLHF_BOGUS_SETTING" in log
    with pytest.raises(httpx.HTTPError):
        httpx.get(svc.http_url + "/healthz", timeout=1)


def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for kind in ("grpc", "http"):
            runner = toy_runner(**{f"{kind}_port": port})
            with pytest.raises(OSError, match=f"cannot bind {'gRPC' if kind == 'grpc' else 'HTTP'} port"):
                asyncio.run(runner.run(install_signal_handlers=False))


def test_cli_help_and_client_errors(capsys, tmp_path):
    for argv in (["--help"], ["serve", "--help"], ["score", "--help"], ["logprobs", "--help"], ["generate", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "serve" in out and "--grpc-port" in out and "/v1/score" in out and "/v1/logprobs" in out
    assert cli.main(["score", "--url", f"http://127.0.0.1:{_free_port()}", "--prompt", "p", "--response", "r"]) == 1
    assert "cannot reach" in capsys.readouterr().err
    assert cli.main(["serve", "reward", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "nosuchservice", "--config", "x"])
