"""Reading the trainer's checkpoint folders (the layout ``services.trainer.checkpoint`` writes), for every process
that needs the newest complete one: the trainer when it resumes, a rollout replica that starts while the trainer is
down (it loads the policy the trainer will resume from).

A checkpoint ``<root>/step_<N>/`` is complete when its ``manifest.json`` lists every file with its size (written
last); ``<root>/latest`` names the newest. Nothing here imports torch; :func:`load_policy` reads safetensors only.
:func:`fsync_files` is the one durable-write step of every checkpoint writer (the trainer's, the training service's).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def fsync_files(path: Path, *, recursive: bool, folder: bool) -> None:
    """Flush the files in the folder ``path`` to disk before it is renamed into place: the files directly in it, or
    (``recursive``) at every depth; with ``folder``, the folder's own entry list too (the names created or renamed
    in it), which a rename's durability needs. A missing ``path`` has no files to flush."""
    if path.is_dir():
        for f in path.rglob("*") if recursive else path.iterdir():
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
    if folder:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def checkpoint_root(run_dir: str | Path | None, save: str | Path) -> Path:
    """Where a run's checkpoints are: ``<RLHF_RUN_DIR>/checkpoints`` when the run folder is set, else the config's
    ``training.save``."""
    return Path(run_dir) / "checkpoints" if run_dir else Path(save)


def incomplete_reason(path: str | Path) -> str | None:
    """Why the checkpoint folder ``path`` must not be loaded, or None when its manifest matches its files."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        return f"{path} has no {MANIFEST} (the writer did not finish)"
    except ValueError as err:
        return f"{path}/{MANIFEST} is not valid JSON ({err})"
    for name, size in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{path} is missing {name}"
        if f.stat().st_size != size:
            return f"{path}/{name} has {f.stat().st_size} bytes, the manifest says {size}"
    if "state.json" not in manifest.get("files", {}):
        return f"{path}/{MANIFEST} does not list state.json"
    return None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names if it is complete, else the complete ``step_<N>`` with the highest N, else
    None."""
    root = Path(root)
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text().strip()
        if incomplete_reason(path) is None:
            return path
    steps = []
    for p in root.glob("step_*"):
        suffix = p.name[len("step_") :]
        if suffix.isdigit() and incomplete_reason(p) is None:
            steps.append((int(suffix), p))
    return max(steps)[1] if steps else None


@dataclass(frozen=True)
class PolicyCheckpoint:
    """The policy of one complete checkpoint: its Hugging Face folder and the version it was published as."""

    path: Path  # <checkpoint>/policy (save_pretrained: config, safetensors, tokenizer)
    version: int
    step: int

    @property
    def checksum(self) -> str:
        """What a replica that serves it reports as its weights checksum."""
        return f"checkpoint:{self.path.parent.name}"


def latest_policy(root: str | Path) -> PolicyCheckpoint | None:
    """The policy of the newest complete checkpoint under ``root``, or None."""
    ckpt = latest_checkpoint(root)
    if ckpt is None:
        return None
    state: dict[str, Any] = json.loads((ckpt / "state.json").read_text())
    return PolicyCheckpoint(ckpt / "policy", int(state["policy_version"]), int(state["step"]))


def load_policy(policy: PolicyCheckpoint, tied: dict[str, str] | None = None) -> dict[str, Any]:
    """The policy's tensors (Hugging Face names). ``save_pretrained`` writes tied weights once: ``tied`` maps a name
    it may leave out to the name it shares storage with (``{"lm_head.weight": "model.embed_tokens.weight"}``)."""
    from safetensors.torch import load_file  # noqa: PLC0415 - loads torch; rollout's main imports this module

    tensors: dict[str, Any] = {}
    for f in sorted(policy.path.glob("*.safetensors")):
        tensors.update(load_file(f))
    if not tensors:
        raise FileNotFoundError(f"{policy.path} holds no weights (*.safetensors)")
    for name, source in (tied or {}).items():
        if name not in tensors and source in tensors:
            tensors[name] = tensors[source]
    return tensors
