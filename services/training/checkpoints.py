"""The training service's checkpoints on disk: :class:`CheckpointStore`, one folder per training run under the root.

``<root>/<run>/run.json`` names the run's owner; ``weights/<name>/`` is a training checkpoint (``save_weights``: the
adapter ``adapter.safetensors``, the Adam state ``optimizer.safetensors``, ``state.json``); ``sampler_weights/<name>/``
a PEFT adapter folder (``save_weights_for_sampler``). Each holds ``checkpoint.json`` (created, expiry, user metadata).
A checkpoint is written to a hidden temporary folder, flushed (rlhf.checkpoints.fsync_files) and renamed into place, so
a crash leaves the whole checkpoint or none. Design: docs/tinker.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rlhf.checkpoints import fsync_files
from rlhf.lora import write_adapter
from rlhf.serving import InvalidArgument, NotFound
from services.training.futures import RequestFailed

log = logging.getLogger("rlhf.training")

SEGMENTS = {"weights": "training", "sampler_weights": "sampler"}
# Checkpoint lifetimes the SDK documents for ttl_seconds: 1 hour to 10 years (None: never expires).
MIN_TTL_S = 3600
MAX_TTL_S = 10 * 365 * 86400
CHECKPOINT_JSON = "checkpoint.json"


def run_dir_name(model_id: str) -> str:
    """The folder of a run under the checkpoint root; an id that would name a hidden or parent folder is refused."""
    if not model_id or model_id.startswith(".") or "/" in model_id or "\\" in model_id or len(model_id) > 200:
        raise InvalidArgument(f"{model_id!r} is not a training run id", field="model_id")
    return model_id.replace(":", "_")


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``tinker://<run>/<weights|sampler_weights>/<name>`` -> (run model id, segment, name)."""
    if not path.startswith("tinker://"):
        raise InvalidArgument(f"path {path!r} is not a tinker:// path", field="path")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENTS or not parts[0] or not parts[2]:
        raise InvalidArgument(f"path {path!r} is not tinker://<run>/weights/<name>", field="path")
    return parts[0], parts[1], parts[2]


def check_name(name: str, what: str) -> str:
    if not name or "/" in name or name in (".", "..") or name.startswith(".") or len(name) > 200:
        raise InvalidArgument(f"{what} {name!r}: give a plain name (no '/', not starting with '.')", field="path")
    return name


def checkpoint_record(meta: dict | None, ttl_seconds: int | None) -> dict:
    """``checkpoint.json`` of a checkpoint folder: when it was made, when it expires (None: never), user metadata."""
    if ttl_seconds is not None and not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise InvalidArgument(
            f"ttl_seconds {ttl_seconds} must be from {MIN_TTL_S} (1 hour) to {MAX_TTL_S} (10 years), or null for never",
            field="ttl_seconds",
        )
    now = time.time()
    expires = None if ttl_seconds is None else now + ttl_seconds
    return {
        "created": datetime.fromtimestamp(now, UTC).isoformat(),
        "expires_at": None if expires is None else datetime.fromtimestamp(expires, UTC).isoformat(),
        "expires_unix": expires,
        "user_metadata": meta,
    }


def read_record(folder: Path) -> dict:
    try:
        return json.loads((folder / CHECKPOINT_JSON).read_text())
    except (OSError, ValueError):
        return {}


def expired(folder: Path, now: float) -> bool:
    expires = read_record(folder).get("expires_unix")
    return expires is not None and expires <= now


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass(frozen=True)
class SamplerAdapter:
    """A sampler checkpoint's adapter as read: PEFT state-dict keys, and its LoRA shape."""

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float
    targets: list[str]


