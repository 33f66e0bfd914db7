"""``rlhf up``: a whole training run on one machine, every service as a local process.

A private ``redis-server`` (unless ``RLHF_REDIS_URL`` names one), then reward and reference (and the environment
service(s) and, with training_service.enabled, the training service), the rollout
replica(s) and the trainer, each ``python -m services.cli serve NAME`` on free loopback
ports and waited for (``GET /readyz``); one progress line per training step; plots when the trainer is done; a
service that dies mid-run is restarted on its ports. The children are :mod:`rlhf.procs`' (own process groups).

Design (start order, checks, stopping, restarts, resume, the run folder): docs/running.md.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import ssl
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import yaml

from rlhf import runlog
from rlhf.procs import Child, LaunchError, LocalRedis, http_ready, stop_children
from rlhf.tiny import parse_ref
from services import report
from services.plan import ServiceSpec, child_env, default_run_dir, plan_services
from services.progress import Eta, MetricsTail, format_event, format_progress

if TYPE_CHECKING:
    from rlhf.config import ExperimentConfig
    from rlhf.serving import ServiceSettings
    from services.devices import DevicePlan

_BUILD_TINY = "import sys; from rlhf.tiny import build_tiny; build_tiny(sys.argv[1])"


class Interrupted(Exception):  # a control-flow signal, not an error
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ------------------------------------------------------------ redis


class RedisChild(LocalRedis):
    """``rlhf up``'s private redis-server: its log in the run folder, protected mode on; refused at once when
    redis-server is not installed, with the way around it."""

    def __init__(self, directory: Path, log_path: Path, port: int | None = None, exe: str | None = None):
        exe = exe or shutil.which("redis-server")
        if exe is None:
            raise LaunchError(
                "redis-server is not on PATH: install it (apt-get install redis-server) or set RLHF_REDIS_URL"
            )
        super().__init__(directory, port, extra_args=["--protected-mode", "yes"], log_path=log_path, exe=exe)


# ------------------------------------------------------------ the run


@dataclass
class RunOptions:
    config: Path
    run_dir: Path | None = None
    overrides: tuple[str, ...] = ()  # command-line KEY=VALUE overrides of the config file (Hydra style)
    rollout_replicas: int | None = None  # None: from the config's device counts, else 1
    trainer_procs: int | None = None  # None: actor_rollout.num_gpus_for_train, else 1
    ready_timeout: float = 600.0
    stop_grace: float = 20.0
    python: str = sys.executable
    quiet: bool = False
    max_restarts: int = 3


class Launcher:
    def __init__(self, opts: RunOptions, out: IO[str] | None = None):
        self.opts = opts
        self.out = out or sys.stdout
        self.children: list[Child] = []
        self.ssl_context: ssl.SSLContext | None = None  # polling /readyz of services that serve TLS
        self._force = False
        self._stopping = False
        self.run_dir: Path | None = None
        self.restarts: dict[str, int] = {}
        self._tail: MetricsTail | None = None
        self._addr_names: dict[str, str] = {}  # rollout gRPC address -> service name, for the trainer's events

    def say(self, msg: str) -> None:
        print(f"[rlhf up] {msg}", file=self.out, flush=True)

    # signals ---------------------------------------------------------
    def _on_signal(self, signum, frame) -> None:
        if self._stopping:
            self._force = True  # second Ctrl-C: kill now
            return
        self._stopping = True
        raise Interrupted(signum)

    # start-up --------------------------------------------------------
    def _start(self, spec: ServiceSpec, config: Path) -> Child:
        assert self.run_dir is not None
        child = Child(
            spec.name,
            spec.argv(config, self.opts.python),
            self.run_dir / "logs" / f"{spec.name}.log",
            env=child_env(spec.env),
        )
        child.start()
        self.children.append(child)
        self.say(f"started {spec.name} (pid {child.pid}, http {spec.http_url}, grpc {spec.grpc_addr})")
        return child

    def _wait_ready(self, group: list[tuple[ServiceSpec, Child]], may_finish: tuple[str, ...] = ()) -> None:
        """Wait until every service of ``group`` answers /readyz 200 (a name in ``may_finish`` may exit 0 instead)."""
        t0 = time.monotonic()
        pending = list(group)
        while pending:
            self._check_alive(exclude=may_finish)
            for spec, child in list(pending):
                rc = child.poll()
                if rc is not None:
                    if rc == 0 and spec.name in may_finish:
                        pending.remove((spec, child))
                        continue
                    raise LaunchError(
                        f"{spec.name} exited with {rc} during start-up; end of {child.log_path}:\n{child.log_tail()}"
                    )
                if http_ready(spec.http_url, context=self.ssl_context):
                    self.say(f"{spec.name} ready ({time.monotonic() - t0:.1f}s)")
                    pending.remove((spec, child))
            if pending and time.monotonic() - t0 > self.opts.ready_timeout:
                names = ", ".join(s.name for s, _ in pending)
                tails = "\n".join(f"--- {c.log_path}\n{c.log_tail(20)}" for _, c in pending)
                raise LaunchError(f"not ready after {self.opts.ready_timeout:.0f}s: {names}\n{tails}")
            if pending:
                time.sleep(0.2)

    def _check_alive(self, exclude: tuple[str, ...] = ()) -> None:
        for child in self.children:
            if child.name in exclude:
                continue
            rc = child.poll()
            if rc is not None:
                raise LaunchError(f"{child.name} exited early with {rc}; end of {child.log_path}:\n{child.log_tail()}")

    def _supervise(self, exclude: tuple[str, ...] = ()) -> None:
        """After start-up: a service (or the private redis-server) that died is restarted on its ports, as compose
        and Kubernetes restart containers; the ring's queue and checkpoints make that safe."""
        for child in self.children:
            if child.name not in exclude and child.proc is not None and (rc := child.poll()) is not None:
                self._restart(child, rc)

    def _restart(self, child: Child, rc: int) -> None:
        """Restart ``child`` after it exited with ``rc``, at most ``max_restarts`` times per service (backing off),
        then give up with its log's tail."""
        n = self.restarts.get(child.name, 0)
        if n >= self.opts.max_restarts:
            raise LaunchError(
                f"{child.name} exited with {rc} after {n} restart(s) (--max-restarts "
                f"{self.opts.max_restarts}); end of {child.log_path}:\n{child.log_tail()}"
            )
        self.restarts[child.name] = n + 1
        self.say(f"{child.name} exited with {rc}; restarting it ({n + 1}/{self.opts.max_restarts})")
        child.signal_group(signal.SIGKILL)  # what is left of its process group
        child.close_log()
        time.sleep(min(0.5 * 2**n, 8.0))
        child.start()  # a redis-server waits until it answers
        self.say(f"restarted {child.name} (pid {child.pid})")

    # main ------------------------------------------------------------
    def run(self) -> int:
        """The whole run: check it, prepare the run folder, start the services stage by stage, follow training, stop
        everything and draw the plots. Returns the exit code (2: refused before anything started)."""
        config_path = Path(self.opts.config).resolve()
        try:
            cfg, merged, settings = self._load(config_path)
        except ValueError as err:  # a config (ConfigError) or an RLHF_* variable that cannot be used
            print(f"rlhf up: {err}", file=sys.stderr)
            return 2
        from rlhf.serving import client_ssl_context

        self.ssl_context = client_ssl_context(settings)
        if why := training_service_problem(cfg):
            print(f"rlhf up: {why}", file=sys.stderr)
            return 2
        if not self._preflight(cfg, config_path):
            return 2
        try:
            replicas, devices = self._devices(cfg)
            from services.devices import trainer_procs

            procs = trainer_procs(cfg, self.opts.trainer_procs)
        except ValueError as err:
            print(f"rlhf up: {err}", file=sys.stderr)
            return 2
        run_id = os.environ.get("RLHF_RUN_ID") or cfg.run_id
        config_path = self._make_run_dir(run_id, config_path, merged)

        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        t_start = time.monotonic()
        try:
            self.say(f"run {run_id}: {self.run_dir}")
            self._prepare_models(cfg)
            specs = self._plan(
                cfg, run_id, self._start_redis(), tls=settings.tls, replicas=replicas, devices=devices, procs=procs
            )
            trainer = self._start_services(specs, config_path)
            self._check_trainer_exit(trainer, self._follow(trainer, cfg.training.train_iters, t_start))
            self.say(f"training done in {time.monotonic() - t_start:.0f}s; stopping the services")
            self._shutdown()
            return self._finish()
        except Interrupted as sig:
            self.say(f"{sig}: stopping every process; the trainer checkpoints first (Ctrl-C again to kill at once)")
            self._shutdown()
            if self.run_dir is not None and (self.run_dir / "metrics.jsonl").exists():
                self.say(f"continue with: rlhf up --resume {self.run_dir}")
            return 128 + sig.signum
        except LaunchError as err:
            print(f"rlhf up: {err}", file=sys.stderr, flush=True)
            self._shutdown()
            return 1
        finally:
            self._shutdown()
            for s, h in old.items():
                signal.signal(s, h)

    def _load(self, config_path: Path) -> tuple[ExperimentConfig, dict | None, ServiceSettings]:
        """The config with the command line's overrides, its merged data (None without overrides) and the RLHF_*
        settings. Raises ValueError (a ConfigError for the config) naming what cannot be used."""
        from rlhf.config import load_config, read_config_data
        from rlhf.serving import ServiceSettings

        overrides = self.opts.overrides
        cfg = load_config(config_path, overrides)
        merged = read_config_data(config_path, overrides) if overrides else None
        # the services read the same RLHF_* variables: TLS on for them is TLS on for the launcher's polls
        return cfg, merged, ServiceSettings.from_env()

    def _preflight(self, cfg: ExperimentConfig, config_path: Path) -> bool:
        """:func:`rlhf.preflight.check` and the policy's architecture, printed; False when nothing may start."""
        from rlhf import preflight

        report = preflight.check(cfg, os.environ.get("RLHF_REDIS_URL"))
        # The policy's architecture under the rollout engine (the vllm check includes the transformers one the trainer
        # needs). A tiny: model is built first (a second), so its architecture is checked like any other.
        from rlhf.models import check_architecture, resolve_model_path

        load, engine = cfg.actor.load, os.environ.get("RLHF_ROLLOUT_ENGINE") or cfg.actor.engine
        try:
            if load.startswith("tiny:"):
                parse_ref(load.split(":", 1)[1])
            if why := check_architecture(resolve_model_path(load), engine):
                report.problems.append(f"actor_rollout_ref.actor_rollout.load: {why}")
        except ValueError as err:  # an unknown tiny: name
            report.problems.append(f"actor_rollout_ref.actor_rollout.load: {err}")
        except OSError:
            pass  # a model that cannot be found: preflight.check has reported it
        if report.problems or report.warnings:
            print(f"rlhf up: {preflight.format_report(report, config_path)}", file=sys.stderr, flush=True)
        return not report.problems

    def _make_run_dir(self, run_id: str, config_path: Path, merged: dict | None) -> Path:
        """Make the run folder (``self.run_dir``) with its config.yaml and logs/; returns the config the services
        read."""
        self.run_dir = Path(self.opts.run_dir or default_run_dir(run_id)).resolve()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        if merged is not None:
            # every service reads the config file itself: they all get the run folder's copy with the overrides
            # applied (and --resume of this folder continues with them)
            (self.run_dir / "config.yaml").write_text(yaml.safe_dump(merged, sort_keys=False))
            config_path = (self.run_dir / "config.yaml").resolve()
            self.say(f"config {self.opts.config} with overrides {' '.join(self.opts.overrides)}: {config_path}")
        elif config_path != (self.run_dir / "config.yaml").resolve():
            shutil.copyfile(config_path, self.run_dir / "config.yaml")
        # A run folder used before (--resume): its trainer goes on from its checkpoint and cuts metrics.jsonl back to
        # it; cut it here first, before anything can append, so the progress shown continues from that step.
        metrics = self.run_dir / "metrics.jsonl"
        runlog.truncate_after(metrics, runlog.checkpoint_step(self.run_dir / "checkpoints"))
        self._tail = MetricsTail(metrics, from_end=True)
        return config_path

    def _start_redis(self) -> str:
        """The Redis URL: RLHF_REDIS_URL's, else a private redis-server's, started here."""
        assert self.run_dir is not None
        redis_url = os.environ.get("RLHF_REDIS_URL")
        if redis_url:
            self.say("using Redis from RLHF_REDIS_URL")
            return redis_url
        redis = RedisChild(self.run_dir / "redis", self.run_dir / "logs" / "redis.log").start()
        self.children.append(redis)
        self.say(f"redis-server ready on port {redis.port} (pid {redis.pid}, AOF in {redis.directory})")
        return redis.url

    def _plan(
        self,
        cfg: ExperimentConfig,
        run_id: str,
        redis_url: str,
        *,
        tls: bool,
        replicas: int,
        devices: DevicePlan | None,
        procs: int,
    ) -> list[ServiceSpec]:
        """Every service of the run, in start order, with its ports and environment."""
        assert self.run_dir is not None
        specs = plan_services(
            redis_url=redis_url,
            run_id=run_id,
            api_token=os.environ.get("RLHF_API_TOKEN") or secrets.token_urlsafe(24),
            run_dir=self.run_dir,
            rollout_replicas=replicas,
            tls=tls,
            devices=devices,
            trainer_procs=procs,
            environment_replicas=cfg.environment.replicas if cfg.environment.name else 0,
            training_service=cfg.training_service.enabled,
        )
        if tls:
            self.say("TLS on: every service serves gRPC and HTTPS, every client verifies its peer")
        if (os.environ.get("RLHF_ROLLOUT_ENGINE") or cfg.actor.engine) == "vllm":
            # vLLM's CPU kernels keep their serving default of one thread (services.rollout.vllm_engine); the
            # every-core default of child_env was measured with the hf engine only
            for s in specs:
                if s.service == "rollout":
                    s.env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        return specs

    def _start_services(self, specs: list[ServiceSpec], config_path: Path) -> Child:
        """Start the services in three stages (reward, reference and environments; the rollout replicas; the
        trainer), each ready before the next begins; returns the trainer's process."""
        by_name = {s.name: s for s in specs}
        stages = [
            [by_name["reward"], by_name["reference"], *(s for s in specs if s.service in ("environment", "training"))],
            [s for s in specs if s.service == "rollout"],
            [by_name["trainer"]],
        ]
        for stage in stages:
            started = [(spec, self._start(spec, config_path)) for spec in stage]
            self._wait_ready(started, may_finish=("trainer",))
        self._addr_names = {s.grpc_addr: s.name for s in specs if s.service == "rollout"}
        if "training" in by_name:
            self.say(
                f"training service (tinker SDK): TINKER_BASE_URL={by_name['training'].http_url}, "
                "keys from RLHF_TRAINING_TOKENS / RLHF_API_TOKEN (docs/tinker.md)"
            )
        return next(c for c in self.children if c.name == "trainer")

    def _check_trainer_exit(self, trainer: Child, rc: int) -> None:
        """A trainer that did not finish its run: a LaunchError with why (its stopping rule's message) or its log."""
        if rc == runlog.EXIT_STOPPED_BY_RULE:
            stop = next((ln for ln in reversed(trainer.log_tail(200).splitlines()) if "stopping the run" in ln), "")
            raise LaunchError(
                f"the trainer stopped the run: {stop.split('stopping the run: ', 1)[-1]}\n"
                f"end of {trainer.log_path}:\n{trainer.log_tail(10)}"
            )
        if rc != 0:
            raise LaunchError(f"trainer exited with {rc}; end of {trainer.log_path}:\n{trainer.log_tail()}")

    def _devices(self, cfg) -> tuple[int, DevicePlan | None]:
        """Rollout replicas and, on an accelerator machine, the devices of each service (resource_pool)."""
        from services.devices import VISIBLE_ENV, plan_devices, rollout_replicas, visible_devices

        kind = cfg.training.device
        if kind == "auto":
            from rlhf.models import auto_device_type

            kind = auto_device_type()
        a = cfg.actor
        placed = cfg.resource_pool.model_fields_set or a.num_gpus_for_train or a.num_gpus_for_infer
        if kind not in VISIBLE_ENV or not placed:
            return self.opts.rollout_replicas or 1, None  # CPU, or no device counts: every service sees every device
        replicas = rollout_replicas(cfg, self.opts.rollout_replicas)
        plan = plan_devices(cfg, visible_devices(kind), replicas, VISIBLE_ENV[kind])
        self.say(plan.describe())
        return replicas, plan

    def _prepare_models(self, cfg) -> None:
        """Build the tiny models once, before the services start (they would otherwise race to build them)."""
        specs = [cfg.actor.load, cfg.actor_rollout_ref.ref.load, cfg.critic.load, cfg.reward.load]
        specs += [s.load for s in cfg.reward.scorers]
        if not any(isinstance(s, str) and s.startswith("tiny:") for s in specs):
            return
        assert self.run_dir is not None
        env = child_env({})
        target = Path(env["RLHF_CACHE_DIR"]) / "tiny"
        child = Child(
            "tiny", [self.opts.python, "-c", _BUILD_TINY, str(target)], self.run_dir / "logs" / "tiny.log", env=env
        )
        child.start()
        self.children.append(child)
        try:
            while child.running:
                time.sleep(0.1)
        finally:
            self.children.remove(child)
            child.close_log()
        if child.poll() != 0:
            raise LaunchError(f"building the tiny models failed ({child.poll()}):\n{child.log_tail()}")

    def _follow(self, trainer: Child, total: int, t_start: float) -> int:
        assert self.run_dir is not None
        tail = self._tail or MetricsTail(self.run_dir / "metrics.jsonl", from_end=True)
        eta = Eta(total)

        events = MetricsTail(self.run_dir / "events.jsonl", from_end=True)
        names = self._addr_names

        def line(rec: Mapping[str, Any]) -> str:
            now = time.monotonic()
            return format_progress(rec, total, now - t_start, eta(rec, now))

        stopped = False  # a stopping rule's "stopped" event: torchrun reports rank 0's exit 3 as its own 1
        while True:
            for rec in tail.read():
                if not self.opts.quiet:
                    print(line(rec), file=self.out, flush=True)
            for ev in events.read():  # the ring's changes of state between steps (services/trainer/loop.py)
                stopped = stopped or ev.get("event") == "stopped"
                if not self.opts.quiet and ev.get("event") in ("waiting", "resumed"):
                    print(format_event(ev, total, names), file=self.out, flush=True)
            rc = trainer.poll()
            if rc == 0:
                for rec in tail.read():
                    if not self.opts.quiet:
                        print(line(rec), file=self.out, flush=True)
                return rc
            if rc is not None and not stopped:  # the event may have come after the read above
                stopped = any(ev.get("event") == "stopped" for ev in events.read())
            if rc == runlog.EXIT_STOPPED_BY_RULE or (rc is not None and stopped):
                return runlog.EXIT_STOPPED_BY_RULE  # the run stopped itself: restarting would not help
            if rc is not None:  # it resumes from its last checkpoint
                try:
                    self._restart(trainer, rc)
                except LaunchError:
                    return rc
            self._supervise(exclude=("trainer",))
            time.sleep(0.25)

    def _shutdown(self) -> None:
        self._stopping = True
        live = [c for c in self.children if c.proc is not None]
        if not live:
            return
        stop_children(reversed(live), self.opts.stop_grace, force=lambda: self._force, say=self.say)
        self.children.clear()

    def _finish(self) -> int:
        assert self.run_dir is not None

        metrics = self.run_dir / "metrics.jsonl"
        if not metrics.is_file():
            print(f"rlhf up: the trainer finished but wrote no {metrics}", file=sys.stderr)
            return 1
        try:
            paths = report.draw(self.run_dir)
        except Exception as err:  # noqa: BLE001 - say what failed; the run itself is done
            print(
                f"rlhf up: drawing the plots failed: {err} (retry with `rlhf report {self.run_dir}`)", file=sys.stderr
            )
            return 1
        print(report.summary(report.load_metrics(metrics)), file=self.out)
        self.say("plots: " + ", ".join(str(p) for p in paths))
        self.say(f"run folder: {self.run_dir}")
        return 0


