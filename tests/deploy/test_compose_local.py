"""docker-compose.yml, run without Docker: every service's own command, environment, health check and start order.

The compose file is read with ``yaml.safe_load`` and its variables are interpolated the way Compose does (from a test
environment holding RLHF_API_TOKEN and RLHF_EXPERIMENT_CONFIG). Each service then runs as a local process:
redis-server, the ``models`` init service (``python3 -m rlhf.tiny``), reward, reference, rollout and trainer, each
started through the image's ENTRYPOINT (docker/entrypoint.sh) with the compose ``command`` and ``environment``, each
started only when its ``depends_on`` conditions hold (``service_healthy``: the service's compose health check
command, run as Compose would run it, exits 0; ``service_completed_successfully``: the process exited 0). The
trainer must then finish a short run (train_iters 2, a copy of the mounted config) with exit status 0 and write
metrics.jsonl into the ``runs`` volume.

Everything that differs from the containers is in ``local_adaptations`` below, and nowhere else.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import ROOT, SERVICES

from rlhf.procs import Child, free_ports, stop_children

pytestmark = pytest.mark.slow

COMPOSE_FILE = ROOT / "docker-compose.yml"
TRAIN_ITERS = 2
DEADLINE_S = 360.0  # the whole run (about 1.5-3 min on 2 idle cores; more when the machine is shared)
HEALTH_POLL_S = 0.5  # instead of each health check's `interval` (10s / 5s): the test only waits for the first pass
MAX_STOP_GRACE_S = 20.0


# ------------------------------------------------------------ Compose's variable interpolation

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


class InterpolationError(ValueError):
    pass


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?err}``, ``${VAR?err}``,
    ``${VAR:+alt}``, ``${VAR+alt}`` and ``$$`` in every string of ``value`` (dicts and lists recursively)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["named"]
        op, arg = m["op"], m["arg"] or ""
        is_set = name in env
        usable = is_set and (env[name] != "" or not (op or "").startswith(":"))
        if op in (":-", "-"):
            return env[name] if usable else arg
        if op in (":?", "?"):
            if not usable:
                raise InterpolationError(f"{name}: {arg}")
            return env[name]
        if op in (":+", "+"):
            return arg if usable else ""
        return env.get(name, "")

    return _VAR.sub(one, value)


# ------------------------------------------------------------ the local form of one service


@dataclass
class LocalService:
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    healthcheck: list[str] | None  # argv of the health check, run with the service's env and cwd; None: disabled
    health_timeout_s: float = 5.0
    stop_grace_s: float = 10.0
    depends_on: dict[str, str] = field(default_factory=dict)  # service -> condition


def _seconds(text: str | None, default: float) -> float:
    if not text:
        return default
    total = 0.0
    for num, unit in re.findall(r"([\d.]+)(ms|h|m|s)", str(text)):
        total += float(num) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def _rlhf_executable() -> list[str]:
    venv_rlhf = Path(sys.executable).parent / "rlhf"
    return [str(venv_rlhf)] if venv_rlhf.is_file() else [sys.executable, "-m", "services.cli"]


def local_adaptations(compose: dict[str, Any], tmp: Path) -> dict[str, LocalService]:
    """EVERY difference between a compose container and the local process that stands in for it, in one place.

    1. Executables. ``rlhf`` -> ``.venv/bin/rlhf`` next to this Python (else ``python -m services.cli``); ``python3``
       -> this Python (sys.executable); ``redis-server`` / ``redis-cli`` -> the ones on PATH.
    2. ENTRYPOINT. Services built from docker/Dockerfile run through its ENTRYPOINT (``/opt/rlhf/entrypoint.sh``,
       i.e. docker/entrypoint.sh, run with bash) unless compose sets ``entrypoint``; redis-server runs directly (the
       official image's entrypoint only drops privileges).
    3. File system. Each service gets a private root ``<tmp>/<service>/root``; every absolute path in its command,
       environment and health check is taken relative to that root. Into it go, as symlinks: the compose
       ``volumes`` (named volumes -> ``<tmp>/volumes/<name>``, shared between services like Docker's; bind mounts ->
       the host path, e.g. the experiment config) and the image files the commands use (``COPY docker/healthcheck.py
       docker/entrypoint.sh /opt/rlhf/``). The working directory is the image's WORKDIR under that root
       (``/var/lib/rlhf``; ``/data`` for redis), so relative paths in the config (``save: runs/demo/...``) land in the
       ``runs`` volume as they do in the container.
    4. Network. Each service's container ports (50051 gRPC and 8000 HTTP for ours, 6379 for redis) -> free loopback
       ports: ``<service>:<port>`` in a value (``redis:6379``, ``reward:50051``, ``rollout:50051``) becomes
       ``127.0.0.1:<its local port>``, and a value that is exactly one of the service's own container ports
       (``--grpc-port 50051``, ``RLHF_HTTP_PORT: "8000"``) becomes its own local port. ``RLHF_HOST: 0.0.0.0`` ->
       ``127.0.0.1`` and redis-server gets ``--port <local> --bind 127.0.0.1`` (a container's 0.0.0.0 is its own
       network namespace; here it would be the host's). ``redis-cli`` in a health check gets ``-p <local>`` (a
       ``CMD-SHELL`` check runs with ``sh -c``). ``ports:`` (host publishing) is not needed: the test reaches each
       service on its local port.
    5. Environment. The compose ``environment`` (interpolated, then 3. and 4.) over a minimal base: PATH, HOME (a
       directory under the service's root, like the image's HOME=/home/rlhf), PYTHONUNBUFFERED=1 (image ENV) and
       OMP_NUM_THREADS = cores / 4 (four torch processes share this machine, as in ``rlhf up``; a container sees
       the same cores, so this is only about the test's speed). Nothing else of the host environment leaks in.
    6. Timing. Health checks are polled every HEALTH_POLL_S instead of ``interval``; ``timeout`` is kept; the overall
       wait is DEADLINE_S instead of ``start_period`` + ``retries`` x ``interval``. ``stop_grace_period`` is kept (at
       most MAX_STOP_GRACE_S). ``restart``, ``shm_size``, ``build`` and ``image`` have no local meaning.
    (The experiment config itself is not an adaptation: the test sets RLHF_EXPERIMENT_CONFIG, the compose file's
    own variable, to a copy of configs/demo.yaml with train_iters 2.)
    """
    services: dict[str, Any] = compose["services"]
    image_files = {
        "/opt/rlhf/healthcheck.py": ROOT / "docker" / "healthcheck.py",
        "/opt/rlhf/entrypoint.sh": ROOT / "docker" / "entrypoint.sh",
    }
    image_entrypoint = ["bash", "/opt/rlhf/entrypoint.sh"]
    executables = {
        "rlhf": _rlhf_executable(),
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        "python3": [sys.executable],
        "python": [sys.executable],
        "redis-server": [shutil.which("redis-server") or "redis-server"],
        "redis-cli": [shutil.which("redis-cli") or "redis-cli"],
    }
    container_ports = {name: ([6379] if name == "redis" else [50051, 8000]) for name in services}
    flat = free_ports(sum(len(p) for p in container_ports.values()))
    local_port = {(name, cp): flat.pop() for name, ports in container_ports.items() for cp in ports}
    host_port = re.compile(r"\b(" + "|".join(map(re.escape, services)) + r"):(\d+)\b")
    volumes_dir = tmp / "volumes"

    out: dict[str, LocalService] = {}
    for name, svc in services.items():
        is_redis = name == "redis"
        ours = (svc.get("build") or {}).get("dockerfile") == "docker/Dockerfile"
        root = tmp / name / "root"

        # 3. the private root: volumes and image files as symlinks
        mounts: dict[str, Path] = dict(image_files) if ours else {}
        for spec in svc.get("volumes") or []:
            source, target = spec.split(":")[:2]
            if source.startswith((".", "/", "~")):
                host = (COMPOSE_FILE.parent / os.path.expanduser(source)).resolve()
            else:
                host = volumes_dir / source
                host.mkdir(parents=True, exist_ok=True)
            mounts[target] = host
        for target, host in mounts.items():
            link = root / target.lstrip("/")
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(host)
        workdir = root / ("data" if is_redis else "var/lib/rlhf")
        workdir.mkdir(parents=True, exist_ok=True)

        def localize(value: Any, name: str = name, root: Path = root) -> str:
            value = str(value)
            value = host_port.sub(lambda m: f"127.0.0.1:{local_port[(m[1], int(m[2]))]}", value)  # KeyError: new port
            if value.isdigit() and (name, int(value)) in local_port:
                return str(local_port[(name, int(value))])
            if value.startswith("/"):
                return str(root) + value
            return value

        def program(argv: list[str], extra: list[str] = ()) -> list[str]:
            return [*executables.get(argv[0], [argv[0]]), *extra, *(localize(a) for a in argv[1:])]

        # 1., 2., 4. the command
        command = list(svc.get("command") or [])
        if is_redis:
            argv = program(command, ["--port", str(local_port[("redis", 6379)]), "--bind", "127.0.0.1"])
        else:
            entrypoint = svc.get("entrypoint", image_entrypoint if ours else [])
            entry = [entrypoint[0], *(localize(a) for a in entrypoint[1:])] if entrypoint else []
            argv = entry + program(command)

        # 5. the environment
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(root / "home" / "rlhf"),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 4)),
        }
        (root / "home" / "rlhf").mkdir(parents=True, exist_ok=True)
        for key, value in (svc.get("environment") or {}).items():
            env[key] = "127.0.0.1" if key == "RLHF_HOST" else localize(value)

        # 6. the health check
        hc = svc.get("healthcheck") or {}
        check = None
        if hc and not hc.get("disable"):
            check = local_healthcheck(hc["test"], program, local_port.get(("redis", 6379)))

        out[name] = LocalService(
            name=name,
            argv=argv,
            env=env,
            cwd=workdir,
            healthcheck=check,
            health_timeout_s=_seconds(hc.get("timeout"), 30.0),
            stop_grace_s=min(MAX_STOP_GRACE_S, _seconds(svc.get("stop_grace_period"), 10.0)),
            depends_on=_depends(svc.get("depends_on")),
        )
    return out


def local_healthcheck(test: list[str], program, redis_port: int | None) -> list[str]:
    """A compose health check -> the local argv (adaptations 1 and 4): ``CMD`` runs its argv; ``CMD-SHELL`` runs
    its string with ``sh -c``, where only a leading ``redis-cli`` is handled (made the local one, with ``-p``)."""
    assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), f"unhandled health check: {test}"
    if test[0] == "CMD-SHELL":
        (line,) = test[1:]
        assert line.startswith("redis-cli "), f"only redis-cli shell health checks are handled: {line}"
        redis_cli = shlex.join([*program(["redis-cli"]), "-p", str(redis_port)])
        return ["sh", "-c", redis_cli + line[len("redis-cli") :]]
    if test[1] == "redis-cli":
        return program(test[1:], ["-p", str(redis_port)])
    return program(test[1:])


def _depends(value: Any) -> dict[str, str]:
    """``depends_on`` (short or long syntax) -> {service: condition}."""
    if isinstance(value, list):
        return {name: "service_started" for name in value}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in (value or {}).items()}


# ------------------------------------------------------------ the run


def _healthy(svc: LocalService) -> tuple[bool, str]:
    assert svc.healthcheck is not None
    try:
        proc = subprocess.run(
            svc.healthcheck, env=svc.env, cwd=svc.cwd, capture_output=True, text=True, timeout=svc.health_timeout_s
        )
    except subprocess.TimeoutExpired:
        return False, "timed out"
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def _experiment_config(tmp: Path) -> Path:
    """A copy of the config the compose file mounts by default, shortened to a few small steps."""
    default = re.search(r"\$\{RLHF_EXPERIMENT_CONFIG:-([^}]+)\}", COMPOSE_FILE.read_text())
    assert default, "docker-compose.yml no longer mounts ${RLHF_EXPERIMENT_CONFIG:-...}"
    cfg = yaml.safe_load((COMPOSE_FILE.parent / default[1]).read_text())
    cfg["training"].update(train_iters=TRAIN_ITERS, global_batch_size=8)
    cfg["actor_rollout_ref"]["actor_rollout"].update(ppo_mini_batch_size=8, ppo_epochs=1)
    cfg["critic"].update(critic_mini_batch_size=8, critic_update_epochs=1)
    path = tmp / "experiment.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_compose_interpolation_requires_the_api_token():
    raw = yaml.safe_load(COMPOSE_FILE.read_text())
    with pytest.raises(InterpolationError, match="RLHF_API_TOKEN"):
        interpolate(raw, {})


def test_compose_services_run_as_local_processes(tmp_path):
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail("redis-server / redis-cli are not on PATH (apt-get install -y redis-server)")
    t0 = time.monotonic()
    token = secrets.token_hex(16)
    compose_env = {"RLHF_API_TOKEN": token, "RLHF_EXPERIMENT_CONFIG": str(_experiment_config(tmp_path))}
    compose = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), compose_env)
    local = local_adaptations(compose, tmp_path)
    assert set(SERVICES) <= set(local)
    assert local["rollout"].env["RLHF_API_TOKEN"] == token

    children: dict[str, Child] = {}
    healthy: dict[str, float] = {}  # service -> seconds after t0 when its health check first passed
    health_out: dict[str, str] = {}
    order: list[str] = []

    def ready(dep: str, condition: str) -> bool:
        child = children.get(dep)
        if condition == "service_started":
            return child is not None
        if condition == "service_healthy":
            return dep in healthy
        if condition == "service_completed_successfully":
            return child is not None and child.poll() is not None and child.poll() == 0
        raise AssertionError(f"unknown depends_on condition {condition}")

    def failure(msg: str) -> str:
        tails = "\n".join(f"--- {n}: {c.log_path}\n{c.log_tail(25)}" for n, c in children.items())
        return f"{msg} ({time.monotonic() - t0:.0f}s)\nstart order: {order}\nhealth: {health_out}\n{tails}"

    try:
        while True:
            for name, svc in local.items():
                if name not in children and all(ready(d, c) for d, c in svc.depends_on.items()):
                    child = Child(name, svc.argv, tmp_path / "logs" / f"{name}.log", env=svc.env, cwd=svc.cwd)
                    children[name] = child.start()
                    order.append(name)
            for name, child in children.items():
                rc = child.poll()
                svc = local[name]
                if rc is not None:
                    if svc.healthcheck is None or name == "trainer":
                        assert rc == 0, failure(f"{name} exited with {rc}")
                    else:
                        pytest.fail(failure(f"{name} exited with {rc}"))
                elif svc.healthcheck is not None and name not in healthy:
                    ok, said = _healthy(svc)
                    health_out[name] = said[-300:]
                    if ok:
                        healthy[name] = time.monotonic() - t0
            trainer = children.get("trainer")
            if trainer is not None and trainer.poll() == 0:
                break
            assert time.monotonic() - t0 < DEADLINE_S, failure(f"the trainer did not finish within {DEADLINE_S:.0f}s")
            time.sleep(HEALTH_POLL_S)

        # every service came up in compose's order, and every long-running one passed its own health check
        assert order.index("models") < min(order.index("reward"), order.index("reference")), order
        assert order.index("rollout") > max(order.index(n) for n in ("redis", "reward", "reference")), order
        assert order.index("trainer") > order.index("rollout"), order
        assert {"redis", "reward", "reference", "rollout"} <= set(healthy), failure("health checks")
        for name in ("reward", "reference", "rollout", "trainer"):
            log = children[name].log_path.read_text(errors="replace")
            assert "unknown environment variable" not in log, f"{name}: compose sets a variable nothing reads"

        # the trainer wrote its metrics into the `runs` volume (config `save: runs/demo/...` under WORKDIR)
        metrics_files = list((tmp_path / "volumes" / "runs").rglob("metrics.jsonl"))
        assert len(metrics_files) == 1, failure(f"metrics.jsonl in the runs volume: {metrics_files}")
        records = [json.loads(line) for line in metrics_files[0].read_text().splitlines() if line.strip()]
        assert len(records) == TRAIN_ITERS, records
        assert [r["step"] for r in records] == list(range(1, TRAIN_ITERS + 1)), records
    finally:
        stop_children(
            reversed(list(children.values())),
            grace_s=max((local[n].stop_grace_s for n in children), default=10.0),
        )
    first_healthy = ", ".join(f"{n} {t:.0f}s" for n, t in healthy.items())
    print(
        f"\ncompose as local processes: start order {order}; healthy: {first_healthy}; "
        f"trainer exited 0 after {time.monotonic() - t0:.0f}s"
    )
