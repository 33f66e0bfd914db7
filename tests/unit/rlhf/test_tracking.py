"""rlhf.tracking: TensorBoard when installed (the plots extra), Weights & Biases when configured (offline here), the
completions table."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from rlhf.tracking import Tracker


def test_tensorboard_scalars_completions_and_a_resume(tmp_path):
    pytest.importorskip("tensorboard")  # the plots extra (make setup installs it)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415 - tensorboard: the plots extra, importorskip above

    t = Tracker(tmp_path, "run", {"a": 1})
    for step in (1, 2, 3):
        t.log({"step": step, "reward/mean": step / 10, "note": "text is skipped", "nan": float("nan")}, step)
    t.completions([{"prompt": "1+1=", "response": "2 | two", "reward": 1.0}], 2)
    t.close()
    resumed = Tracker(tmp_path, "run", {"a": 1}, resume_step=2)  # steps after 2 are trained again
    resumed.log({"reward/mean": 0.9}, 3)
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.9)]
    assert "nan" not in events.Tags()["scalars"] and "note" not in events.Tags()["scalars"]
    rows = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert rows == [{"step": 2, "prompt": "1+1=", "response": "2 | two", "reward": 1.0}]
    (table,) = events.Tensors("completions/text_summary")
    assert b"2 \\| two" in table.tensor_proto.string_val[0]  # a pipe in a cell does not break the table


def test_weights_and_biases_offline_when_configured(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_PROJECT", "rlhf-test")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracker(tmp_path, "run-1", {"training": {"lr": 1e-6}})
    assert t.wandb is not None and t.wandb.config["training"]["lr"] == 1e-6
    t.log({"reward/mean": 0.5, "loss/policy": 0.1}, 1)
    t.completions([{"prompt": "p", "response": "r", "reward": 0.5}], 1)
    t.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert list(run.glob("run-*.wandb"))  # the offline run, ready for `wandb sync`
    log = next(run.glob("run-*.wandb")).read_bytes()
    assert b"reward/mean" in log and b"loss/policy" in log  # the logged history, in wandb's record format
    (table,) = (run / "files" / "media" / "table").glob("completions_*.table.json")
    assert json.loads(table.read_text())["data"] == [["p", "r", 0.5]]


def test_without_tensorboard_the_run_goes_on_without_event_files(tmp_path, monkeypatch, caplog):
    """The service images leave the plots extra out: the tracker says so once and writes everything else."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # any import of it raises ImportError
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    with caplog.at_level(logging.WARNING, logger="rlhf.tracking"):
        t = Tracker(tmp_path, "run", {"a": 1})
        t.log({"reward/mean": 0.5}, 1)
        t.log_eval({"eval/reward_mean": 0.25}, 1)
        t.completions([{"prompt": "p", "response": "r", "reward": 0.5}], 1)
        t.close()
    assert t.tb is None and not (tmp_path / "tensorboard").exists()
    rows = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "prompt": "p", "response": "r", "reward": 0.5}]
    (warning,) = [r.getMessage() for r in caplog.records if "tensorboard" in r.getMessage()]
    assert "rlhf-pipeline[plots]" in warning
