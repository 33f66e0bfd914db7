"""The environment service on real gRPC + HTTP servers on loopback: calculator episodes through the client, idempotent
reset and step retries, environments that raise, hang or answer garbage (error kinds and metrics, never a reward),
unknown and expired episodes, the episode bound, the token, and a service killed mid-episode and restarted."""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path

import _environments
import grpc
import httpx
import pytest

from rlhf.config import ConfigError, parse_config
from rlhf.environments.client import EnvironmentClient, EnvironmentFailed, EnvironmentRequestInvalid, EpisodeLost
from rlhf.serving import DeadlineExceeded, ResourceExhausted, ServiceMetrics, ServiceSettings
from rlhf.v1 import environment_pb2, environment_pb2_grpc
from services.environment.engine import EnvironmentEngine
from services.environment.main import build_runner
from tests.integration._procs import ServiceProc, write_config

TOKEN = "env-test-token"
HERE = Path(__file__).resolve().parent
CALC = "builtin:calculator"
HOSTED = {
    CALC: {},
    "python:_environments:Echo": {"turns": 3},
    "python:_environments:FailingStep": {},
    "python:_environments:HangingStep": {"hang_s": 1.0},
    "python:_environments:BadOutcome": {},
}
PROMPT = [{"role": "user", "content": "what is 17 plus 25?"}]


def tool_call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def serve_with(body, *, timeout_s: float = 0.4, max_episodes: int = 100, ttl: float = 600.0, clock=None):
    """An engine hosting HOSTED behind both servers; ``await body(engine, client, http, addr)``, then a stop."""

    async def main():
        settings = ServiceSettings.from_env({}, host="127.0.0.1", grpc_port=0, http_port=0, api_token=TOKEN)
        metrics = ServiceMetrics("environment")
        kw = {"clock": clock} if clock is not None else {}
        engine = EnvironmentEngine(
            HOSTED, timeout_s=timeout_s, episode_ttl_s=ttl, max_episodes=max_episodes, metrics=metrics, **kw
        )
        runner = build_runner(engine, settings, metrics)
        task = asyncio.create_task(
            runner.run(startup=engine.start, shutdown=engine.close, install_signal_handlers=False)
        )
        await asyncio.wait_for(runner.started.wait(), 10)
        while not engine.ready:
            await asyncio.sleep(0.01)
        addr = f"127.0.0.1:{runner.grpc_port}"
        headers = {"Authorization": f"Bearer {TOKEN}"}
        try:
            async with (
                EnvironmentClient(addr, TOKEN, timeout_s=5, retries=1, backoff_s=0.05) as client,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{runner.http_port}", headers=headers) as http,
            ):
                return await body(engine, client, http, addr)
        finally:
            runner.request_stop()
            await asyncio.wait_for(task, 15)

    return asyncio.run(main())


