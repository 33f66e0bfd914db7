"""`rlhf up` (services/launcher.py) and `rlhf report` (services/report.py).

The pieces are tested on their own (ports, the environment of each service, the private redis-server, stopping a
process tree, the progress line, the plots); one end-to-end test runs `rlhf up` on a tiny config as a subprocess. That
one needs the trainer and rollout services: it is skipped while ``services.trainer.main`` or
``services.rollout.main`` does not exist.
"""

from __future__ import annotations

import datetime
import http.server
import importlib.util
import io
import ipaddress
import json
import math
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis as redis_py
import yaml

from rlhf import preflight, procs, runlog
from rlhf.serving.settings import KNOWN_ENV_VARS, ServiceSettings
from services import launcher, plan, progress, report
from services.cli import main as cli_main
from tests.support.up import demo_config, run_up

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # members may be zombies waiting for their parent; count only live ones
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# ------------------------------------------------------------ ports, plan, environment


def test_free_ports_are_distinct_and_bindable():
    ports = procs.free_ports(8)
    assert len(set(ports)) == 8
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_plan_services_order_ports_and_env(tmp_path):
    ports = list(range(20000, 20010))
    specs = plan.plan_services(
        redis_url="redis://127.0.0.1:1/0", run_id="r1", api_token="tok", run_dir=tmp_path, ports=ports
    )
    assert [s.name for s in specs] == ["reward", "reference", "rollout", "trainer"]
    assert [s.service for s in specs] == ["reward", "reference", "rollout", "trainer"]
    used = [p for s in specs for p in (s.grpc_port, s.http_port)]
    assert sorted(used) == sorted(ports[:8])
    reward, reference, rollout, trainer = specs
    for s in specs:
        assert s.env["RLHF_REDIS_URL"] == "redis://127.0.0.1:1/0"
        assert s.env["RLHF_RUN_ID"] == "r1"
        assert s.env["RLHF_API_TOKEN"] == "tok"
    assert rollout.env["RLHF_REWARD_ADDR"] == f"127.0.0.1:{reward.grpc_port}"
    assert rollout.env["RLHF_REFERENCE_ADDR"] == f"127.0.0.1:{reference.grpc_port}"
    assert rollout.env["RLHF_REPLICA_ID"]
    assert trainer.env["RLHF_ROLLOUT_ADDRS"] == rollout.grpc_addr
    assert trainer.env["RLHF_RUN_DIR"] == str(tmp_path)
    argv = trainer.argv("c.yaml", python="py")
    assert argv[:6] == ["py", "-m", "services.cli", "serve", "trainer", "--config"]
    assert argv[argv.index("--grpc-port") + 1] == str(trainer.grpc_port)
    assert argv[argv.index("--http-port") + 1] == str(trainer.http_port)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"


def test_plan_services_several_rollout_replicas(tmp_path):
    specs = plan.plan_services(redis_url="u", run_id="r", api_token="t", run_dir=tmp_path, rollout_replicas=3)
    rollouts = [s for s in specs if s.service == "rollout"]
    assert [s.name for s in rollouts] == ["rollout-0", "rollout-1", "rollout-2"]
    assert len({s.env["RLHF_REPLICA_ID"] for s in rollouts}) == 3
    assert specs[-1].env["RLHF_ROLLOUT_ADDRS"].split(",") == [s.grpc_addr for s in rollouts]
    assert len({p for s in specs for p in (s.grpc_port, s.http_port)}) == 2 * len(specs)


def test_every_variable_set_is_known_to_the_services(tmp_path):
    for spec in plan.plan_services(redis_url="redis://h:1/0", run_id="r", api_token="t", run_dir=tmp_path):
        env = plan.child_env(spec.env, base={})
        unknown = [k for k in env if k.startswith("RLHF_") and k not in KNOWN_ENV_VARS]
        assert unknown == []
        ServiceSettings.from_env(env)  # valid


