"""A verifiers environment served by the environment service: ``rlhf serve environment`` started from .venv-envs
(no torch there) as a process of its own on loopback ports, driven by the service's client (rlhf.environments.client)
the way a rollout replica drives it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from rlhf.environments.adapters.verifiers_env import verifiers_rows
from rlhf.environments.client import EnvironmentClient, EnvironmentFailed
from rlhf.procs import free_ports

HERE = Path(__file__).resolve().parent
TOKEN = "envs-test-token"
SPEC = "verifiers:rlhf_vf_quiz"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("envsvc")
    config = tmp / "config.yaml"
    # the first reset imports verifiers and loads the taskset (seconds on a busy machine): a generous step timeout
    config.write_text(yaml.safe_dump({"environment": {"name": SPEC, "timeout_s": 90, "options": {"max_turns": 3}}}))
    grpc_port, http_port = free_ports(2)
    env = {**os.environ, "RLHF_API_TOKEN": TOKEN, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1])])}
    rlhf = Path(sys.executable).with_name("rlhf")
    log = (tmp / "service.log").open("wb")
    proc = subprocess.Popen(
        [str(rlhf), "serve", "environment", "--config", str(config), "--host", "127.0.0.1",
         "--grpc-port", str(grpc_port), "--http-port", str(http_port)],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp / "service.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{http_port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the environment service did not get ready in 60 s"
            time.sleep(0.2)
        yield f"127.0.0.1:{grpc_port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_a_verifiers_episode_through_the_environment_service(service):
    rows = verifiers_rows("rlhf_vf_quiz")

    async def main():
        async with EnvironmentClient(service, TOKEN, timeout_s=100, retries=1) as client:
            row = rows[0]
            opening = await client.reset("job-1/0/0", SPEC, row["messages"], label=row["label"], info=row["info"])
            assert opening.messages == row["messages"]
            out = await client.step("job-1/0/0", "Lyon")
            assert not out.done and out.messages == [{"role": "user", "content": "Not quite. Hint: it starts with P"}]
            out = await client.step("job-1/0/0", "Paris")
            assert out.done and out.reward == pytest.approx(1.25)
            await client.close("job-1/0/0")

            # the rubric that raises: the sample is an error the replica sees as such, never a reward
            row = rows[2]
            await client.reset("job-2/0/0", SPEC, row["messages"], label=row["label"], info=row["info"])
            with pytest.raises(EnvironmentFailed, match="cannot score"):
                await client.step("job-2/0/0", "2")

    asyncio.run(main())