def metric(text: str, series: str, **labels: str) -> float:
    """The value of one series of the Prometheus text ``text`` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(series + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_calculator_episodes_through_the_client():
    async def body(engine, client, http, addr):
        opening = await client.reset("job-1/0/0", CALC, PROMPT, label="42", info={"k": "v"}, seed=3)
        assert opening.messages[0]["role"] == "system" and "calculator" in opening.messages[0]["content"]
        assert opening.messages[1:] == PROMPT
        assert [t["function"]["name"] for t in opening.tools] == ["calculator"]
        # a retried reset (its answer lost) gets the same opening, and no second episode
        again = await client.reset("job-1/0/0", CALC, PROMPT, label="42")
        assert again.messages == opening.messages and len(engine.episodes) == 1

        out = await client.step("job-1/0/0", "Let me compute. " + tool_call("17 + 25"))
        assert not out.done and out.reward == 0.0
        assert [(m["role"], m["content"], m["name"]) for m in out.messages] == [("tool", "42", "calculator")]
        assert out.messages[0]["tool_call_id"].startswith("call_")
        assert out.metrics == {"tool_calls": 1.0, "tool_errors": 0.0}
        out = await client.step("job-1/0/0", tool_call("2 ** 99999") + tool_call("__import__('os')"))
        assert [m["content"] for m in out.messages] == ["error: the result is too large", out.messages[1]["content"]]
        assert out.messages[1]["content"].startswith("error: unsupported element")
        assert out.metrics == {"tool_calls": 2.0, "tool_errors": 2.0}
        out = await client.step("job-1/0/0", "The answer is 42.")
        assert out.done and out.reward == 1.0 and out.messages == []
        # a reset of an episode that has stepped is a new attempt: it needs a new id
        with pytest.raises(EnvironmentFailed) as e:
            await client.reset("job-1/0/0", CALC, PROMPT, label="42")
        assert e.value.code == "FAILED_PRECONDITION" and "new episode id" in str(e.value)
        assert await client.close("job-1/0/0") is True
        assert await client.close("job-1/0/0") is False  # closing twice is fine

        await client.reset("job-1/1/0", CALC, PROMPT, label="42")
        out = await client.step("job-1/1/0", "It is 41")
        assert out.done and out.reward == 0.0
        # the calculator needs a label: the caller's error (tests below), never a reward
        with pytest.raises(EnvironmentRequestInvalid, match="label"):
            await client.reset("job-1/2/0", CALC, PROMPT)

        text = (await http.get("/metrics")).text
        assert metric(text, "rlhf_env_episodes_total", environment=CALC, event="started") == 2
        assert metric(text, "rlhf_env_episodes_total", environment=CALC, event="finished") == 2
        assert metric(text, "rlhf_env_episodes_total", environment=CALC, event="failed") == 0
        assert metric(text, "rlhf_env_steps_total", environment=CALC) == 4
        assert metric(text, "rlhf_env_step_metric_total", environment=CALC, name="tool_calls") == 3
        assert metric(text, "rlhf_env_step_metric_total", environment=CALC, name="tool_errors") == 2
        assert metric(text, "rlhf_env_step_seconds_count", environment=CALC) == 4

    serve_with(body)


def test_step_retries_are_answered_once_and_messages_round_trip():
    async def body(engine, client, http, addr):
        echo = "python:_environments:Echo"
        prompt = [
            {"role": "system", "content": "be brief"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
            {"role": "tool", "content": "7", "tool_call_id": "c1", "name": "calculator"},
        ]
        opening = await client.reset("e/0/0", echo, prompt, info={"source": "t"}, seed=9)
        assert opening.messages == prompt and opening.info == {"seed": "9", "source": "t"}
        async with grpc.aio.insecure_channel(addr) as ch:
            stub = environment_pb2_grpc.EnvironmentServiceStub(ch)
            md = (("authorization", f"Bearer {TOKEN}"),)
            first = await stub.Step(environment_pb2.StepRequest(episode_id="e/0/0", action="a", turn=0), metadata=md)
            repeat = await stub.Step(environment_pb2.StepRequest(episode_id="e/0/0", action="a", turn=0), metadata=md)
            assert first == repeat and first.reward == 1.0  # answered again, not stepped twice
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Step(environment_pb2.StepRequest(episode_id="e/0/0", action="a", turn=5), metadata=md)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            second = await stub.Step(environment_pb2.StepRequest(episode_id="e/0/0", action="b", turn=1), metadata=md)
            assert second.reward == 2.0 and second.messages[0].content == "echo 2: b"

    serve_with(body)


def test_failing_hanging_and_garbage_environments_are_errors():
    async def body(engine, client, http, addr):
        _environments.CLOSED.clear()
        await client.reset("f/0/0", "python:_environments:FailingStep", PROMPT)
        with pytest.raises(EnvironmentFailed) as e:
            await client.step("f/0/0", "go")
        assert e.value.kind == "failed" and e.value.code == "INTERNAL"
        assert "ValueError: cannot handle 'go'" in str(e.value)
        # the episode is over: its instance was closed, and it is no longer open
        with pytest.raises(EpisodeLost):
            await client.step("f/0/0", "go")
        for _ in range(100):
            if _environments.CLOSED:
                break
            await asyncio.sleep(0.01)
        assert _environments.CLOSED == ["echo"]

        await client.reset("h/0/0", "python:_environments:HangingStep", PROMPT)
        with pytest.raises(Exception) as e:
            await client.step("h/0/0", "go")
        assert getattr(e.value, "kind", None) == "timeout" and e.value.code == "DEADLINE_EXCEEDED"
        assert "environment.timeout_s" in str(e.value)

        await client.reset("b/0/0", "python:_environments:BadOutcome", PROMPT)
        with pytest.raises(EnvironmentFailed, match="not an Outcome"):
            await client.step("b/0/0", "go")

        text = (await http.get("/metrics")).text
        for env in ("FailingStep", "HangingStep", "BadOutcome"):
            labels = {"environment": f"python:_environments:{env}", "event": "failed"}
            assert metric(text, "rlhf_env_episodes_total", **labels) == 1, env
        assert metric(text, "rlhf_errors_total", kind="environment_failed") == 2
        assert metric(text, "rlhf_errors_total", kind="environment_timed_out") == 1
        # the service goes on serving
        await client.reset("ok/0/0", CALC, PROMPT, label="42")

    serve_with(body, timeout_s=0.3)


def test_unknown_episodes_bad_input_and_auth():
    async def body(engine, client, http, addr):
        with pytest.raises(EpisodeLost) as e:
            await client.step("never/0/0", "hi")
        assert e.value.kind == "episode_lost" and "start the episode again" in str(e.value)
        for env, field in (("builtin:nope", "environment"), ("", "environment")):
            with pytest.raises(Exception) as e:
                await client.reset("x/0/0", env, PROMPT, label="1")
            assert getattr(e.value, "kind", None) == "invalid" and e.value.code == "INVALID_ARGUMENT", field
        with pytest.raises(Exception) as e:
            await client.reset("", CALC, PROMPT, label="1")
        assert e.value.kind == "invalid" and "episode_id" in str(e.value)

        # the token: refused without it or with another one, over gRPC and HTTP
        async with EnvironmentClient(addr, "wrong", timeout_s=5) as bad:
            with pytest.raises(Exception) as e:
                await bad.reset("x/0/0", CALC, PROMPT, label="1")
            assert e.value.kind == "invalid" and e.value.code == "UNAUTHENTICATED"
        async with EnvironmentClient(addr, None, timeout_s=5) as none:
            with pytest.raises(Exception) as e:
                await none.step("x/0/0", "a")
            assert e.value.code == "UNAUTHENTICATED"
        r = await http.post("/v1/episodes/reset", json={"episode_id": "x"}, headers={"Authorization": ""})
        assert r.status_code == 401
        assert engine.episodes == {}

        # the same calls over HTTP
        r = await http.post("/v1/episodes/reset", json={"episode_id": "h/0/0", "prompt": PROMPT, "label": "42"})
        assert r.status_code == 400 and r.json()["error"]["field"] == "environment"  # several hosted: name one
        r = await http.post(
            "/v1/episodes/reset",
            json={"episode_id": "h/0/0", "environment": CALC, "prompt": PROMPT, "label": "42", "seed": 1},
        )
        assert r.status_code == 200, r.text
        assert r.json()["tools"][0]["function"]["name"] == "calculator"
        r = await http.post("/v1/episodes/step", json={"episode_id": "h/0/0", "action": tool_call("6 * 7"), "turn": 0})
        assert r.status_code == 200 and r.json()["messages"][0]["content"] == "42" and r.json()["done"] is False
        r = await http.post("/v1/episodes/step", json={"episode_id": "h/0/0", "action": "\\boxed{42}"})
        assert r.json()["reward"] == 1.0 and r.json()["done"] is True
        r = await http.post("/v1/episodes/step", json={"episode_id": "nope", "action": "x"})
        assert r.status_code == 404 and r.json()["error"]["field"] == "episode_id"
        r = await http.post("/v1/episodes/step", json={"action": "x"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "episode_id"
        r = await http.post("/v1/episodes/close", json={"episode_id": "h/0/0"})
        assert r.json() == {"existed": True}
        r = await http.get("/v1/environments")
        assert r.json() == {"environments": sorted(HOSTED), "open_episodes": 0}

    serve_with(body)


def test_a_reset_without_what_the_environment_needs_is_the_callers_error():
    """Issue 46.5: a reset without the label (or the prompt) the calculator needs was 500 environment_failed, the
    client's mistake reported as the server's. Now 400 / INVALID_ARGUMENT naming the field; nothing is left open, the
    environment is not counted as failed, and the same episode id starts once the request is right. The other
    required fields of reset and step, left out by a careless client, are refused naming theirs too."""

    async def body(engine, client, http, addr):
        refusals = [
            ({"episode_id": "n/0/0", "environment": CALC, "prompt": PROMPT}, "label"),  # no label
            ({"episode_id": "n/0/0", "environment": CALC, "prompt": PROMPT, "label": None}, "label"),
            ({"episode_id": "n/0/0", "environment": CALC, "prompt": PROMPT, "label": ""}, "label"),
            ({"episode_id": "n/0/0", "environment": CALC, "label": "42"}, "prompt"),  # no question
        ]
        for request, field in refusals:
            r = await http.post("/v1/episodes/reset", json=request)
            assert r.status_code == 400, (request, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_argument" and err["field"] == field, err
            assert err["message"].startswith(f"{CALC} reset: {CALC} needs") and field in err["message"], err

        async with grpc.aio.insecure_channel(addr) as ch:
            stub = environment_pb2_grpc.EnvironmentServiceStub(ch)
            md = (("authorization", f"Bearer {TOKEN}"),)
            req = environment_pb2.ResetRequest(episode_id="n/0/0", environment=CALC)
            req.prompt.add(role="user", content=PROMPT[0]["content"])
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Reset(req, metadata=md)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "the label" in e.value.details()
            assert ("rlhf-error-field", "label") in tuple(e.value.trailing_metadata())
            # the careless client's other omissions: no episode id (reset, step), over gRPC
            for call, bad in (
                (stub.Reset, environment_pb2.ResetRequest(environment=CALC, label="42")),
                (stub.Step, environment_pb2.StepRequest(action="42")),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(bad, metadata=md)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "episode_id" in e.value.details()
        with pytest.raises(EnvironmentRequestInvalid) as e:  # what a rollout replica sees
            await client.reset("n/0/0", CALC, PROMPT)
        assert e.value.code == "INVALID_ARGUMENT" and "label" in str(e.value)
        # ... and over HTTP: the schema's required fields (422), naming each
        for path, request, field in (
            ("/v1/episodes/reset", {"environment": CALC, "prompt": PROMPT, "label": "42"}, "episode_id"),
            ("/v1/episodes/step", {"episode_id": "n/0/0"}, "action"),
            ("/v1/episodes/step", {"episode_id": "n/0/0", "action": "42", "turn": -1}, "turn"),
        ):
            r = await http.post(path, json=request)
            assert r.status_code == 422 and r.json()["error"]["field"] == field, r.text

        assert engine.episodes == {}  # nothing half-open
        text = (await http.get("/metrics")).text
        assert metric(text, "rlhf_env_episodes_total", environment=CALC, event="failed") == 0
        assert metric(text, "rlhf_errors_total", kind="environment_failed") == 0
        assert metric(text, "rlhf_errors_total", kind="invalid_argument") >= 7
        # the request put right, the same episode id starts and plays
        await client.reset("n/0/0", CALC, PROMPT, label="42")
        assert (await client.step("n/0/0", "42")).reward == 1.0

    serve_with(body)


def test_idle_episodes_expire_and_open_episodes_are_bounded():
    now = [0.0]

    async def body(engine, client, http, addr):
        await client.reset("a/0/0", CALC, PROMPT, label="42")
        await client.reset("b/0/0", CALC, PROMPT, label="42")
        with pytest.raises(Exception) as e:  # the bound: refused (retry later), not an older episode evicted
            await client.reset("c/0/0", CALC, PROMPT, label="42")
        assert e.value.kind == "unavailable" and e.value.code == "RESOURCE_EXHAUSTED"
        now[0] += 50
        await client.step("b/0/0", tool_call("1 + 1"))  # b is used; a stays idle
        now[0] += 60  # a idle 110 s (> TTL 100), b idle 60 s
        await client.reset("c/0/0", CALC, PROMPT, label="42")  # a expires, making room
        with pytest.raises(EpisodeLost):
            await client.step("a/0/0", "42")
        assert (await client.step("b/0/0", "42")).reward == 1.0
        text = (await http.get("/metrics")).text
        assert metric(text, "rlhf_env_episodes_total", environment=CALC, event="expired") == 1
        assert metric(text, "rlhf_env_open_episodes") == 2

    serve_with(body, max_episodes=2, ttl=100.0, clock=lambda: now[0])


def test_the_config_sets_the_episode_bounds():
    """environment.{name, options, timeout_s, max_episodes, episode_ttl_s} as the service reads them."""
    now = [0.0]
    env = {"name": "python:_environments:HangingStep", "options": {"hang_s": 0.5}, "timeout_s": 0.2}
    cfg = parse_config({"environment": {**env, "max_episodes": 1, "episode_ttl_s": 30}})

    async def main():
        engine = EnvironmentEngine.from_config(cfg, clock=lambda: now[0])
        await engine.start()
        try:
            await engine.reset("a", "", PROMPT, None, {}, None)
            with pytest.raises(ResourceExhausted, match="environment.max_episodes"):
                await engine.reset("b", "", PROMPT, None, {}, None)
            now[0] += 31  # past the TTL: "a" is closed, "b" fits
            await engine.reset("b", "", PROMPT, None, {}, None)
            assert list(engine.episodes) == ["b"]
            t0 = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="took over 0.2s"):  # the step sleeps past timeout_s
                await engine.step("b", "go")
            assert time.monotonic() - t0 < 0.45
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_killed_service_loses_its_episodes(tmp_path):
    """`rlhf serve environment` as a process: killed mid-episode (kill -9), the client sees it unavailable; restarted
    on the same ports, it answers the old episode with NOT_FOUND (episode_lost) and serves new ones."""
    config = write_config(
        tmp_path / "env.yaml", {"environment": {"name": CALC, "options": {"max_expression_chars": 50}, "timeout_s": 5}}
    )
    env = {"RLHF_API_TOKEN": TOKEN, "PYTHONPATH": f"{HERE}:{Path.cwd()}"}
    proc = ServiceProc("environment", config, tmp_path / "logs", env=env).start(timeout=60)

    async def main():
        # retries: after the kill the channel waits out gRPC's reconnect backoff (about 1 s) before it connects again
        async with EnvironmentClient(proc.grpc_addr, TOKEN, timeout_s=5, retries=3, backoff_s=0.3) as client:
            opening = await client.reset("job-9/0/0", "", PROMPT, label="42")  # the one hosted environment
            assert opening.tools
            out = await client.step("job-9/0/0", tool_call("1" * 60))
            assert out.messages[0]["content"].startswith("error: the expression is 60 characters")  # the options
            proc.stop(kill=True)
            with pytest.raises(Exception) as e:
                await client.step("job-9/0/0", "42")
            assert e.value.kind == "unavailable"
            await asyncio.to_thread(proc.start, 60)
            with pytest.raises(EpisodeLost):
                await client.step("job-9/0/0", "42")
            await client.reset("job-9/0/1", "", PROMPT, label="42")  # the next attempt
            assert (await client.step("job-9/0/1", "42")).reward == 1.0

    try:
        asyncio.run(main())
        r = httpx.get(proc.http_url + "/metrics")
        assert re.search(r'rlhf_env_episodes_total\{environment="builtin:calculator",event="finished".*\} 1\.0', r.text)
    finally:
        proc.stop()


def test_the_service_refuses_configs_it_cannot_serve(tmp_path):
    """Exit 2 with the key at fault: an unknown environment (the config check), and no environment at all."""
    config = write_config(tmp_path / "bad.yaml", {"environment": {"name": "builtin:nope"}})
    proc = ServiceProc("environment", config, tmp_path / "logs").start(wait_ready=False)
    assert proc.wait(30) == 2
    assert "environment.name: unknown environment 'builtin:nope'" in proc.log_text(), proc.log_text()
    with pytest.raises(ConfigError, match="environment.name is not set"):
        EnvironmentEngine.from_config(parse_config({}))
    with pytest.raises(ConfigError, match="environment.options"):
        EnvironmentEngine({CALC: {"digits": 3}})


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
