"""docker-compose.yml and its GPU / NPU / environment overrides, read as YAML (and through `docker-compose config` when
present)."""

from __future__ import annotations

import os
import re
import shutil
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from deploy_contract import parse_container_command, unknown_env
from deploy_support import COMPOSE_FILES, ROOT, SERVICES
from test_compose_local import interpolate  # Compose's variable interpolation

from rlhf.config import load_config
from rlhf.procs import HOST, Child, free_ports
from rlhf.serving import ServiceSettings


def test_base_file_runs_the_cpu_demo(compose_files):
    base = compose_files["docker-compose.yml"]["services"]
    assert set(SERVICES) | {"redis", "models", "training"} == set(base)
    assert [n for n, svc in base.items() if svc.get("profiles")] == ["training"], "the rest start by default"
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
    assert base["trainer"]["environment"]["RLHF_REWARD_ADDR"] == "reward:50051"  # the eval section's scores
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
        # one image flavour per Atlas generation, picked with the build argument by one variable (issue 27.6)
        assert npu[name]["image"].endswith("-ascend-${RLHF_ASCEND_SOC:-910b}"), npu[name]["image"]
        assert npu[name]["build"]["args"] == {"ACCEL": "ascend", "ASCEND_SOC": "${RLHF_ASCEND_SOC:-910b}"}
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


def _merged(overrides: tuple[str, ...], **env: str) -> dict:
    exe = _compose()
    if exe is None:
        pytest.skip("docker-compose is not installed (`make deploy-tools` installs it); the YAML checks above ran")
    files = [f for name in ("docker-compose.yml", *overrides) for f in ("-f", name)]
    env = {**os.environ, "RLHF_API_TOKEN": "t", **env}
    proc = subprocess.run([*exe, *files, "config"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)["services"]


@pytest.mark.parametrize(
    ("overrides", "env", "flavour"),
    [
        ((), {}, "cpu"),
        (("compose.gpu.yaml",), {}, "cuda"),
        (("compose.npu.yaml",), {}, "ascend-910b"),
        (("compose.npu.yaml",), {"RLHF_ASCEND_SOC": "a3"}, "ascend-a3"),
        (("compose.npu.yaml", "compose.npu-hccl.yaml"), {}, "ascend-910b"),
    ],
)
def test_merged_config(overrides, env, flavour):
    merged = _merged(overrides, **env)
    for name in SERVICES:
        assert merged[name]["image"].endswith(f"-{flavour}")
        if flavour.startswith("ascend-"):
            assert merged[name]["build"]["args"]["ASCEND_SOC"] == flavour.removeprefix("ascend-")
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
        (
            b"-WRONGPASS invalid username-password pair or user is disabled.\r\n",
            b"-NOAUTH Authentication required.\r\n",
            False,
        ),
        (b"+OK\r\n", b"-LOADING Redis is loading the dataset in memory\r\n", False),
    ],
    ids=["pong", "noauth", "loading"],
)
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


@pytest.mark.parametrize(
    ("override", "transport", "backend"),
    [
        ("compose.gpu.yaml", "collective", "nccl"),
        ("compose.npu.yaml", "tcp", "auto"),
        ("compose.npu-hccl.yaml", "collective", "hccl"),
    ],
)
def test_accelerator_overrides_choose_the_weight_transport_and_cpu_keeps_auto(
    compose_files, override, transport, backend
):
    """GPU: one nccl broadcast. Ascend on the bridge network: TCP (HCCL between two containers with their own IPs
    sees two servers and needs RoCE, vllm-ascend#14506); hccl only with compose.npu-hccl.yaml (host network)."""
    base = compose_files["docker-compose.yml"]["services"]["trainer"]["environment"]
    assert "RLHF_WEIGHTS_TRANSPORT" not in base and "RLHF_WEIGHTS_COLLECTIVE_BACKEND" not in base  # auto: tcp plane
    env = compose_files[override]["services"]["trainer"]["environment"]
    assert env["RLHF_WEIGHTS_TRANSPORT"] == transport
    assert env.get("RLHF_WEIGHTS_COLLECTIVE_BACKEND", "auto") == backend
    assert env["RLHF_DEVICE"] == ("cuda" if override == "compose.gpu.yaml" else "npu")  # the anchor's keys merged
    # the settings the trainer builds from them are accepted (a typo or a backend without the transport is refused)

    merged = {k: str(v) for k, v in env.items() if k.startswith("RLHF_WEIGHTS_")}
    settings = ServiceSettings.from_env(merged)
    assert (settings.weights_transport, settings.weights_collective_backend) == (transport, backend)
    for name in ("rollout", "reward", "reference"):
        other = compose_files[override]["services"].get(name, {}).get("environment") or {}
        assert "RLHF_WEIGHTS_TRANSPORT" not in other
    if backend == "hccl":  # HCCL between containers only on the host network
        for name in ("trainer", "rollout"):
            assert compose_files[override]["services"][name]["network_mode"] == "host", name


