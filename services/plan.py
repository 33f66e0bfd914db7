"""What ``rlhf up`` starts: the services of one run in start order, each with its ports and the ``RLHF_*``
environment it needs (:func:`plan_services`), the full environment of a child process (:func:`child_env`) and the
default run folder. :mod:`services.launcher` starts, supervises and stops them."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf.procs import HOST, free_ports, serve_args

if TYPE_CHECKING:
    from services.devices import DevicePlan

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "rlhf-pipeline"


@dataclass
class ServiceSpec:
    """One service process to start."""

    name: str  # log and display name: reward, reference, rollout-0, trainer
    service: str  # argument of `rlhf serve`
    grpc_port: int
    http_port: int
    env: dict[str, str] = field(default_factory=dict)  # RLHF_* variables for this process (over the common ones)
    procs: int = 1  # > 1: the service runs under torch.distributed.run with this many processes (the trainer)

    @property
    def grpc_addr(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    tls: bool = False  # the service serves HTTPS (RLHF_TLS_CERT / RLHF_TLS_KEY)

    @property
    def http_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.http_port}"

    def argv(self, config: str | Path, python: str = sys.executable) -> list[str]:
        serve = serve_args(self.service, config, self.grpc_port, self.http_port)
        if self.procs > 1:  # rank 0 serves the ports; torchrun ends the whole group when any process dies
            return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.procs}", *serve]
        return [python, *serve]


def plan_services(
    *,
    redis_url: str,
    run_id: str,
    api_token: str,
    run_dir: Path,
    rollout_replicas: int = 1,
    ports: Sequence[int] | None = None,
    tls: bool = False,
    devices: DevicePlan | None = None,
    trainer_procs: int = 1,
    environment_replicas: int = 0,
    training_service: bool = False,
) -> list[ServiceSpec]:
    """The services of one run, in start order, with their ports and the ``RLHF_*`` variables each one needs.
    ``tls``: the services serve TLS (the certificate, key and CA come to them in the environment, as to ``rlhf up``).
    ``environment_replicas``: environment services (``environment.name`` set); rollout replica i uses i mod their
    number, since an episode lives in one environment process. ``training_service``: also the training service (the
    tinker SDK's API, config ``training_service.enabled``), on the trainer's devices."""
    n = 3 + rollout_replicas + environment_replicas + int(training_service)
    ports = list(ports) if ports is not None else free_ports(2 * n)
    if len(ports) < 2 * n:
        raise ValueError(f"need {2 * n} ports, got {len(ports)}")
    it = iter(ports)
    common = {"RLHF_REDIS_URL": redis_url, "RLHF_RUN_ID": run_id, "RLHF_API_TOKEN": api_token}
    reward = ServiceSpec("reward", "reward", next(it), next(it), dict(common))
    reference = ServiceSpec("reference", "reference", next(it), next(it), dict(common))
    environments = [
        ServiceSpec(
            f"environment-{i}" if environment_replicas > 1 else "environment",
            "environment",
            next(it),
            next(it),
            dict(common),
        )
        for i in range(environment_replicas)
    ]
    rollouts = [
        ServiceSpec(
            f"rollout-{i}" if rollout_replicas > 1 else "rollout",
            "rollout",
            next(it),
            next(it),
            {
                **common,
                "RLHF_REWARD_ADDR": reward.grpc_addr,
                "RLHF_REFERENCE_ADDR": reference.grpc_addr,
                **({"RLHF_ENVIRONMENT_ADDR": environments[i % len(environments)].grpc_addr} if environments else {}),
                "RLHF_REPLICA_ID": f"{run_id}-rollout-{i}",
                "RLHF_RUN_DIR": str(run_dir),  # a restarted replica starts from the run's newest checkpoint
                # the weight-sync data plane on a free port (the replica reports it in OpenWeightsTransfer); it is
                # plaintext, so off under TLS (weights then stream over gRPC)
                **({} if tls else {"RLHF_WEIGHTS_DATA_PORT": "0"}),
            },
        )
        for i in range(rollout_replicas)
    ]
    trainer = ServiceSpec(
        "trainer",
        "trainer",
        next(it),
        next(it),
        {
            **common,
            "RLHF_ROLLOUT_ADDRS": ",".join(r.grpc_addr for r in rollouts),
            "RLHF_REWARD_ADDR": reward.grpc_addr,  # the eval section's scores
            "RLHF_RUN_DIR": str(run_dir),
        },
        procs=trainer_procs,
    )
    # its own users' models (one LoRA adapter per SDK training client); RLHF_TRAINING_TOKENS comes from the launcher's
    # environment like every variable not set here
    training = [ServiceSpec("training", "training", next(it), next(it), dict(common))] if training_service else []
    specs = [reward, reference, *environments, *training, *rollouts, trainer]
    for spec in specs:
        spec.tls = tls
        if devices is not None:  # resource_pool / num_gpus_for_*: each process sees only its own devices
            if spec.service == "environment":  # text tasks: no accelerator
                spec.env[devices.env_var] = ""
            else:  # the training service has no resource_pool entry: it shares the trainer's devices
                spec.env.update(devices.env_for("trainer" if spec.service == "training" else spec.name))
    return specs


def child_env(spec_env: Mapping[str, str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The full environment of a child: ``base`` (default ``os.environ``) + defaults + the service's variables."""
    env = dict(os.environ if base is None else base)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("RLHF_CACHE_DIR", str(DEFAULT_CACHE_DIR))
    # Four torch processes share one machine here. Each may use every core, and idle OpenMP threads sleep instead of
    # spinning (PASSIVE), so whichever part works (rollout and scoring while the trainer waits for experience, the
    # trainer during an update) has all the cores (measured by bench.ring_threads, docs/benchmarks.md). Spinning
    # threads are what made every-core-each slower before (a spinning thread holds a core its descheduled peer needs;
    # docs/development.md#benchmarks). The user's values are kept.
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(spec_env)
    return env


def default_run_dir(run_id: str, root: str | Path = "runs", now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    return Path(root) / f"{run_id}-{stamp}"
