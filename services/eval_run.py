"""``rlhf eval``: one evaluation of a policy on the config's ``eval`` section, outside training.

The held-out prompts go to a rollout's gRPC ``Generate`` (a running service, or one started on ``--checkpoint``)
and the samples to the reward service's ``Score``; the ``eval/*`` row is made and written by the trainer's own
code (:class:`services.trainer.evaluate.Evaluator`). Children run without ``RLHF_REDIS_URL`` / ``RLHF_RUN_DIR``.

Design (options, outputs, exit codes): docs/training.md#rlhf-eval-one-evaluation-outside-training.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import yaml

from rlhf.checkpoints import incomplete_reason, latest_policy
from rlhf.procs import LaunchError, ServiceProc
from rlhf.tracking import Tracker

# A started child must not join a training run (its Redis queue) or load that run's newest checkpoint instead
CHILD_ENV: dict[str, str | None] = {"RLHF_REDIS_URL": None, "RLHF_RUN_DIR": None, "RLHF_WEIGHTS_DATA_PORT": None}
LOAD_KEY = "actor_rollout_ref.actor_rollout.load"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="experiment config YAML: its eval section (and actor, reward)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override config fields as `rlhf up` does (eval.path=data/heldout.jsonl eval.n=4 eval.temperature=1.0)",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--rollout",
        metavar="HOST:PORT",
        help="gRPC address of a running rollout service (comma-separated: several replicas share the prompts); "
        "the policy it serves now is evaluated",
    )
    what.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="evaluate this policy: a Hugging Face model folder, a trainer checkpoint (step_N/, its policy/) or a "
        "checkpoints folder (its newest complete checkpoint); a rollout replica is started on it",
    )
    p.add_argument(
        "--reward",
        metavar="HOST:PORT",
        help="gRPC address of a running reward service (default: start the config's reward section)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="folder for metrics.jsonl, tensorboard/ and the started services' logs/ "
        "(default runs/eval-<run_id>-<timestamp>; a training run's folder adds the row to its metrics)",
    )
    p.add_argument(
        "--step",
        type=int,
        help="the step the row is reported as (default: the checkpoint's training step, else 0)",
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a started service may take to get ready")


def _say(msg: str) -> None:
    print(f"[rlhf eval] {msg}", file=sys.stderr, flush=True)


def resolve_checkpoint(path: str | Path) -> tuple[Path, int | None]:
    """``--checkpoint`` -> (the Hugging Face policy folder, its training step when known)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return path, None
    if (path / "policy" / "config.json").is_file():  # one trainer checkpoint, step_<N>/
        reason = incomplete_reason(path)
        if reason is not None:
            raise FileNotFoundError(f"--checkpoint: {reason}")
        state = json.loads((path / "state.json").read_text())
        return path / "policy", int(state["step"])
    if path.is_dir():
        found = latest_policy(path)
        if found is not None:
            return found.path, found.step
    raise FileNotFoundError(
        f"--checkpoint: {path} is neither a Hugging Face model folder (config.json), a trainer checkpoint "
        "(step_N/ with policy/) nor a folder of complete checkpoints"
    )


