"""``rlhf up`` with ``training_service.enabled``: the training service (the tinker SDK's API) starts with the run's
first stage and answers the SDK; without a key the SDK could send, the run is refused before anything starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from rlhf.config import ExperimentConfig
from services import launcher, plan
from services.cli import main as cli_main
from services.devices import DevicePlan
from tests.support.up import REPO, demo_config


def test_plan_puts_the_training_service_in_the_first_stage_on_the_trainers_devices(tmp_path):
    specs = plan.plan_services(redis_url="u", run_id="r", api_token="t", run_dir=tmp_path, training_service=True)
    assert [s.name for s in specs] == ["reward", "reference", "training", "rollout", "trainer"]
    training = specs[2]
    assert training.argv("c.yaml", python="py")[:5] == ["py", "-m", "services.cli", "serve", "training"]
    assert len({p for s in specs for p in (s.grpc_port, s.http_port)}) == 10
    off = plan.plan_services(redis_url="u", run_id="r", api_token="t", run_dir=tmp_path)
    assert "training" not in [s.service for s in off]
    devices = DevicePlan("CUDA_VISIBLE_DEVICES", trainer=["0"], rollouts=[["1"]], reference=["2"], reward=["3"])
    placed = {
        s.name: s.env["CUDA_VISIBLE_DEVICES"]
        for s in plan.plan_services(
            redis_url="u", run_id="r", api_token="t", run_dir=tmp_path, training_service=True, devices=devices
        )
    }
    assert placed == {"reward": "3", "reference": "2", "training": "0", "rollout": "1", "trainer": "0"}


@pytest.mark.parametrize(
    ("env", "refused"),
    [
        ({}, True),
        ({"RLHF_API_TOKEN": "not-an-sdk-key"}, True),
        ({"RLHF_TRAINING_TOKENS": " tml-a, tml-b"}, False),
        ({"RLHF_API_TOKEN": "tml-admin"}, False),
    ],
)
def test_a_training_service_no_sdk_key_reaches_is_refused(env, refused):
    cfg = ExperimentConfig.model_validate({"training_service": {"enabled": True}})
    assert (launcher.training_service_problem(cfg, env) is not None) == refused
    assert launcher.training_service_problem(ExperimentConfig(), {}) is None  # off: nothing to check


def test_up_refuses_before_starting_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RLHF_API_TOKEN", raising=False)
    monkeypatch.delenv("RLHF_TRAINING_TOKENS", raising=False)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(demo_config("demo", "ts") | {"training_service": {"enabled": True}}))
    rc = cli_main(["up", "--config", str(config), "--run-dir", str(tmp_path / "run")])
    assert rc == 2
    assert "training_service.enabled: set RLHF_TRAINING_TOKENS" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(300)
def test_up_starts_a_training_service_the_sdk_reaches(tmp_path, tiny_models):
    import tinker  # noqa: PLC0415 - the SDK, a test dependency of this test only

    cfg = demo_config("demo", "ts", tmp_path) | {"training_service": {"enabled": True}}
    config = tmp_path / "ts.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "RLHF_REDIS_URL"}
    env.update(
        RLHF_TRAINING_TOKENS="tml-alice", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    )
    out_path = tmp_path / "up.out"
    argv = [sys.executable, "-m", "services.cli", "up", "--config", str(config), "--run-dir", str(tmp_path / "run")]
    with open(out_path, "w") as out:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while "training ready" not in out_path.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, out_path.read_text()
                time.sleep(0.2)
            text = out_path.read_text()
            url = re.search(r"started training \(pid \d+, http (\S+),", text)
            assert url, text
            caps = tinker.RestClient(base_url=url.group(1), api_key="tml-alice").get_server_capabilities().result()
            assert [m.model_name for m in caps.supported_models] == ["tiny:policy"]
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=90) == 130, out_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert (tmp_path / "run" / "logs" / "training.log").is_file()