def training_service_problem(cfg: ExperimentConfig, env: Mapping[str, str] | None = None) -> str | None:
    """Why the config's training service could not serve anyone, or None. The SDK sends only keys that start with
    ``tml-``, and the service accepts RLHF_API_TOKEN and RLHF_TRAINING_TOKENS: without such a key among them (rlhf up
    would make up a random RLHF_API_TOKEN) every SDK call would be refused."""
    if not cfg.training_service.enabled:
        return None
    env = os.environ if env is None else env
    keys = [env.get("RLHF_API_TOKEN", ""), *env.get("RLHF_TRAINING_TOKENS", "").split(",")]
    if any(k.strip().startswith("tml-") for k in keys):
        return None
    return (
        "training_service.enabled: set RLHF_TRAINING_TOKENS (comma-separated keys, one per user) or RLHF_API_TOKEN to "
        "a key that starts with tml- (the tinker SDK sends no other); the service would refuse every call"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="experiment config YAML (this, --config-name or --resume)")
    p.add_argument(
        "--config-name",
        metavar="NAME",
        help="a config by name, without .yaml, as MindSpeed-LLM's --config-name: NAME.yaml in --config-dir, "
        "else in ./configs, else in this project's configs/ (demo, demo-grpo, llama32-1b-ppo, ...)",
    )
    p.add_argument("--config-dir", metavar="DIR", help="the folder --config-name looks in")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override config fields, Hydra style: a dotted key and a YAML value "
        "(training.train_iters=5 actor_rollout_ref.actor_rollout.do_sample=false reward.scorers.0.weight=2; "
        "~KEY removes a key); each is validated like the file, and the run folder's config.yaml holds the result",
    )
    p.add_argument("--run-dir", help="run folder (default runs/<run_id>-<timestamp>)")
    p.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue a stopped run: its folder's config (unless --config), Redis data, checkpoints and "
        "metrics; training goes on from the last checkpoint",
    )
    p.add_argument(
        "--rollout-replicas",
        type=int,
        default=None,
        help="rollout processes (default: the config's rollout devices / tensor parallel size, else 1)",
    )
    p.add_argument(
        "--trainer-procs",
        type=int,
        default=None,
        help="trainer processes: > 1 runs an FSDP2 trainer group under torch.distributed.run (gloo on "
        "the CPU) (default: actor_rollout.num_gpus_for_train, else 1)",
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds each stage may take to get ready")
    p.add_argument("--stop-grace", type=float, default=20.0, help="seconds a service gets after SIGTERM")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="times each service is restarted after it dies mid-run (default %(default)s)",
    )


