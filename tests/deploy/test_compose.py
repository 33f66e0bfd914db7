"""docker-compose.yml and its GPU / NPU overrides, read as YAML (and through `docker-compose config` when present)."""

from __future__ import annotations

import os
import re
import shutil
import socketserver
import subprocess
import threading

import pytest
import yaml
from deploy_contract import parse_container_command, unknown_env
from deploy_support import COMPOSE_FILES, ROOT, SERVICES

from rlhf.config import load_config


def test_base_file_runs_the_cpu_demo(compose_files):
    base = compose_files["docker-compose.yml"]["services"]
    assert set(SERVICES) | {"redis", "models"} == set(base)
    for name in SERVICES:
        svc = base[name]
        assert svc["build"]["args"]["ACCEL"] == "cpu" and svc["build"]["target"] == name
        assert svc["image"].endswith("-cpu")
        assert svc["environment"]["RLHF_DEVICE"] == "cpu"
        assert "${RLHF_EXPERIMENT_CONFIG:-./configs/demo.yaml}:/etc/rlhf/config.yaml:ro" in svc["volumes"]
    assert load_config(ROOT / "configs" / "demo.yaml").actor.load == "tiny:policy"
    assert base["models"]["command"] == ["python3", "-m", "rlhf.tiny", "/var/cache/rlhf/tiny"]


def test_commands_are_accepted_by_the_rlhf_cli(compose_files):
    for name in SERVICES:
        command = compose_files["docker-compose.yml"]["services"][name]["command"]
        ns = parse_container_command(command)
        assert (ns.command, ns.service, ns.config) == ("serve", name, "/etc/rlhf/config.yaml")
        assert (ns.grpc_port, ns.http_port) == (50051, 8000)


def test_api_token_is_required_and_never_defaulted():
    text = (ROOT / "docker-compose.yml").read_text()
    assert "RLHF_API_TOKEN: ${RLHF_API_TOKEN:?set RLHF_API_TOKEN}" in text
    assert not re.search(r"RLHF_API_TOKEN:-", text)