class CheckpointStore:
    """The checkpoints of every run over ``base_model`` under ``root``; each belongs to the user that made its run,
    and another user gets 404 for it, as for one that does not exist."""

    def __init__(self, root: str | Path, base_model: str):
        self.root = Path(root)
        self.base_model = base_model

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def _run_dir(self, run_id: str) -> Path:
        return self.root / run_dir_name(run_id)

    def _owns(self, owner: str, run_id: str) -> bool:
        run_json = self._run_dir(run_id) / "run.json"
        return run_json.is_file() and json.loads(run_json.read_text()).get("owner") == owner

    # ------------------------------------------------------------------------------------------------ writing

    def write_run(self, model_id: str, owner: str, lora: dict, meta: dict | None) -> None:
        """``run.json``: who owns the run, over which base, with which LoRA."""
        d = self._run_dir(model_id)
        d.mkdir(parents=True, exist_ok=True)
        body = {
            "model_id": model_id,
            "owner": owner,
            "base_model": self.base_model,
            "lora": lora,
            "user_metadata": meta,
        }
        _atomic_write(d / "run.json", json.dumps(body, indent=1))

    def save_training(
        self,
        model_id: str,
        name: str,
        overwrite: bool,
        tensors: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
        state: dict,
        record: dict,
    ) -> str:
        """Write ``weights/<name>``: ``tensors`` (the adapter, the Adam moments), ``state`` (state.json) and
        ``record``; returns its tinker:// path."""
        final = self._run_dir(model_id) / "weights" / name
        if final.exists() and not overwrite:
            raise RequestFailed(f"checkpoint {name!r} exists already for this run: pick another name or overwrite")
        tmp = final.parent / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir(parents=True)
        adapter, moments = tensors
        save_file(adapter, tmp / "adapter.safetensors")
        save_file(moments, tmp / "optimizer.safetensors")
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        (tmp / CHECKPOINT_JSON).write_text(json.dumps(record, indent=1))
        fsync_files(tmp, recursive=False, folder=True)  # a checkpoint folder is flat
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_files(final.parent, recursive=False, folder=True)  # the rename
        return f"tinker://{model_id}/weights/{name}"

    def save_sampler(self, model_id: str, name: str, adapter: SamplerAdapter, record: dict) -> str:
        """Write ``sampler_weights/<name>``, a PEFT adapter folder over the base model; returns its tinker:// path."""
        final = self._run_dir(model_id) / "sampler_weights" / name
        tmp = final.parent / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        write_adapter(tmp, adapter.tensors, adapter.rank, adapter.alpha, adapter.targets, self.base_model)
        (tmp / CHECKPOINT_JSON).write_text(json.dumps(record, indent=1))
        fsync_files(tmp, recursive=False, folder=True)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        return f"tinker://{model_id}/sampler_weights/{name}"

    def sweep(self, now: float) -> list[Path]:
        """Delete the checkpoints whose ``ttl_seconds`` ran out by ``now`` (wall clock); returns their folders."""
        gone = []
        for record in self.root.glob(f"*/*/*/{CHECKPOINT_JSON}"):
            folder = record.parent
            if not folder.name.startswith(".") and expired(folder, now):
                shutil.rmtree(folder, ignore_errors=True)
                gone.append(folder)
                log.info("training: checkpoint %s expired", folder)
        return gone

    # ------------------------------------------------------------------------------------------------ reading

    def training_checkpoint(self, owner: str, path: str) -> tuple[Path, dict]:
        """The folder and ``state.json`` of ``owner``'s training checkpoint ``path`` (``load_weights``)."""
        run_id, segment, name = parse_tinker_path(path)
        if segment != "weights":
            raise InvalidArgument(
                f"path {path!r} is a sampler checkpoint: load_weights takes a training checkpoint (save_state)",
                field="path",
            )
        folder = self._run_dir(run_id) / "weights" / check_name(name, "checkpoint name")
        state_file = folder / "state.json"
        if not state_file.is_file():
            raise NotFound(f"checkpoint {path!r} does not exist", field="path")
        state = json.loads(state_file.read_text())
        if state.get("owner") != owner:
            raise NotFound(f"checkpoint {path!r} does not exist", field="path")
        if expired(folder, time.time()):
            raise NotFound(f"checkpoint {path!r} has expired (its ttl_seconds ran out)", field="path")
        if state.get("base_model") != self.base_model:
            # 400, not 409: the SDK resends 409s for minutes, and this one never changes
            raise InvalidArgument(
                f"checkpoint {path!r} is over base model {state.get('base_model')!r}; this service serves "
                f"{self.base_model!r}",
                field="path",
            )
        return folder, state

    @staticmethod
    def read_adapter(folder: Path) -> dict[str, torch.Tensor]:
        """A training checkpoint's adapter (canonical parameter names)."""
        return load_file(folder / "adapter.safetensors")

    @staticmethod
    def read_moments(folder: Path) -> dict[str, torch.Tensor]:
        """A training checkpoint's Adam moments (``<name>.exp_avg``, ``<name>.exp_avg_sq``)."""
        return load_file(folder / "optimizer.safetensors")

    def sampler_checkpoint(self, owner: str, path: str) -> Path:
        """The folder of ``owner``'s sampler checkpoint ``path`` (``create_sampling_session``)."""
        run_id, segment, name = parse_tinker_path(path)
        if segment != "sampler_weights":
            raise InvalidArgument(
                f"path {path!r} is a training checkpoint: sample from a sampler checkpoint "
                "(save_weights_for_sampler, tinker://<run>/sampler_weights/<name>)",
                field="model_path",
            )
        folder = self._run_dir(run_id) / "sampler_weights" / check_name(name, "sampler checkpoint name")
        if not (folder / "adapter_model.safetensors").is_file() or not self._owns(owner, run_id):
            raise NotFound(f"sampler checkpoint {path!r} does not exist", field="model_path")
        if expired(folder, time.time()):
            raise NotFound(f"sampler checkpoint {path!r} has expired (its ttl_seconds ran out)", field="model_path")
        return folder

    @staticmethod
    def version_key(folder: Path) -> str:
        """One key per written version of a checkpoint folder (a rewrite of the same name is a new key)."""
        return f"{folder}@{read_record(folder).get('created')}"

    def read_sampler(self, folder: Path, device: str) -> SamplerAdapter:
        config = json.loads((folder / "adapter_config.json").read_text())
        if config.get("base_model_name_or_path") != self.base_model:
            raise InvalidArgument(
                f"sampler checkpoint {folder.name!r} is over {config.get('base_model_name_or_path')!r}; this service "
                f"serves {self.base_model!r}",
                field="model_path",
            )
        tensors = load_file(folder / "adapter_model.safetensors", device=str(device))
        return SamplerAdapter(tensors, int(config["r"]), float(config["lora_alpha"]), list(config["target_modules"]))

    def list(self, owner: str, run_id: str) -> list[dict[str, Any]]:
        """``owner``'s checkpoints of run ``run_id`` that have not expired, as the SDK's Checkpoint."""
        if not self._owns(owner, run_id):
            raise NotFound(f"training run {run_id!r} does not exist (or is not yours)", field="model_id")
        d = self._run_dir(run_id)
        out = []
        for segment, kind in SEGMENTS.items():
            for folder in sorted((d / segment).glob("[!.]*")):
                size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
                record = read_record(folder)
                if expired(folder, time.time()):
                    continue
                out.append(
                    {
                        "checkpoint_id": f"{segment}/{folder.name}",
                        "checkpoint_type": kind,
                        "time": record.get("created")
                        or datetime.fromtimestamp(folder.stat().st_mtime, UTC).isoformat(),
                        "tinker_path": f"tinker://{run_id}/{segment}/{folder.name}",
                        "size_bytes": size,
                        "public": False,
                        "user_metadata": record.get("user_metadata"),
                        "expires_at": record.get("expires_at"),
                    }
                )
        return out