def _published(ports: list, target: int) -> int:
    """The 127.0.0.1 host port a service publishes for container port ``target`` (merged `docker-compose config`)."""
    for p in ports:
        if isinstance(p, dict):
            host_ip, published, port = p.get("host_ip"), p.get("published"), p.get("target")
        else:
            host_ip, published, port = str(p).split("/")[0].rsplit(":", 2)
        if int(port) == target:
            assert host_ip == "127.0.0.1", f"{p}: publish on the host's loopback only"
            return int(published)
    pytest.fail(f"container port {target} is not published: {ports}")


def test_hccl_override_puts_trainer_and_rollout_on_the_host_network_and_wires_them_there():
    """Issue 27.5: with network_mode host, trainer and rollout cannot resolve service names: every address they use
    is 127.0.0.1 and a port the host really has (a published port of reward/reference/Redis, or the peer's own), and
    the ports they listen on do not clash on the shared network."""
    merged = _merged(("compose.npu.yaml", "compose.npu-hccl.yaml"))
    redis, reward, reference = (merged[n] for n in ("redis", "reward", "reference"))
    host_ports = {
        "redis": _published(redis["ports"], 6379),
        "reward": _published(reward["ports"], 50051),
        "reference": _published(reference["ports"], 50051),
    }
    listening: dict[str, set[int]] = {}
    settings = {}
    for name in ("rollout", "trainer"):
        svc = merged[name]
        assert svc["network_mode"] == "host" and "networks" not in svc, name
        env = {k: str(v) for k, v in svc["environment"].items()}
        s = settings[name] = ServiceSettings.from_env(env)
        ns = parse_container_command(svc["command"])
        assert (ns.grpc_port, ns.http_port) == (s.grpc_port, s.http_port), f"{name}: flags and RLHF_* ports agree"
        assert s.host == "127.0.0.1", f"{name}: on the host network, bind the loopback only"
        assert env["HCCL_HOST_SOCKET_PORT_RANGE"] == "auto" and s.device == "npu"
        listening[name] = {s.grpc_port, s.http_port} | ({s.weights_data_port} if s.weights_data_port else set())
        assert s.reward_addr == f"127.0.0.1:{host_ports['reward']}", name
        assert s.reference_addr == f"127.0.0.1:{host_ports['reference']}", name
        assert s.redis_url.endswith(f"@127.0.0.1:{host_ports['redis']}/0"), name
        for key, value in env.items():
            for service in ("redis", "reward", "reference", "rollout", "trainer"):
                assert not re.search(rf"(^|[@/,]){service}:\d", value), f"{name}: {key}={value} names a service"
    assert not listening["rollout"] & listening["trainer"], listening
    assert not (listening["rollout"] | listening["trainer"]) & set(host_ports.values())
    assert settings["trainer"].rollout_addrs == [f"127.0.0.1:{settings['rollout'].grpc_port}"]
    # the HTTP ports stay the ones docker-compose.yml publishes for them (docs/deploy.md: rollout 8000, trainer 8003)
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name, default in (("rollout", 8000), ("trainer", 8003)):
        assert settings[name].http_port == default
        assert base[name]["ports"] == [f"127.0.0.1:${{RLHF_{name.upper()}_HTTP_PORT:-{default}}}:8000"]
    # the others stay on the compose network, reachable by name from each other
    for name in ("reward", "reference", "redis"):
        assert "network_mode" not in merged[name], name