def main(args: argparse.Namespace) -> int:
    from rlhf.config import ConfigError, load_config, read_config_data

    overrides = list(args.overrides)
    step = args.step
    policy: Path | None = None
    try:
        section = read_config_data(args.config, overrides).get("eval") or {}
        if not section.get("path"):
            print("rlhf eval: the config has no eval.path: set it in the file or as eval.path=FILE", file=sys.stderr)
            return 2
        if not section.get("interval"):
            # a section with evaluation off refuses its other fields (they would be ignored in training); here they
            # are used, and interval, the trainer's schedule, is not
            overrides.append("eval.interval=1")
        if args.checkpoint:
            policy, ckpt_step = resolve_checkpoint(args.checkpoint)
            overrides.append(f"{LOAD_KEY}={json.dumps(str(policy.resolve()))}")
            step = step if step is not None else ckpt_step
        cfg = load_config(args.config, overrides)
    except (ConfigError, FileNotFoundError) as err:
        print(f"rlhf eval: {err}", file=sys.stderr)
        return 2
    step = step if step is not None else 0
    out = Path(args.out) if args.out else Path("runs") / f"eval-{cfg.run_id}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, cfg, overrides, policy, out, step)
    except KeyboardInterrupt:  # the started services are stopped on the way out
        print("rlhf eval: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, cfg, overrides: list[str], policy: Path | None, out: Path, step: int) -> int:
    from rlhf.config import read_config_data

    with contextlib.ExitStack() as stack:
        rollout, reward = args.rollout, args.reward
        needed = [n for n, addr in (("rollout", rollout), ("reward", reward)) if not addr]
        if needed:
            # the services read the config as this command does (overrides and the checkpoint's load included)
            served = out / "eval-config.yaml"
            served.write_text(yaml.safe_dump(read_config_data(args.config, overrides), sort_keys=False))
            # run from here: relative paths in the config (eval.path, ...) mean what they mean to this command
            procs = {
                n: ServiceProc(n, served.resolve(), (out / "logs").resolve(), env=CHILD_ENV, cwd=Path.cwd())
                for n in needed
            }
            for name, proc in procs.items():
                _say(f"starting the {name} service (log {proc.log_path})")
                stack.callback(proc.stop)
                proc.start(wait_ready=False)  # all start together; then each is waited for
            try:
                for proc in procs.values():
                    proc.wait_ready(args.ready_timeout)
            except (LaunchError, TimeoutError) as err:
                print(f"rlhf eval: a service did not start: {err}", file=sys.stderr)
                return 1
            rollout = rollout or procs["rollout"].grpc_addr
            reward = reward or procs["reward"].grpc_addr
            _say("services ready: " + ", ".join(f"{n} {p.grpc_addr}" for n, p in procs.items()))
        return _evaluate(cfg, policy, rollout, reward, out, step)


def _evaluate(cfg, policy: Path | None, rollout: str, reward: str, out: Path, step: int) -> int:
    from rlhf.config import ConfigError
    from rlhf.models import load_tokenizer, resolve_model_path
    from rlhf.serving import ServiceSettings
    from services.trainer.evaluate import Evaluator

    try:
        settings = ServiceSettings.from_env(rollout_addrs=rollout, reward_addr=reward)
        # the prompts are tokenized as the trainer tokenizes them: the config's tokenizer, else the policy's
        tokenizer = load_tokenizer(cfg.training.tokenizer_name_or_path or policy or resolve_model_path(cfg.actor.load))
    except (ValueError, OSError) as err:
        print(f"rlhf eval: {err}", file=sys.stderr)
        return 2
    tracker = Tracker(out, f"{cfg.run_id}-eval", cfg.model_dump())
    try:
        try:
            evaluator = Evaluator(cfg, settings, tokenizer, out, tracker)
        except (ConfigError, ValueError) as err:
            print(f"rlhf eval: {err}", file=sys.stderr)
            return 2
        evaluator.on_progress = _say
        _say(f"{len(evaluator.records)} held-out prompts of {cfg.eval.path}; rollout {rollout}, reward {reward}")
        try:
            metrics = asyncio.run(evaluator.run(step, reraise=True))
        except Exception as err:  # noqa: BLE001 - a failed evaluation is this command's result: say why
            print(f"rlhf eval: the evaluation failed: {err}", file=sys.stderr)
            return 1
    finally:
        tracker.close()
    n = cfg.eval.n
    pass_k = metrics.get(f"eval/pass@{n}", math.nan)
    _say(
        f"reward {metrics.get('eval/reward_mean', math.nan):.4f}  pass@{n} {pass_k:.3f}"
        f"  length {metrics.get('eval/response_length_mean', math.nan):.1f}"
        f"  failed {100 * metrics.get('eval/failed_fraction', 0.0):.0f}%  ({metrics['eval/time_s']:.1f}s); "
        f"wrote {out / 'metrics.jsonl'}"
    )
    print(json.dumps({"step": step, **metrics}))
    return 0