def test_startup_order_waits_for_health(compose_files):
    base = compose_files["docker-compose.yml"]["services"]
    redis = base["redis"]
    assert redis["healthcheck"]["test"] == ["CMD-SHELL", "redis-cli ping | grep -qx PONG"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes", "Redis runs with AOF on"
    assert base["rollout"]["depends_on"] == {
        "redis": {"condition": "service_healthy"},
        "reward": {"condition": "service_healthy"},
        "reference": {"condition": "service_healthy"},
    }
    assert base["trainer"]["depends_on"]["rollout"] == {"condition": "service_healthy"}
    for name in ("reward", "reference"):
        assert base[name]["depends_on"]["models"] == {"condition": "service_completed_successfully"}
    for name in SERVICES:
        assert base[name]["healthcheck"]["test"] == ["CMD", "python3", "/opt/rlhf/healthcheck.py"]
        assert "runs:/var/lib/rlhf/runs" in base[name]["volumes"]
        assert "container_name" not in base[name], "a fixed container name prevents --scale"


def test_wiring(compose_files):
    base = compose_files["docker-compose.yml"]["services"]
    assert base["trainer"]["environment"]["RLHF_ROLLOUT_ADDRS"] == "rollout:50051"
    assert base["rollout"]["environment"]["RLHF_REWARD_ADDR"] == "reward:50051"
    assert base["rollout"]["environment"]["RLHF_REFERENCE_ADDR"] == "reference:50051"
    assert base["rollout"]["environment"]["RLHF_REDIS_URL"].endswith("@redis:6379/0")


def test_gpu_override_reserves_nvidia_devices_and_uses_cuda_images(compose_files):
    gpu = compose_files["compose.gpu.yaml"]["services"]
    for name in SERVICES:
        (device,) = gpu[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
        assert gpu[name]["image"].endswith("-cuda") and gpu[name]["build"]["args"]["ACCEL"] == "cuda"
        assert gpu[name]["environment"]["RLHF_DEVICE"] == "cuda"
        config = "${RLHF_EXPERIMENT_CONFIG:-./configs/llama32-1b-ppo.yaml}:/etc/rlhf/config.yaml:ro"
        assert config in gpu[name]["volumes"]
        assert "${RLHF_MODELS_DIR:-./models}:/models:ro" in gpu[name]["volumes"]


def test_npu_override_maps_ascend_devices_and_driver(compose_files):
    npu = compose_files["compose.npu.yaml"]["services"]
    for name in SERVICES:
        devices = npu[name]["devices"]
        assert any(re.fullmatch(r"/dev/davinci\$\{RLHF_\w+_NPU:-\d\}", d) for d in devices), devices
        assert {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"} <= set(devices)
        mounts = {v.split(":")[0] for v in npu[name]["volumes"]}
        assert {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi"} <= mounts
        assert npu[name]["image"].endswith("-ascend") and npu[name]["build"]["args"]["ACCEL"] == "ascend"
        assert npu[name]["environment"]["RLHF_DEVICE"] == "npu"
        assert npu[name]["group_add"], "the non-root user needs the HwHiAiUser group"


def test_example_configs_load():
    for name in ("llama32-1b-ppo.yaml", "llama32-1b-online-dpo.yaml"):
        cfg = load_config(ROOT / "configs" / name)
        assert cfg.actor.load.startswith("/models/") and cfg.data.path.startswith("/data/")
    assert load_config(ROOT / "configs" / "llama32-1b-online-dpo.yaml").training.stage == "ray_online_dpo"


def test_env_vars_are_known_to_the_code(compose_files):
    names = set()
    for data in compose_files.values():
        for svc in data["services"].values():
            env = svc.get("environment") or {}
            names |= set(env if isinstance(env, dict) else (e.split("=", 1)[0] for e in env))
    assert not unknown_env(names), f"compose sets variables nothing reads: {unknown_env(names)}"


def _compose() -> list[str] | None:
    exe = os.environ.get("DOCKER_COMPOSE", "docker-compose").split()
    return exe if shutil.which(exe[0]) else None


@pytest.mark.parametrize("override", [None, "compose.gpu.yaml", "compose.npu.yaml"])
def test_merged_config(override):
    exe = _compose()
    if exe is None:
        pytest.skip("docker-compose is not installed (`make deploy-tools` installs it); the YAML checks above ran")
    files = ["-f", "docker-compose.yml"] + (["-f", override] if override else [])
    env = {**os.environ, "RLHF_API_TOKEN": "t"}
    proc = subprocess.run([*exe, *files, "config"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    merged = yaml.safe_load(proc.stdout)["services"]
    flavour = {None: "cpu", "compose.gpu.yaml": "cuda", "compose.npu.yaml": "ascend"}[override]
    for name in SERVICES:
        assert merged[name]["image"].endswith(f"-{flavour}")
        assert merged[name]["environment"]["RLHF_API_TOKEN"] == "t"
        config_mounts = [
            v
            for v in merged[name]["volumes"]
            if str(v).split(":")[1:2] == ["/etc/rlhf/config.yaml"]
            or (isinstance(v, dict) and v.get("target") == "/etc/rlhf/config.yaml")
        ]
        assert len(config_mounts) == 1, f"{name}: the override must replace the config mount, not add one"
    assert COMPOSE_FILES[0] == "docker-compose.yml"


class _OneReplyRedis(socketserver.StreamRequestHandler):
    """Answers AUTH with ``server.auth_reply`` and any other command with ``server.reply`` (RESP): a Redis that
    refuses the password, or is still loading its AOF, without building either state."""

    def handle(self):
        while line := self.rfile.readline():
            if not line.startswith(b"*"):
                continue
            args = []
            for _ in range(int(line[1:])):
                size = int(self.rfile.readline()[1:])
                args.append(self.rfile.read(size + 2)[:-2])
            self.wfile.write(self.server.auth_reply if args[0].upper() == b"AUTH" else self.server.reply)


@pytest.mark.parametrize(
    "auth_reply, reply, healthy",
    [
        (b"+OK\r\n", b"+PONG\r\n", True),
        (b"-WRONGPASS invalid username-password pair or user is disabled.\r\n", b"-NOAUTH Authentication required.\r\n",
         False),
        (b"+OK\r\n", b"-LOADING Redis is loading the dataset in memory\r\n", False),
    ],
    ids=["pong", "noauth", "loading"],
)  # fmt: skip
def test_redis_healthcheck_passes_on_pong_only(compose_files, auth_reply, reply, healthy):
    """redis-cli exits 0 on an error reply: the health check must read the reply (compose and the chart's probes)."""
    if shutil.which("redis-cli") is None:
        pytest.fail("redis-cli is not on PATH (apt-get install -y redis-server)")
    redis = compose_files["docker-compose.yml"]["services"]["redis"]
    kind, line = redis["healthcheck"]["test"]
    assert kind == "CMD-SHELL" and line.startswith("redis-cli ")
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _OneReplyRedis)
    server.daemon_threads = True
    server.auth_reply, server.reply = auth_reply, reply
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        env = {"PATH": os.environ["PATH"], "REDISCLI_AUTH": redis["environment"]["REDISCLI_AUTH"]}
        cmd = f"redis-cli -p {port}" + line[len("redis-cli") :]
        proc = subprocess.run(["sh", "-c", cmd], env=env, capture_output=True, text=True, timeout=20)
        assert (proc.returncode == 0) is healthy, (proc.returncode, proc.stdout, proc.stderr)
        plain = subprocess.run(["redis-cli", "-p", str(port), "ping"], env=env, capture_output=True, timeout=20)
        assert plain.returncode == 0, "the bare `redis-cli ping` passes on every reply: why the check reads it"
    finally:
        server.shutdown()
        server.server_close()


def test_rollout_may_bind_numa_memory_and_threads_are_bounded(compose_files):
    base = compose_files["docker-compose.yml"]["services"]
    # vLLM's CPU backend calls numa_set_membind; the default seccomp profile allows it only with CAP_SYS_NICE
    assert base["rollout"]["cap_add"] == ["SYS_NICE"]
    for name in SERVICES:
        assert base[name]["environment"]["OMP_NUM_THREADS"] == "${RLHF_OMP_NUM_THREADS:-1}", name


@pytest.mark.parametrize(("override", "backend"), [("compose.gpu.yaml", "nccl"), ("compose.npu.yaml", "hccl")])
def test_accelerator_overrides_push_weights_by_collective_and_cpu_keeps_auto(compose_files, override, backend):
    base = compose_files["docker-compose.yml"]["services"]["trainer"]["environment"]
    assert "RLHF_WEIGHTS_TRANSPORT" not in base and "RLHF_WEIGHTS_COLLECTIVE_BACKEND" not in base  # auto: tcp plane
    env = compose_files[override]["services"]["trainer"]["environment"]
    assert env["RLHF_WEIGHTS_TRANSPORT"] == "collective" and env["RLHF_WEIGHTS_COLLECTIVE_BACKEND"] == backend
    assert env["RLHF_DEVICE"] == {"nccl": "cuda", "hccl": "npu"}[backend]  # the anchor's keys are still merged
    # the settings the trainer builds from them are accepted (a typo or a backend without the transport is refused)
    from rlhf.serving import ServiceSettings

    merged = {k: str(v) for k, v in env.items() if k.startswith("RLHF_WEIGHTS_")}
    assert ServiceSettings.from_env(merged).weights_collective_backend == backend
    for name in ("rollout", "reward", "reference"):
        assert "RLHF_WEIGHTS_TRANSPORT" not in compose_files[override]["services"][name]["environment"]