def test_environment_override_adds_the_service_and_wires_the_rollout(compose_files):
    """Multi-turn episodes: compose.environment.yaml adds the environment service and gives the rollout its address
    (and waits for it); without the file neither exists."""
    base = compose_files["docker-compose.yml"]["services"]
    assert "environment" not in base and "RLHF_ENVIRONMENT_ADDR" not in base["rollout"]["environment"]
    over = compose_files["compose.environment.yaml"]["services"]
    assert set(over) == {"environment", "rollout"}
    env = over["environment"]
    assert env["build"]["target"] == "environment" and env["build"]["args"] == {"ACCEL": "cpu"}
    assert env["image"] == "rlhf-pipeline/environment:${RLHF_IMAGE_TAG:-0.1.0}-cpu"
    ns = parse_container_command(env["command"])
    assert (ns.command, ns.service, ns.config) == ("serve", "environment", "/etc/rlhf/config.yaml")
    assert (ns.grpc_port, ns.http_port) == (50051, 8000)
    assert env["healthcheck"]["test"] == base["reward"]["healthcheck"]["test"]
    assert env["environment"]["RLHF_API_TOKEN"] == "${RLHF_API_TOKEN:?set RLHF_API_TOKEN}"
    (config,) = env["volumes"]
    assert config.startswith("${RLHF_EXPERIMENT_CONFIG:?") and config.endswith(":/etc/rlhf/config.yaml:ro")
    assert over["rollout"]["environment"] == {"RLHF_ENVIRONMENT_ADDR": "environment:50051"}
    assert over["rollout"]["depends_on"] == {"environment": {"condition": "service_healthy"}}
    assert "container_name" not in env, "a fixed container name prevents --scale"


@pytest.mark.parametrize(("overrides", "flavour"), [((), "cpu"), (("compose.gpu.yaml",), "cuda")])
def test_environment_override_merged(overrides, flavour):
    merged = _merged((*overrides, "compose.environment.yaml"), RLHF_EXPERIMENT_CONFIG="./configs/demo.yaml")
    rollout, env = merged["rollout"], merged["environment"]
    assert rollout["environment"]["RLHF_ENVIRONMENT_ADDR"] == "environment:50051"
    assert rollout["environment"]["RLHF_REWARD_ADDR"] == "reward:50051", "merged into the base's variables"
    assert set(rollout["depends_on"]) == {"redis", "reward", "reference", "environment"}
    assert rollout["image"].endswith(f"-{flavour}") and env["image"].endswith("-cpu")
    assert "deploy" not in env, "no accelerator for the environment service"
    (mount,) = env["volumes"]
    target = mount["target"] if isinstance(mount, dict) else str(mount).split(":")[1]
    assert target == "/etc/rlhf/config.yaml"
    assert _published(env["ports"], 8000) == 8004

    settings = ServiceSettings.from_env({k: str(v) for k, v in env["environment"].items()})
    assert (settings.grpc_port, settings.http_port, settings.api_token) == (50051, 8000, "t")


def test_environment_override_needs_a_config_that_names_the_environment():
    exe = _compose()
    if exe is None:
        pytest.skip("docker-compose is not installed (`make deploy-tools` installs it); the YAML checks above ran")
    env = {k: v for k, v in os.environ.items() if k != "RLHF_EXPERIMENT_CONFIG"}
    proc = subprocess.run(
        [*exe, "-f", "docker-compose.yml", "-f", "compose.environment.yaml", "config", "-q"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "RLHF_API_TOKEN": "t"},
        timeout=60,
    )
    assert proc.returncode != 0 and "RLHF_EXPERIMENT_CONFIG" in proc.stderr, proc.stderr