def test_child_env_defaults_and_overrides():
    env = plan.child_env({"RLHF_RUN_ID": "x"}, base={"PATH": "/bin", "RLHF_CACHE_DIR": "/c", "PYTHONPATH": "/p"})
    assert env["RLHF_RUN_ID"] == "x"
    assert env["RLHF_CACHE_DIR"] == "/c"  # the user's choice is kept
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/p"]
    assert env["PYTHONUNBUFFERED"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert plan.child_env({}, base={})["RLHF_CACHE_DIR"] == str(plan.DEFAULT_CACHE_DIR)
    # every core to each process, idle OpenMP threads sleeping (issue 15); the user's values win
    env = plan.child_env({}, base={})
    assert env["OMP_NUM_THREADS"] == str(os.cpu_count()) and env["OMP_WAIT_POLICY"] == "PASSIVE"
    env = plan.child_env({}, base={"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"})
    assert env["OMP_NUM_THREADS"] == "3" and env["OMP_WAIT_POLICY"] == "ACTIVE"


def test_default_run_dir():
    d = plan.default_run_dir("demo", root="runs", now=0)
    assert d.parent == Path("runs")
    assert re.fullmatch(r"demo-\d{8}-\d{6}", d.name)


# ------------------------------------------------------------ redis and process trees


def test_private_redis_start_and_stop(tmp_path):
    redis = launcher.RedisChild(tmp_path / "redis", tmp_path / "logs" / "redis.log").start()
    try:
        redis.wait_ready()

        client = redis_py.Redis.from_url(redis.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert Path(client.config_get("dir")["dir"]) == (tmp_path / "redis").resolve()
        client.close()
    finally:
        launcher.stop_children([redis], grace_s=10)
    assert not redis.running
    assert redis.poll() == 0  # a clean shutdown on SIGTERM
    assert not procs.redis_answers(redis.port)
    assert any((tmp_path / "redis").iterdir())  # AOF files


_TREE = r"""
import signal, subprocess, sys, time
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(grand.pid, flush=True)
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(300)
"""


def _tree(tmp_path: Path, mode: str) -> tuple[launcher.Child, int]:
    log = tmp_path / f"tree-{mode}.log"
    child = launcher.Child("tree", [sys.executable, "-c", _TREE, mode], log).start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if text.strip():
            return child, int(text.split()[0])
        time.sleep(0.05)
    raise AssertionError("the test child did not start")


def test_stop_children_stops_the_whole_tree_on_sigterm(tmp_path):
    child, grand = _tree(tmp_path, "obey")
    assert _alive(grand)
    t0 = time.monotonic()
    launcher.stop_children([child], grace_s=10)
    assert time.monotonic() - t0 < 5
    assert child.poll() == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while _alive(grand) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grand)
    assert not _group_alive(child.pid)


def test_stop_children_kills_what_ignores_sigterm(tmp_path):
    child, grand = _tree(tmp_path, "ignore")
    time.sleep(0.3)  # let it install the handler
    launcher.stop_children([child], grace_s=1)
    assert child.poll() == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while _alive(grand) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grand)


def test_early_death_is_reported_with_the_log_tail(tmp_path):
    opts = launcher.RunOptions(config=tmp_path / "c.yaml")
    up = launcher.Launcher(opts, out=io.StringIO())
    dead = launcher.Child("reward", ["sh", "-c", "echo first; echo 'the real cause'; exit 3"], tmp_path / "r.log")
    dead.start().proc.wait(10)
    up.children.append(dead)
    with pytest.raises(launcher.LaunchError, match="(?s)reward exited early with 3.*the real cause"):
        up._check_alive()
    launcher.stop_children([dead])


