"""bench.device_check (docs/device-check.md) where there is no GPU: the dry run's plan, the deadline and ``--only``, and
``--cpu``, which runs every phase the CPU can (all but vLLM's) through bench/device_check.sh, the GPU host's entry
point: the trainer's bf16 step, the hf rollout engine, tcp/grpc/gloo pushes of a tied model into a replica, a DCP
checkpoint of a one-rank group, and a short ring of ``rlhf up``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PHASES = ["model", "trainer", "rollout", "push", "checkpoint", "ring", "vllm"]


def run(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench.device_check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_dry_run_plans_every_phase_and_imports_what_each_needs(tmp_path):
    out = run("--cpu", "--dry-run", "--out", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    result = json.loads((tmp_path / "device_check.json").read_text())
    assert line["phases"] == {n: r["status"] for n, r in result["phases"].items()}
    assert list(result["phases"]) == PHASES
    for name in PHASES[:-1]:
        assert result["phases"][name]["status"] == "would run", result["phases"][name]
    # vLLM: not run by --cpu unless asked for (minutes on a few cores), or not installed
    assert result["phases"]["vllm"]["status"] == "skipped"
    assert result["plan"]["device"] == "cpu" and result["plan"]["spec"]["arch"] == "llama-tied"


def test_only_and_the_deadline_skip_phases_without_running_them(tmp_path):
    """``--only trainer`` brings in the model phase it needs; with no time left neither starts: the model phase is
    skipped for the deadline, the trainer for want of a model, the rest as not selected; exit 3 (cut, not failed)."""
    out = run(
        "--cpu",
        "--only",
        "trainer",
        "--deadline-s",
        "0",
        "--out",
        str(tmp_path / "out"),
        "--work",
        str(tmp_path / "work"),
    )
    assert out.returncode == 3, out.stdout + out.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "device_check.json").read_text())
    assert result["selected"] == ["model", "trainer"]
    skipped = result["summary"]["skipped"]
    assert skipped["model"] == "deadline"
    assert skipped["trainer"] == "the model phase did not pass"
    assert all(skipped[n] == "not selected (--only)" for n in ("rollout", "push", "checkpoint", "ring", "vllm"))
    assert result["summary"]["ok"] == [] and result["summary"]["failed"] == []
    bad = run("--only", "trainer,nope", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "unknown phase(s) nope" in bad.stderr


@pytest.mark.slow
def test_cpu_run_through_the_entry_script_passes_every_cpu_phase(tmp_path):
    """About a minute on 2 cores. The script's bundle step is skipped here (the wheels are for Python 3.12); a
    redis-server from ``make device-bundle`` is used when .whl/deb holds one, else the one on PATH."""
    out_dir, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "PYTHON": sys.executable, "DEVICE_CHECK_WORK": str(work)}
    out = subprocess.run(
        ["bash", "bench/device_check.sh", str(out_dir), "--cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    result = json.loads((out_dir / "device_check.json").read_text())
    assert out.returncode == 0, json.dumps(result["phases"], indent=1)[-6000:] + out.stderr[-2000:]
    assert result["summary"]["ok"] == PHASES[:-1], result["summary"]
    assert result["summary"]["skipped"]["vllm"]
    phases = result["phases"]
    for name in PHASES[:-1]:
        assert all(phases[name]["checks"].values()), (name, phases[name]["checks"])
    assert phases["trainer"]["pushed_dtypes"] == ["torch.bfloat16"]
    assert set(phases["push"]["transports"]) == {"tcp", "grpc", "collective/gloo"}
    assert phases["push"]["lm_head_in_push"] is False  # the tied model's push leaves the alias out
    assert phases["checkpoint"]["backend"] == "gloo" and phases["checkpoint"]["group_differences"] == []
    assert phases["ring"]["steps"] == result["plan"]["ring"]["steps"]
    # only the JSON and the logs come back; the models, checkpoints and the ring stay in the work folder
    assert sorted(p.name for p in out_dir.iterdir()) == ["device_check.json", "device_check.log", "install.log"]
    assert (work / "checkpoint").is_dir() and (work / "ring" / "run" / "metrics.jsonl").is_file()
    assert "bench.device_check exited 0" in (out_dir / "install.log").read_text()
