"""A verifiers environment's own evaluation (verifiers' Env.serving + run_slot: its interception server, the
subprocess runtime, its chat harness program) against the rollout service's OpenAI API, unchanged: the rollout runs
from the main venv (.venv: torch, the hf engine, the tiny policy) as a process of its own on loopback; verifiers runs
here (.venv-envs).

One stand-in: verifiers prepares its harness program with ``uv sync --script`` (packages from the network); a ``uv``
on PATH that answers with this interpreter, which has the program's packages (openai, mcp, httpx...), keeps the run
offline. Everything after that (the program, its model calls through the interception server to the rollout,
scoring) is verifiers' own code."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import verifiers.v1 as vf
import yaml
from verifiers.v1.env import RunSlot

from rlhf.procs import free_ports

REPO = Path(__file__).resolve().parents[2]
MAIN_PYTHON = REPO / ".venv" / "bin" / "python"
UV_STANDIN = """#!/bin/sh
case "$*" in
  *--help*) echo "  --script"; exit 0 ;;
  "sync --script"*) exit 0 ;;
  "python find --script"*) echo "$RLHF_VF_PYTHON"; exit 0 ;;
esac
echo "uv stand-in: unexpected arguments: $*" >&2
exit 1
"""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rollout_url(tmp_path_factory):
    if not MAIN_PYTHON.exists():
        pytest.skip(f"needs the main venv ({MAIN_PYTHON}: make setup) to serve the rollout")
    tmp = tmp_path_factory.mktemp("vf-eval")
    config = tmp / "rollout.yaml"
    policy = {"load": "tiny:policy", "engine": "hf", "tool_call_parser": "hermes"}
    config.write_text(yaml.safe_dump({"actor_rollout_ref": {"actor_rollout": policy}}))
    grpc_port, port = free_ports(2)
    env = {**os.environ, "RLHF_ROLLOUT_ENGINE": "hf", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    log_path = tmp / "rollout.log"
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [str(MAIN_PYTHON), "-m", "services.cli", "serve", "rollout", "--config", str(config), "--host", "127.0.0.1",
         "--grpc-port", str(grpc_port), "--http-port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 150  # builds the tiny policy on first use, then loads torch and the model
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the rollout service did not get ready"
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def uv_standin(tmp_path, monkeypatch):
    uv = tmp_path / "bin" / "uv"
    uv.parent.mkdir()
    uv.write_text(UV_STANDIN)
    uv.chmod(0o755)
    monkeypatch.setenv("PATH", f"{uv.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("RLHF_VF_PYTHON", sys.executable)
    monkeypatch.setenv("RLHF_VF_KEY", "unused")  # the rollout takes no key; verifiers sends the variable's value


def test_verifiers_evaluates_a_taskset_against_the_rollout_service(rollout_url, uv_standin):
    config = vf.resolve_env_config(
        {
            "taskset": {"id": "rlhf_vf_echo"},
            "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": 1},
        }
    )
    env = vf.load_environment(config)
    ctx = vf.ModelContext(
        model="tiny",
        client=vf.EvalClientConfig(base_url=rollout_url, api_key_var="RLHF_VF_KEY"),
        sampling=vf.SamplingConfig(max_tokens=12, temperature=0),
    )

    async def run():
        async with env.serving():
            return await asyncio.gather(*(env.run_slot(RunSlot(task), ctx) for task in env.taskset))

    episodes = asyncio.run(asyncio.wait_for(run(), 120))
    assert len(episodes) == 2
    # the first task has a system prompt, the second has none: the harness opens with what the task gives
    for episode, opening in zip(episodes, (["system", "user"], ["user"]), strict=True):
        assert episode.ok, episode.errors
        (trace,) = episode.traces
        assert trace.ok and trace.stop_condition == "agent_completed" and trace.num_turns == 1
        assert [m.role for m in trace.messages] == [*opening, "assistant"]
        # the model call went through verifiers' interception to the rollout: its usage is the rollout's count
        (call,) = trace.calls
        assert call.usage.completion_tokens == 12 or call.finish_reason == "stop"
        assert call.usage.prompt_tokens > 0
        # the task's rubric scored the rollout's text
        assert trace.rewards["length"].score == pytest.approx(min(len(trace.last_reply), 50) / 50)
