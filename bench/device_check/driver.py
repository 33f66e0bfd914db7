"""The driver: each selected phase in a worker process within its limit and the global deadline, skips, the JSON
and the log; and the dry run."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.device_check.common import NEEDS_MODEL, PHASES, REPO, log, plan
from bench.device_check.probe import probe_env
from bench.device_check.worker import IMPORTS


def static_skip(name: str, args: argparse.Namespace, selected: list[str]) -> str | None:
    """Why ``name`` is skipped whatever the other phases do; None when it runs."""
    if name not in selected:
        return "not selected (--only)"
    if name == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vllm not installed"
        if args.cpu and not args.only:
            return "--cpu: not by default (vLLM's CPU build, a slow start on a few cores); --cpu --only vllm runs it"
    return None


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group (it and whatever it started), SIGKILL 15 s later."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int) -> str:
    try:
        text = path.read_bytes()[-200_000:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Driver:
    def __init__(self, args: argparse.Namespace, selected: list[str], deadline_s: float):
        self.args = args
        self.selected = selected
        self.p = plan(args)
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.deadline_s = deadline_s
        self.log_file = open(self.out / "device_check.log", "w")  # noqa: SIM115 - closed in run()

    def say(self, msg: str) -> None:
        line = f"[device_check +{time.monotonic() - self.started:5.0f}s] {msg}"
        log(line)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("RLHF_CACHE_DIR", str(self.work / "cache"))  # the ring's tiny: models
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return env

    def skip_reason(self, name: str, phases: dict[str, Any]) -> str | None:
        why = static_skip(name, self.args, self.selected)
        if why is not None:
            return why
        if name in NEEDS_MODEL and phases.get("model", {}).get("status") != "ok":
            return "the model phase did not pass"
        left = self.deadline - time.monotonic()
        if left < self.p["limits"][name][1]:
            return "deadline"
        return None

    def run_phase(self, name: str) -> dict[str, Any]:
        limit, _ = self.p["limits"][name]
        left = self.deadline - time.monotonic()
        budget = min(limit, left)
        result_file = self.work / "results" / f"{name}.json"
        result_file.unlink(missing_ok=True)
        log_path = self.work / "logs" / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "bench.device_check",
            "--worker",
            name,
            "--work",
            str(self.work),
            "--budget-s",
            str(round(budget, 1)),
        ]
        self.say(f"{name}: started (limit {budget:.0f}s{', cut by the deadline' if budget < limit else ''})")
        t0 = time.monotonic()
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=self.env(), stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
            )
            timed_out = False
            try:
                rc = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                rc = proc.returncode
        try:
            res = json.loads(result_file.read_text())
        except (OSError, ValueError):
            res = {}
        if timed_out:
            why = "the global deadline" if budget < limit else "the phase's limit"
            res.update(status="failed", error=f"timeout: stopped after {budget:.0f}s ({why})")
        elif res.get("status") not in ("ok", "failed"):
            res.update(status="failed", error=f"the phase's process exited with {rc} before reporting a result")
        res["seconds"] = round(time.monotonic() - t0, 1)
        if res["status"] != "ok":
            res["log_tail"] = _tail(log_path, 30)
        self.say(
            f"{name}: {res['status']} in {res['seconds']}s"
            + (f" ({res.get('error') or res.get('failed_checks')})" if res["status"] != "ok" else "")
        )
        return res

    def run(self) -> tuple[dict[str, Any], int]:
        for d in ("results", "logs"):  # this run's only (the models stay: built again only for another shape)
            shutil.rmtree(self.work / d, ignore_errors=True)
            (self.work / d).mkdir(parents=True)
        (self.work / "plan.json").write_text(json.dumps(self.p))
        result: dict[str, Any] = {
            "name": "device_check",
            "mode": self.p["device"],
            "deadline_s": self.deadline_s,
            "selected": self.selected,
            "plan": self.p,
        }
        self.say(
            f"mode {self.p['device']}, phases {','.join(self.selected)}, deadline {self.deadline_s:.0f}s; "
            f"work in {self.work}"
        )
        result["env"] = probe_env()
        self.say(f"environment: {json.dumps(result['env'])}")
        phases: dict[str, Any] = {}
        result["phases"] = phases
        no_cuda = self.p["device"] == "cuda" and result["env"].get("cuda") is False
        for name in PHASES:
            why = "no CUDA device (use --cpu)" if no_cuda and name in self.selected else self.skip_reason(name, phases)
            if why is not None:
                phases[name] = {"status": "skipped", "reason": why}
                if name in self.selected:
                    self.say(f"{name}: skipped ({why})")
                continue
            phases[name] = self.run_phase(name)
            self.write(result)
        result["seconds"] = round(time.monotonic() - self.started, 1)
        summary = {
            "ok": [n for n, r in phases.items() if r["status"] == "ok"],
            "failed": [n for n, r in phases.items() if r["status"] == "failed"],
            "skipped": {n: r["reason"] for n, r in phases.items() if r["status"] == "skipped"},
        }
        result["summary"] = summary
        self.write(result)
        # after the driver's lines, the end of each log: the phases', the push replica's, rlhf up's, and when the
        # ring failed, its services'
        logs = sorted((self.work / "logs").glob("*.log"))
        if phases.get("ring", {}).get("status") == "failed":
            logs += sorted((self.work / "ring" / "run" / "logs").glob("*.log"))
        for path in logs:
            self.log_file.write(f"\n===== {path}, last 60 lines\n{_tail(path, 60)}\n")
        self.log_file.close()
        if no_cuda:
            return result, 2
        if summary["failed"]:
            return result, 1
        return result, 3 if "deadline" in summary["skipped"].values() else 0

    def write(self, result: dict[str, Any]) -> None:
        write_json(self.out, result)


def write_json(out: Path, result: dict[str, Any]) -> None:
    tmp = out / "device_check.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, out / "device_check.json")


def dry_run(args: argparse.Namespace, selected: list[str]) -> tuple[dict[str, Any], int]:
    """The plan, and whether each selected phase's modules import here (nothing runs)."""
    result: dict[str, Any] = {"name": "device_check", "dry_run": True, "plan": plan(args), "selected": selected}
    phases = {}
    ok = True
    for name in PHASES:
        why = static_skip(name, args, selected)
        if why is not None:
            phases[name] = {"status": "skipped", "reason": why}
            continue
        imports = {}
        for m in IMPORTS[name]:
            try:
                importlib.import_module(m)
                imports[m] = "ok"
            except Exception as err:  # noqa: BLE001 - reported
                imports[m] = f"{type(err).__name__}: {err}"[:300]
        if name == "ring":
            imports["redis-server"] = "ok" if shutil.which("redis-server") else "not on PATH"
        good = all(v == "ok" for v in imports.values())
        ok &= good
        phases[name] = {"status": "would run" if good else "cannot run", "imports": imports}
    result["phases"] = phases
    return result, 0 if ok else 1
