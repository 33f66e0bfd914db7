"""Which accelerators each service process of ``rlhf up`` sees: the seeds' ``resource_pool`` and
``num_gpus_for_train`` / ``num_gpus_for_infer`` on one machine.

The devices are handed out in order (trainer, the critic's own with ``resource_pool.critic [1]``, rollout replicas,
reference, reward) through the device runtime's visibility variable, so each process finds its own devices at index 0
and two roles never share one by accident.
Under Kubernetes the chart's resources place each role instead; on a CPU-only machine there is nothing to place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rlhf.config import ExperimentConfig

VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


@dataclass
class DevicePlan:
    env_var: str
    trainer: list[str] = field(default_factory=list)
    rollouts: list[list[str]] = field(default_factory=list)
    reference: list[str] = field(default_factory=list)
    reward: list[str] = field(default_factory=list)

    def env_for(self, name: str) -> dict[str, str]:
        """The visibility variable of the service called ``name`` (reward, reference, rollout[-i], trainer)."""
        if name.startswith("rollout"):
            ids = self.rollouts[int(name.rsplit("-", 1)[1]) if "-" in name else 0]
        else:
            ids = getattr(self, name)
        return {self.env_var: ",".join(ids)}

    def describe(self) -> str:
        rollout = " ".join(f"[{','.join(r)}]" for r in self.rollouts)
        return (
            f"devices: trainer [{','.join(self.trainer)}], rollout {rollout}, reference "
            f"[{','.join(self.reference)}], reward [{','.join(self.reward)}]"
        )


def infer_devices(cfg: ExperimentConfig) -> int | None:
    """Rollout's devices from the config: num_gpus_for_infer, else what resource_pool.actor_rollout leaves after the
    trainer's num_gpus_for_train (MindSpeed: actor_rollout counts training and inference together), else None."""
    a, pool = cfg.actor, cfg.resource_pool
    if a.num_gpus_for_infer is not None:
        return a.num_gpus_for_infer
    if "actor_rollout" in pool.model_fields_set:
        left = pool.actor_rollout[0] - (a.num_gpus_for_train or 1)
        return left if left > 0 else None  # none left: rollout shares the trainer's devices (colocated)
    return None


def trainer_procs(cfg: ExperimentConfig, flag: int | None) -> int:
    """Trainer processes (an FSDP2 group under torchrun when > 1): ``actor_rollout.num_gpus_for_train`` when the config
    gives it, else ``--trainer-procs`` (default 1); both given and different is an error."""
    n = cfg.actor.num_gpus_for_train
    if n is None:
        return flag or 1
    if flag is not None and flag != n:
        raise ValueError(f"--trainer-procs {flag} contradicts actor_rollout.num_gpus_for_train {n}; give one of them")
    return n


def rollout_replicas(cfg: ExperimentConfig, flag: int | None) -> int:
    """Rollout processes: the config's rollout devices / tensor_model_parallel_size when it gives them, else
    ``--rollout-replicas`` (default 1); both given and different is an error."""
    infer, tp = infer_devices(cfg), cfg.actor.tensor_model_parallel_size
    if infer is None:
        return flag or 1
    if infer < tp or infer % tp:
        raise ValueError(
            f"rollout gets {infer} device(s) (resource_pool.actor_rollout - num_gpus_for_train, or "
            f"num_gpus_for_infer): not a positive multiple of tensor_model_parallel_size {tp}"
        )
    replicas = infer // tp
    if flag is not None and flag != replicas:
        raise ValueError(
            f"--rollout-replicas {flag} contradicts the config's {infer} rollout device(s) / "
            f"tensor_model_parallel_size {tp} = {replicas} replica(s); give one of them"
        )
    return replicas


def plan_devices(cfg: ExperimentConfig, visible: list[str], replicas: int, env_var: str) -> DevicePlan:
    """Hand out ``visible`` device ids; ValueError when the config asks for more than there are."""
    a, pool = cfg.actor, cfg.resource_pool
    train = a.num_gpus_for_train or 1
    per_replica = a.tensor_model_parallel_size
    colocated = infer_devices(cfg) is None  # training and inference on the same devices (resource_pool [1])
    if colocated and per_replica > train:
        raise ValueError(
            f"rollout shares the trainer's {train} device(s) but tensor_model_parallel_size is {per_replica}; give "
            "rollout devices (num_gpus_for_infer or a larger resource_pool.actor_rollout)"
        )
    rollout = 0 if colocated else per_replica * replicas
    # resource_pool.critic [1]: the critic's own device, seen by the trainer process after its own devices
    critic = pool.critic[0]
    wanted = {
        "trainer": train,
        "critic": critic,
        "rollout": rollout,
        "reference": pool.ref[0],
        "reward": pool.reward[0],
    }
    total = sum(wanted.values())
    if total > len(visible):
        parts = ", ".join(f"{k} {v}" for k, v in wanted.items())
        raise ValueError(
            f"the config asks for {total} devices ({parts}; resource_pool and "
            f"actor_rollout.num_gpus_for_*), this machine shows {len(visible)}"
        )
    it = iter(visible)
    take = lambda n: [next(it) for _ in range(n)]
    plan = DevicePlan(env_var, trainer=take(train + critic))
    plan.rollouts = [plan.trainer[:per_replica] if colocated else take(per_replica) for _ in range(replicas)]
    plan.reference, plan.reward = take(wanted["reference"]), take(wanted["reward"])
    return plan


def visible_devices(kind: str, env: dict[str, str] | None = None) -> list[str]:
    """The device ids this process may hand out: the visibility variable's list when set, else every device."""
    env = os.environ if env is None else env
    var = VISIBLE_ENV[kind]
    if env.get(var):
        return [d.strip() for d in env[var].split(",") if d.strip()]
    import torch  # noqa: PLC0415 - torch: the launcher plans devices without it

    count = torch.cuda.device_count() if kind == "cuda" else torch.npu.device_count()
    return [str(i) for i in range(count)]