def test_a_service_that_dies_mid_run_is_restarted_a_bounded_number_of_times(tmp_path):
    out = io.StringIO()
    up = launcher.Launcher(launcher.RunOptions(config=tmp_path / "c.yaml", max_restarts=2), out=out)
    dead = launcher.Child("rollout", ["sh", "-c", "echo life; exit 3"], tmp_path / "r.log")
    dead.start().proc.wait(10)
    up.children.append(dead)
    for _ in range(2):
        up._supervise()
        dead.proc.wait(10)
    assert up.restarts == {"rollout": 2}
    assert (tmp_path / "r.log").read_text().count("life") == 3  # each life appends to the same log
    with pytest.raises(launcher.LaunchError, match="(?s)rollout exited with 3 after 2 restart.*--max-restarts 2"):
        up._supervise()
    assert "rollout exited with 3; restarting it (2/2)" in out.getvalue()
    launcher.stop_children([dead])


def test_a_trainer_that_dies_is_restarted_and_the_run_follows_it(tmp_path):
    up = launcher.Launcher(launcher.RunOptions(config=tmp_path / "c.yaml", quiet=True), out=io.StringIO())
    up.run_dir = tmp_path
    # Fails on its first life, finishes on the second (as a trainer resuming from its checkpoint would).
    script = f"if [ -f {tmp_path}/lived ]; then exit 0; fi; touch {tmp_path}/lived; exit 1"
    trainer = launcher.Child("trainer", ["sh", "-c", script], tmp_path / "t.log").start()
    up.children.append(trainer)
    assert up._follow(trainer, total=1, t_start=time.monotonic()) == 0
    assert up.restarts == {"trainer": 1}
    launcher.stop_children([trainer])


def test_a_trainer_group_that_stopped_by_a_rule_is_not_restarted(tmp_path):
    """torchrun exits 1 when rank 0 exits 3 (a stopping rule): the run's "stopped" event says what happened."""
    up = launcher.Launcher(launcher.RunOptions(config=tmp_path / "c.yaml", quiet=True), out=io.StringIO())
    up.run_dir = tmp_path
    (tmp_path / "events.jsonl").write_text('{"event": "stopped", "step": 1, "message": "an earlier run"}\n')
    stop = '{"event": "stopped", "step": 3, "message": "a rule"}'
    script = f"sleep 0.5; echo '{stop}' >> {tmp_path}/events.jsonl; touch {tmp_path}/lived; exit 1"
    trainer = launcher.Child("trainer", ["sh", "-c", script], tmp_path / "t.log").start()
    up.children.append(trainer)
    assert up._follow(trainer, total=5, t_start=time.monotonic()) == runlog.EXIT_STOPPED_BY_RULE
    assert up.restarts == {}
    launcher.stop_children([trainer])


def test_an_earlier_runs_stopped_event_does_not_stop_a_failed_trainers_restart(tmp_path):
    up = launcher.Launcher(launcher.RunOptions(config=tmp_path / "c.yaml", quiet=True), out=io.StringIO())
    up.run_dir = tmp_path
    (tmp_path / "events.jsonl").write_text('{"event": "stopped", "step": 1, "message": "an earlier run"}\n')
    script = f"if [ -f {tmp_path}/lived ]; then exit 0; fi; touch {tmp_path}/lived; exit 1"
    trainer = launcher.Child("trainer", ["sh", "-c", script], tmp_path / "t.log").start()
    up.children.append(trainer)
    assert up._follow(trainer, total=1, t_start=time.monotonic()) == 0
    assert up.restarts == {"trainer": 1}
    launcher.stop_children([trainer])