def test_environment_service_runs_as_the_override_defines_it(compose_files, tmp_path):
    """The override's command and environment as a local process (free loopback ports for 50051 / 8000, the config
    file for the mount): the image's health check passes on /readyz, and an episode call needs the token."""
    svc = compose_files["compose.environment.yaml"]["services"]["environment"]
    config = tmp_path / "config.yaml"
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    config.write_text(yaml.safe_dump({**cfg, "environment": {"name": "builtin:calculator"}}))
    grpc_port, http_port = free_ports(2)
    local = {"/etc/rlhf/config.yaml": str(config), "50051": str(grpc_port), "8000": str(http_port), "0.0.0.0": HOST}
    token = "compose-environment-token"
    env = interpolate(svc["environment"], {"RLHF_API_TOKEN": token})
    env = {k: local.get(str(v), str(v)) for k, v in env.items()}
    env.update(PATH=os.environ["PATH"], HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    argv = [local.get(a, a) for a in svc["command"]]
    assert argv[0] == "rlhf"
    argv[0] = str(Path(sys.executable).parent / "rlhf")
    health = [sys.executable, str(ROOT / "docker" / "healthcheck.py")]  # the image's HEALTHCHECK and compose's test
    assert svc["healthcheck"]["test"] == ["CMD", "python3", "/opt/rlhf/healthcheck.py"]
    child = Child("environment", argv, tmp_path / "environment.log", env=env, cwd=tmp_path).start()
    try:
        deadline = time.monotonic() + 90
        while subprocess.run(health, env=env, capture_output=True, timeout=10).returncode != 0:
            assert child.running, (tmp_path / "environment.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "not healthy within 90 s"
            time.sleep(0.3)
        url = f"http://{HOST}:{http_port}/v1/episodes/reset"
        body = {"episode_id": "job-1/0/0", "prompt": [{"role": "user", "content": "what is 2 plus 3?"}], "label": "5"}
        assert httpx.post(url, json=body, timeout=10).status_code == 401
        ok = httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert ok.status_code == 200 and ok.json()["tools"], ok.text
    finally:
        child.stop(10)


def test_training_service_is_a_profile_of_its_own(compose_files):
    """`--profile training` adds the training service (tinker SDK API): the training image (trainer + peft), the
    users' keys from the environment, its checkpoints on a volume of their own, the services' health check."""
    base = compose_files["docker-compose.yml"]["services"]
    svc = base["training"]
    assert svc["profiles"] == ["training"]
    assert svc["build"]["target"] == "training" and svc["build"]["args"] == {"ACCEL": "cpu"}
    assert svc["image"] == "rlhf-pipeline/training:${RLHF_IMAGE_TAG:-0.1.0}-cpu"
    ns = parse_container_command(svc["command"])
    assert (ns.command, ns.service, ns.config, ns.grpc_port, ns.http_port) == (
        "serve",
        "training",
        "/etc/rlhf/config.yaml",
        50051,
        8000,
    )
    env = svc["environment"]
    assert env["RLHF_API_TOKEN"] == "${RLHF_API_TOKEN:?set RLHF_API_TOKEN}"
    assert env["RLHF_TRAINING_TOKENS"] == "${RLHF_TRAINING_TOKENS:-}" and env["RLHF_DEVICE"] == "cpu"
    assert "training-runs:/var/lib/rlhf/runs" in svc["volumes"] and "runs:/var/lib/rlhf/runs" not in svc["volumes"]
    assert "training-runs" in compose_files["docker-compose.yml"]["volumes"]
    assert svc["healthcheck"]["test"] == ["CMD", "python3", "/opt/rlhf/healthcheck.py"]
    assert svc["depends_on"] == {"models": {"condition": "service_completed_successfully"}}
    assert not any("training" in (other.get("depends_on") or {}) for other in base.values()), "nothing waits on it"
    gpu = compose_files["compose.gpu.yaml"]["services"]["training"]
    assert gpu["image"].endswith("-cuda") and gpu["environment"]["RLHF_DEVICE"] == "cuda"
    npu = compose_files["compose.npu.yaml"]["services"]["training"]
    assert npu["environment"]["RLHF_DEVICE"] == "npu" and npu["devices"][0] == "/dev/davinci${RLHF_TRAINING_NPU:-4}"


@pytest.mark.parametrize(("override", "flavour"), [("compose.gpu.yaml", "cuda"), ("compose.npu.yaml", "ascend-910b")])
def test_training_profile_merged(override, flavour):
    merged = _merged((override,))
    training = merged["training"]
    assert training["profiles"] == ["training"] and training["image"].endswith(f"-{flavour}")
    targets = [v["target"] if isinstance(v, dict) else v.split(":")[1] for v in training["volumes"]]
    assert targets.count("/etc/rlhf/config.yaml") == 1 and "/var/lib/rlhf/runs" in targets