PROJECT_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def find_named_config(name: str, config_dir: str | None = None) -> Path:
    """``--config-name NAME`` -> the file: NAME.yaml (or .yml) in ``config_dir`` when given, else in ./configs, else
    in this project's configs/ (MindSpeed-LLM looks its names up in configs/rlxf the same way)."""
    stem = name[: -len(Path(name).suffix)] if Path(name).suffix in (".yaml", ".yml") else name
    dirs = [Path(config_dir)] if config_dir else [Path("configs"), PROJECT_CONFIGS]
    for d in dirs:
        for suffix in (".yaml", ".yml"):
            if (d / (stem + suffix)).is_file():
                return d / (stem + suffix)
    known = sorted({p.stem for d in dirs if d.is_dir() for p in d.glob("*.y*ml")})
    where = " or ".join(str(d) for d in dict.fromkeys(dirs))
    raise FileNotFoundError(
        f"--config-name {name}: no {stem}.yaml in {where}" + (f"; the names there: {', '.join(known)}" if known else "")
    )


def main(args: argparse.Namespace) -> int:
    if args.rollout_replicas is not None and args.rollout_replicas < 1:
        print("rlhf up: --rollout-replicas must be at least 1", file=sys.stderr)
        return 2
    if args.trainer_procs is not None and args.trainer_procs < 1:
        print("rlhf up: --trainer-procs must be at least 1", file=sys.stderr)
        return 2
    if args.max_restarts < 0:
        print("rlhf up: --max-restarts must be at least 0", file=sys.stderr)
        return 2
    run_dir = args.run_dir
    if args.resume:
        if args.run_dir:
            print("rlhf up: give --resume RUN_DIR or --run-dir, not both", file=sys.stderr)
            return 2
        if not Path(args.resume).is_dir():
            print(f"rlhf up: --resume: run folder {args.resume} does not exist", file=sys.stderr)
            return 2
        run_dir = args.resume
    if args.config and args.config_name:
        print("rlhf up: give --config FILE or --config-name NAME, not both", file=sys.stderr)
        return 2
    if args.config_dir and not args.config_name:
        print("rlhf up: --config-dir is where --config-name looks; give --config-name NAME", file=sys.stderr)
        return 2
    if args.config_name:
        try:
            args.config = str(find_named_config(args.config_name, args.config_dir))
        except FileNotFoundError as err:
            print(f"rlhf up: {err}", file=sys.stderr)
            return 2
    if args.resume:
        args.config = args.config or str(Path(args.resume) / "config.yaml")
    if not args.config:
        print("rlhf up: --config FILE or --config-name NAME is required (or --resume RUN_DIR)", file=sys.stderr)
        return 2
    if not Path(args.config).is_file():
        print(f"rlhf up: config file {args.config} does not exist", file=sys.stderr)
        return 2
    opts = RunOptions(
        config=Path(args.config),
        overrides=tuple(args.overrides),
        run_dir=Path(run_dir) if run_dir else None,
        rollout_replicas=args.rollout_replicas,
        trainer_procs=args.trainer_procs,
        ready_timeout=args.ready_timeout,
        stop_grace=args.stop_grace,
        quiet=args.quiet,
        max_restarts=args.max_restarts,
    )
    return Launcher(opts).run()
