"""``checkpoint``: a one-rank process group's trainer (FSDP2, as a torchrun trainer) saves a DCP checkpoint and
loads it into a one-rank group and into a plain world-1 trainer: every weight and AdamW moment bit for bit."""

from __future__ import annotations

import datetime
import gc
import os
import shutil
import time
from pathlib import Path
from typing import Any

from bench.device_check.common import Record, sync
from bench.device_check.trainer import experiences, trainer_config
from rlhf.procs import free_port


def _full_state(engine) -> dict[str, Any]:
    """Every weight and optimizer tensor of actor and critic, full (gathered) and on the CPU, keyed by name."""
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {}
    for role, model, opt in (("actor", engine.actor, engine.actor_opt), ("critic", engine.critic, engine.critic_opt)):
        for k, v in get_model_state_dict(model, options=full).items():
            out[f"{role}.{k}"] = v.detach().cpu().clone()
        for name, st in get_optimizer_state_dict(model, opt, options=full)["state"].items():
            for key, v in st.items():
                if torch.is_tensor(v):
                    out[f"{role}_optim.{name}.{key}"] = v.detach().cpu().clone()
    return out


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    names = sorted(set(a) | set(b))
    return [n for n in names if n not in a or n not in b or not torch.equal(a[n], b[n])]


def run(p: dict[str, Any], rec: Record) -> None:
    import torch  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    import torch.distributed as tdist  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    from rlhf import distributed as rd  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process
    from services.trainer.engine import TrainerEngine  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

    device = torch.device(p["device"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    from_env = rd.init_from_env

    def one_rank_group(dev, timeout_s):
        # rlhf.distributed forms no group at world size 1; this process group of one rank takes the torchrun
        # trainer's code path instead: FSDP2 sharding, DCP checkpoints (``sharded/``), the driver's commands

        backend = rd.backend_for(dev.type)
        if not tdist.is_initialized():
            if dev.type == "cuda":
                torch.cuda.set_device(0)
            tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        return rd.Group(0, 1, 0, backend)

    def free() -> None:  # after ``del engine``: one trainer's memory at a time
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    cfg = trainer_config(p)
    root = Path(p["work"]) / "checkpoint"
    shutil.rmtree(root, ignore_errors=True)
    rd.init_from_env = one_rank_group
    try:
        engine = TrainerEngine(cfg)
        from torch.distributed.tensor import DTensor  # noqa: PLC0415 - the driver imports every phase module: this loads in the phase's own process

        rec.put(backend=engine.group.backend)
        rec.check("fsdp2_sharded", all(isinstance(q, DTensor) for q in engine.actor.parameters()))
        metrics = engine.step(experiences(p["trainer"], seed=11))
        rec.put(step_loss=round(metrics.get("loss/policy", float("nan")), 5))
        saved = _full_state(engine)
        sync(p)
        t0 = time.perf_counter()
        path = save_checkpoint(root, engine, {"trained_job_ids": ["device-check"]})
        rec.put(
            save_seconds=round(time.perf_counter() - t0, 2),
            path=str(path),
            bytes=sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
            tensors=len(saved),
        )
        rec.check("dcp_written", (path / "sharded").is_dir())
        engine.stop_followers()
        del engine
        free()

        engine = TrainerEngine(cfg)
        t0 = time.perf_counter()
        load_checkpoint(latest_checkpoint(root), engine)
        rec.put(load_group_seconds=round(time.perf_counter() - t0, 2))
        diff = _differences(saved, _full_state(engine))
        rec.put(group_differences=diff[:10])
        rec.check("restored_in_group", not diff)
        engine.stop_followers()
        del engine
        free()

        rd.init_from_env = from_env  # a plain world-1 trainer (no group, nothing sharded) reads the DCP checkpoint
        engine = TrainerEngine(cfg)
        t0 = time.perf_counter()
        state = load_checkpoint(latest_checkpoint(root), engine)
        rec.put(load_single_seconds=round(time.perf_counter() - t0, 2))
        diff = _differences(saved, _full_state(engine))
        rec.put(single_differences=diff[:10])
        rec.check("restored_single_process", not diff)
        rec.check("state_json", state.get("trained_job_ids") == ["device-check"] and state.get("step") == 1)
        del engine
        free()
    finally:
        rd.init_from_env = from_env
        if tdist.is_initialized():
            tdist.destroy_process_group()
