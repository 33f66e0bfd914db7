"""metrics.jsonl cut back to a checkpoint's step (rlhf.runlog)."""

from __future__ import annotations

import json

from rlhf import runlog


def _write(path, steps, tail=b""):
    path.write_bytes(b"".join(json.dumps({"step": s, "reward/mean": s / 10}).encode() + b"\n" for s in steps) + tail)


def test_truncate_after_keeps_the_prefix_up_to_the_step(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _write(p, [1, 2, 3, 4, 5])
    inode = p.stat().st_ino
    assert runlog.truncate_after(p, 3) == 2
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2, 3]
    assert p.stat().st_ino == inode  # in place: a reader following the file sees it shrink
    assert runlog.truncate_after(p, 3) == 0 and runlog.truncate_after(p, 10) == 0
    assert runlog.truncate_after(p, 0) == 3 and p.read_bytes() == b""
    assert runlog.truncate_after(tmp_path / "missing.jsonl", 1) == 0


def test_truncate_after_drops_a_half_written_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _write(p, [1, 2], tail=b'{"step": 3, "rew')
    assert runlog.truncate_after(p, 5) == 1
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2]
    runlog.append(p, {"step": 3})
    assert [json.loads(x)["step"] for x in p.read_text().splitlines()] == [1, 2, 3]


def test_checkpoint_step_reads_the_latest_pointer(tmp_path):
    assert runlog.checkpoint_step(tmp_path / "checkpoints") == 0
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_7\n")
    assert runlog.checkpoint_step(tmp_path / "checkpoints") == 7
    (tmp_path / "checkpoints" / "latest").write_text("garbage")
    assert runlog.checkpoint_step(tmp_path / "checkpoints") == 0