def test_up_refuses_a_missing_config(tmp_path, capsys):
    assert cli_main(["up", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_up_refuses_an_invalid_config(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("run_id: x\ntraining: {no_such_key: 1}\n")
    assert cli_main(["up", "--config", str(cfg), "--run-dir", str(tmp_path / "run")]) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_up_reports_every_problem_at_once_before_starting_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myrewards.py").write_text("def score(prompt, response, label, **kw):\n    return 1.0\n")
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["data"] = {"path": str(tmp_path / "missing.jsonl")}
    cfg["critic"]["load"] = str(tmp_path / "no-such-model")
    cfg["reward"]["scorers"] = [
        {"type": "rule", "name": "myrewards:score"},
        {"type": "rule", "name": "nosuchmod:f"},
        {"type": "rule", "name": "myrewards:missing"},
    ]
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("RLHF_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    assert cli_main(["up", "--config", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "5 problem(s)" in err and "nothing was started" in err, err
    for expected in (
        "missing.jsonl does not exist",
        "critic.load",
        "no-such-model",
        "'nosuchmod' does not import",
        "has no function 'missing'",
        "RLHF_REDIS_URL redis://127.0.0.1:1/0: cannot connect",
    ):
        assert expected in err, (expected, err)
    assert "myrewards:score" not in err  # the module in the working directory imports
    assert not (tmp_path / "run").exists()  # no run folder, no redis-server, no service


def test_up_finds_a_config_by_name_and_the_services_read_it_with_the_overrides(tmp_path, capsys, monkeypatch):
    """`rlhf up --config-name NAME KEY=VALUE ...` as the seeds launch (`ray_gpt.py --config-name ...`): NAME.yaml
    from the configs folder, the overrides validated and written to the run folder's config.yaml, which is the file
    every service is started with. (Preflight and the services are stood in for: the first start stops the run.)"""
    started = []

    def start(self, spec, config):
        started.append((spec.name, Path(config)))
        raise launcher.LaunchError("stopped by the test")

    monkeypatch.setattr(preflight, "check", lambda cfg, url=None: preflight.Report())
    monkeypatch.setattr(launcher.Launcher, "_prepare_models", lambda self, cfg: None)
    monkeypatch.setattr(launcher.Launcher, "_start", start)
    monkeypatch.setenv("RLHF_REDIS_URL", "redis://127.0.0.1:1/0")  # no private redis-server
    monkeypatch.setenv("RLHF_ROLLOUT_ENGINE", "hf")
    run = tmp_path / "run"
    argv = ["up", "training.train_iters=2", "--config-name", "demo", "--run-dir", str(run), "critic.lr=9e-6"]
    assert cli_main([*argv, "actor_rollout_ref.actor_rollout.do_sample=false"]) == 1
    assert "stopped by the test" in capsys.readouterr().err
    written = yaml.safe_load((run / "config.yaml").read_text())
    assert written["training"]["train_iters"] == 2 and written["critic"]["lr"] == 9e-6
    assert written["actor_rollout_ref"]["actor_rollout"]["do_sample"] is False
    assert written["reward"] == yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["reward"]
    assert started and started[0][1] == (run / "config.yaml").resolve()

    # --config-dir, a name that is not there, and an override that does not validate: errors before anything starts
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "ppo_trainer_llama32_1b.yaml").write_text("training: {stage: ray_ppo}\n")
    assert launcher.find_named_config("ppo_trainer_llama32_1b", str(mine)) == mine / "ppo_trainer_llama32_1b.yaml"
    assert cli_main(["up", "--config-dir", str(mine), "--config-name=nope"]) == 2
    assert "--config-name nope: no nope.yaml in" in (err := capsys.readouterr().err) and "ppo_trainer_llama32_1b" in err
    assert cli_main(["up", "--config-name", "demo", "--run-dir", str(tmp_path / "r2"), "critic.vf_coeff=2"]) == 2
    err = capsys.readouterr().err
    assert "critic.vf_coeff: unknown key" in err and "did you mean 'vf_coef'" in err, err
    assert cli_main(["up", "--config-name", "demo", "--run-dir", str(tmp_path / "r3"), "training.lr=-1"]) == 2
    assert "training.lr: Input should be greater than 0" in capsys.readouterr().err
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()
    assert cli_main(["up", "--config", "x.yaml", "--config-name", "demo"]) == 2
    assert "not both" in capsys.readouterr().err


def test_up_help_shows_config_name_and_overrides(capsys):
    with pytest.raises(SystemExit):
        cli_main(["up", "--help"])
    out = capsys.readouterr().out
    assert "--config-name NAME" in out and "--config-dir DIR" in out and "KEY=VALUE" in out
    assert "rlhf up --config-name demo training.train_iters=5" in out


def test_config_rules_that_cannot_learn_are_reported_together(tmp_path, capsys):
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["training"]["stage"] = "ray_grpo"
    cfg["algorithm"] = {"adv_estimator": "grpo", "kl_ctrl": {"type": "adaptive"}}
    cfg["actor_rollout_ref"]["actor_rollout"]["n_samples_per_prompt"] = 1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli_main(["up", "--config", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "kl_ctrl.target_kl is not set" in err and "n_samples_per_prompt is 1" in err, err


# ------------------------------------------------------------ progress


def test_metrics_tail_reads_only_complete_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = progress.MetricsTail(path)
    assert tail.read() == []
    with open(path, "w") as f:
        f.write('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    assert [r["step"] for r in tail.read()] == [1]
    with open(path, "a") as f:
        f.write('ard/mean": 0.7}\nnot json\n{"step": 3}\n')
    assert [r["step"] for r in tail.read()] == [2, 3]
    assert tail.read() == []


def test_metrics_tail_of_a_resumed_run_skips_old_lines_and_follows_a_cut(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for step in range(1, 6):
        runlog.append(path, {"step": step})
    tail = progress.MetricsTail(path, from_end=True)
    assert tail.read() == []  # the earlier life's lines are not shown again
    runlog.truncate_after(path, 3)  # the resumed trainer cuts back to its checkpoint
    assert tail.read() == []
    runlog.append(path, {"step": 4})
    assert [r["step"] for r in tail.read()] == [4]


def test_format_progress():
    line = progress.format_progress(
        {
            "step": 3,
            "reward/mean": 0.25,
            "objective/kl": 0.0123,
            "samples_per_s": 41.5,
            "staleness/mean": 0.5,
            "mismatch/kl": 2.5e-14,
            "queue/prompts": 4,
            "queue/experience": 2,
            "loss/policy": 0.1,
        },
        total=40,
        elapsed=12.3,
    )
    assert line.startswith("step 3/40")
    for part in (
        "reward +0.2500",
        "kl 0.0123",
        "samples/s 41.5",
        "staleness 0.50",
        "mismatch 2.5e-14",
        "prompts=4",
        "experience=2",
    ):
        assert part in line
    assert progress.format_progress({"step": 1}) == "step 1"
    line = progress.format_progress(
        {"step": 5, "time/iteration_s": 1.5, "reward/failed_fraction": 0.25}, 40, elapsed=75, eta_s=3725
    )
    assert line == "step 5/40  score failed 25%  1.50 s/step  [1m15s, ETA 1h02m]", line
    eta = progress.Eta(total=12)
    assert eta({"step": 4}, now=100.0) is None  # the first step seen only starts the clock (a resumed run)
    assert eta({"step": 6}, now=104.0) == 12.0  # 2 s/step, 6 steps left


# ------------------------------------------------------------ report


def _synthetic_metrics(path: Path, steps: int = 12) -> None:
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            rec = {
                "step": s,
                "reward/mean": -1 + 0.1 * s,
                "reward/std": 0.2,
                "objective/kl": 0.001 * s,
                "kl_coef": 0.01,
                "loss/policy": 0.5 / s,
                "loss/value": 1.0 / s,
                "samples_per_s": 10.0,
                "staleness/mean": 0.0,
                "queue/prompts": 2,
                "note": "text is ignored",
            }
            f.write(json.dumps(rec) + "\n")
        f.write('{"step": 13, "reward/me')  # a truncated last line


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC
    from PIL import Image  # noqa: PLC0415 - Pillow: comes with matplotlib (the plots extra)

    with Image.open(path) as im:
        im.verify()
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] > 100 and im.size[1] > 100


def test_report_draws_valid_pngs(tmp_path):
    _synthetic_metrics(tmp_path / "metrics.jsonl")
    paths = report.draw(tmp_path)
    assert [p.name for p in paths] == list(report.PLOTS)
    for p in paths:
        _assert_png(p)


def test_report_summary_and_keys(tmp_path):
    _synthetic_metrics(tmp_path / "metrics.jsonl")
    records = report.load_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 12
    assert report.reward_key(records) == "reward/mean"
    assert report.reward_key([{"step": 1, "rewards/score_mean": 1.0}]) == "rewards/score_mean"
    text = report.summary(records)
    assert "steps: 12" in text
    assert "first -0.9000, last +0.2000" in text
    assert "objective/kl: last 0.0120" in text
    assert report.summary([]) == "no training steps recorded"


def test_each_plot_shows_its_quantity_family():
    rec = {
        "step": 1,
        "reward/mean": 0.5,
        "reward/std": 0.1,
        "reward/char_fraction": 0.4,
        "objective/scores": 0.5,
        "objective/kl": 0.01,
        "kl_coef": 0.05,
        "policy/approxkl": 0.001,
        "loss/policy": 0.1,
        "loss/kl": 0.2,
        "queue/prompts_backlog": 3.0,
        "queue/experience_backlog": 1.0,
        "response_length/mean": 6.0,
        "samples_per_s": 9.0,
        "time/step_s": 0.4,
        "rewards/chosen": 2.0,
        "rewards/margins": 1.0,
    }
    keys = {name: sorted(ks) for name, ks in report.plot_keys([rec]).items()}
    assert keys["kl.png"] == ["kl_coef", "objective/kl", "policy/approxkl"]  # not the backlogs, not loss/kl
    assert keys["losses.png"] == ["loss/kl", "loss/policy"]
    assert keys["reward.png"] == ["objective/scores", "reward/char_fraction", "reward/mean"]
    assert keys[report.DPO_PLOT] == ["rewards/chosen", "rewards/margins"]  # DPO's implicit rewards: own axes
    assert keys["lengths.png"] == ["response_length/mean"]
    assert keys["throughput.png"] == ["samples_per_s", "time/step_s"]


def test_report_cli(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    _synthetic_metrics(tmp_path / "metrics.jsonl")
    assert cli_main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "reward/mean: first -0.9000, last +0.2000" in out
    for name in report.PLOTS:
        _assert_png(tmp_path / name)


def test_report_without_any_known_series_still_draws(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "other": 2}\n')
    for p in report.draw(tmp_path):
        _assert_png(p)


# ------------------------------------------------------------ end to end


def _ring_available() -> bool:
    """The trainer and the rollout service's entry points exist (the end-to-end run needs both)."""
    try:
        return all(importlib.util.find_spec(f"services.{s}.main") is not None for s in ("trainer", "rollout"))
    except ModuleNotFoundError:
        return False


@pytest.mark.timeout(600)
@pytest.mark.skipif(
    not _ring_available(), reason="needs the trainer and rollout services (services/{trainer,rollout}/main.py)"
)
def test_rlhf_up_end_to_end(tmp_path, tiny_models):
    cfg = demo_config("demo", "e2e")
    run_dir = tmp_path / "run"
    cfg["training"].update(
        train_iters=3, global_batch_size=2, save_interval=1, save=str(run_dir / "checkpoints"), log_interval=1
    )
    ar = cfg["actor_rollout_ref"]["actor_rollout"]
    ar.update(max_new_tokens=4, ppo_mini_batch_size=2, ppo_epochs=1)
    cfg["critic"].update(critic_mini_batch_size=2, critic_update_epochs=1)
    proc = run_up(cfg, tmp_path, run_dir)
    out = proc.stdout + proc.stderr
    logs = "\n".join(f"--- {p.name}\n{procs.log_tail(p, 30)}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert proc.returncode == 0, out + logs

    records = report.load_metrics(run_dir / "metrics.jsonl")
    steps = [r.get("step") for r in records]
    assert len(records) >= 3 and max(steps) >= 3, steps
    assert all(any("reward" in k for k in r) for r in records), records[0]
    for name in report.PLOTS:
        _assert_png(run_dir / name)
    found = [p for p in run_dir.rglob("*") if p.is_file() and "checkpoint" in str(p.relative_to(run_dir)).lower()]
    assert found, sorted(str(p) for p in run_dir.rglob("*"))
    for name in ("redis", "reward", "reference", "rollout", "trainer"):
        assert (run_dir / "logs" / f"{name}.log").is_file()
    assert re.search(r"step 3/3", out), out

    pids = [int(p) for p in re.findall(r"\(pid (\d+)", out)]
    assert len(pids) >= 5, out  # redis + 4 services
    deadline = time.monotonic() + 5
    while any(_group_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _group_alive(p)], "processes left running"


@pytest.mark.timeout(300)
def test_rlhf_up_ctrl_c_stops_every_process(tmp_path, tiny_models):
    """SIGINT while the services start: every process started so far is stopped, exit 130."""
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop("RLHF_REDIS_URL", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out_path = tmp_path / "up.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.cli",
                "up",
                "--config",
                str(REPO / "configs" / "demo.yaml"),
                "--run-dir",
                str(run_dir),
            ],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 120
            while "started reference" not in out_path.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, out_path.read_text()
                time.sleep(0.1)
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = out_path.read_text()
    assert rc == 130, text
    pids = [int(p) for p in re.findall(r"\(pid (\d+)", text)]
    assert len(pids) >= 3, text  # redis, reward, reference
    deadline = time.monotonic() + 5
    while any(_group_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _group_alive(p)], text


@pytest.mark.timeout(600)
def test_ctrl_c_checkpoints_and_resume_continues_without_duplicate_steps(tmp_path, tiny_models):
    """Ctrl-C mid-run: the trainer checkpoints the step it reached before stopping; `rlhf up --resume RUN_DIR` goes
    on from there with its progress lines and metrics.jsonl continuing, each step once."""
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["run_id"] = "resume"
    cfg["training"].update(train_iters=12, global_batch_size=2, save_interval=100, log_interval=1)
    cfg["actor_rollout_ref"]["actor_rollout"].update(max_new_tokens=4, ppo_mini_batch_size=2, ppo_epochs=1)
    cfg["critic"].update(critic_mini_batch_size=2, critic_update_epochs=1)
    config = tmp_path / "resume.yaml"
    config.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop("RLHF_REDIS_URL", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    first = tmp_path / "first.out"
    with open(first, "w") as out:
        argv = [sys.executable, "-m", "services.cli", "up", "--config", str(config), "--run-dir", str(run_dir)]
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not re.search(r"step 3/12", first.read_text()) and time.monotonic() < deadline:
                assert proc.poll() is None, first.read_text()
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 130, first.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
    text = first.read_text()
    assert f"continue with: rlhf up --resume {run_dir}" in text, text
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    state = json.loads((run_dir / "checkpoints" / latest / "state.json").read_text())
    stopped_at = state["step"]  # no save_interval checkpoint before 100: this one was written on Ctrl-C
    assert 3 <= stopped_at < 12, stopped_at
    assert "stopping: checkpointing step" in (run_dir / "logs" / "trainer.log").read_text()

    second = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--resume", str(run_dir)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    out = second.stdout + second.stderr
    assert second.returncode == 0, out + procs.log_tail(run_dir / "logs" / "trainer.log", 40)
    shown = [int(m) for m in re.findall(r"step (\d+)/12", out)]
    assert shown and shown[0] == stopped_at + 1 and shown[-1] == 12, shown  # progress continues, no replay
    steps = [r["step"] for r in report.load_metrics(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, 13)), steps  # each step once: the run's plot does not jump back
    assert "resumed from" in (run_dir / "logs" / "trainer.log").read_text()


def _certificates(d: Path) -> dict[str, str]:
    """A CA and a server certificate it signed for 127.0.0.1 / localhost (PEM files in ``d``)."""
    from cryptography import x509  # noqa: PLC0415 - cryptography: not a dependency, its tests importorskip it
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415 - cryptography: not a dependency, its tests importorskip it
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415 - cryptography: not a dependency, its tests importorskip it
    from cryptography.x509.oid import NameOID  # noqa: PLC0415 - cryptography: not a dependency, its tests importorskip it

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool) -> x509.Certificate:
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert("rlhf test CA", ca_key, "rlhf test CA", ca_key, True)
    server = cert("rlhf services", key, "rlhf test CA", ca_key, False)
    paths = {"RLHF_TLS_CA": d / "ca.pem", "RLHF_TLS_CERT": d / "cert.pem", "RLHF_TLS_KEY": d / "key.pem"}
    paths["RLHF_TLS_CA"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["RLHF_TLS_CERT"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["RLHF_TLS_KEY"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return {k: str(v) for k, v in paths.items()}


def test_readiness_poll_says_when_the_certificate_does_not_verify(tmp_path):
    """TLS without the right RLHF_TLS_CA: a clear error at once, not a 600 s wait for readiness."""
    pytest.importorskip("cryptography")
    paths = _certificates(tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(paths["RLHF_TLS_CERT"], paths["RLHF_TLS_KEY"])
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(launcher.LaunchError, match="RLHF_TLS_CA"):
            launcher.http_ready(url, timeout=5, context=ssl.create_default_context())  # system roots only
        trusted = ssl.create_default_context(cafile=paths["RLHF_TLS_CA"])
        assert launcher.http_ready(url, timeout=5, context=trusted) is False  # verified; no /readyz there: 404
    finally:
        server.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.skipif(not _ring_available(), reason="needs the trainer and rollout services")
def test_rlhf_up_tls_ring(tmp_path, tiny_models):
    """Issue 17.5: with RLHF_TLS_CERT/KEY/CA every service serves TLS only and every client (rollout -> reward and
    reference, trainer -> rollout weight pushes, rlhf up -> /readyz) verifies its peer; the demo ring runs to the end.
    A client left in plaintext would not get one answer from a TLS server, so the finished run is the proof."""
    pytest.importorskip("cryptography")
    cfg = demo_config("demo", "tls")
    run_dir = tmp_path / "run"
    cfg["training"].update(
        train_iters=2, global_batch_size=2, save_interval=2, save=str(run_dir / "checkpoints"), log_interval=1
    )
    cfg["actor_rollout_ref"]["actor_rollout"].update(max_new_tokens=4, ppo_mini_batch_size=2, ppo_epochs=1)
    cfg["critic"].update(critic_mini_batch_size=2, critic_update_epochs=1)
    # hf: a quicker start than vLLM
    proc = run_up(cfg, tmp_path, run_dir, "--quiet", env={**_certificates(tmp_path), "RLHF_ROLLOUT_ENGINE": "hf"})
    out = proc.stdout + proc.stderr
    logs = {p.stem: p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")}
    assert proc.returncode == 0, out + "\n".join(
        f"--- {k}\n{procs.log_tail(run_dir / 'logs' / (k + '.log'))}" for k in logs
    )
    assert "TLS on" in out and re.search(r"\[rlhf up\] \S+ ready", out), out
    for name in ("reward", "reference", "rollout", "trainer"):  # each served gRPC and HTTP with TLS
        assert re.search(r"gRPC on \S+, HTTP on \S+ \(TLS\)", logs[name]), (name, logs[name][-2000:])
    assert "weight sync to" not in logs["trainer"], logs["trainer"][-3000:]  # every push reached the replica
    records = report.load_metrics(run_dir / "metrics.jsonl")
    assert max(r["step"] for r in records) == 2
    assert all(r["staleness/max"] == 0 for r in records), records  # the replica served each new version
    assert all(math.isfinite(r["reward/mean"]) for r in records)
