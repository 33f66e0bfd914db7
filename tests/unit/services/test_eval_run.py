"""``rlhf eval``'s argument handling, without services: which policy folder ``--checkpoint`` names, and the refusals
that come before anything starts (exit 2, a message naming what to change)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli import main
from services.eval_run import resolve_checkpoint

REPO = Path(__file__).resolve().parents[3]


def _checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    ckpt = root / f"step_{step}"
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / "policy" / "config.json").write_text("{}")
    (ckpt / "state.json").write_text(json.dumps({"step": step, "policy_version": step + 1}))
    if complete:  # the manifest, written last, lists every file with its size
        files = {str(p.relative_to(ckpt)): p.stat().st_size for p in ckpt.rglob("*") if p.is_file()}
        (ckpt / "manifest.json").write_text(json.dumps({"files": files}))
    return ckpt


def test_checkpoint_forms(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert resolve_checkpoint(hf) == (hf, None)
    root = tmp_path / "checkpoints"
    _checkpoint(root, 10)
    newest = _checkpoint(root, 20)
    _checkpoint(root, 30, complete=False)  # a writer that did not finish is never loaded
    assert resolve_checkpoint(newest) == (newest / "policy", 20)
    assert resolve_checkpoint(root) == (newest / "policy", 20)
    with pytest.raises(FileNotFoundError, match="manifest"):
        resolve_checkpoint(root / "step_30")
    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_checkpoint(tmp_path / "missing")


def test_refusals_before_anything_starts(tmp_path, capsys):
    cfg = str(REPO / "configs/demo.yaml")
    assert main(["eval", "--config", cfg, "--rollout", "127.0.0.1:1", "--reward", "127.0.0.1:2"]) == 2
    assert "eval.path" in capsys.readouterr().err
    assert main(["eval", "--config", cfg, "--checkpoint", str(tmp_path), "eval.path=x.jsonl"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    assert main(["eval", "--config", cfg, "--rollout", "a:1", "eval.path=x.jsonl", "eval.bogus=1"]) == 2
    assert "bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one of --rollout / --checkpoint
        main(["eval", "--config", cfg])
    assert not (tmp_path / "metrics.jsonl").exists()
