"""Checks a run can pass in a second, before any service loads a model: all problems at once.

``rlhf up`` runs :func:`check` after the config has loaded (the config's own rules already ran) and before it starts
anything, so a missing data file or a mistyped scorer module is reported in well under a second instead of after
every service has loaded its models (tens of seconds on the tiny models, minutes on real ones).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlhf.config import ConfigError, ExperimentConfig, config_warning
from rlhf.distill import check_teacher_tokenizer


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)  # the run cannot work: nothing is started
    warnings: list[str] = field(default_factory=list)  # it runs, but probably not as meant


def _model_specs(cfg: ExperimentConfig) -> list[tuple[str, str]]:
    specs = [("actor_rollout_ref.actor_rollout.load", cfg.actor.load)]
    if cfg.actor_rollout_ref.ref.load:
        specs.append(("actor_rollout_ref.ref.load", cfg.actor_rollout_ref.ref.load))
    if cfg.training.stage == "ray_ppo" and cfg.critic.load:
        specs.append(("critic.load", cfg.critic.load))
    for i, s in enumerate(cfg.reward.scorers):
        if s.type == "model" and s.load:
            specs.append((f"reward.scorers[{i}].load", s.load))
    return specs


def _own_pad_token_id(spec: str) -> int | None:
    """The pad id a tokenizer folder declares itself (before rlhf.models.load_tokenizer picks a distinct one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(spec).pad_token_id


def check(cfg: ExperimentConfig, redis_url: str | None = None) -> Report:
    """Every check below, in this order; each adds its problems and warnings to the report."""
    report = Report()
    warning = config_warning(cfg)  # MindSpeed keys that do not apply here: one warning, a line per key
    if warning:
        report.warnings.append(warning)
    _check_data(cfg, report)
    actor_dir = _find_models(cfg, report)
    tok_spec = cfg.training.tokenizer_name_or_path or (str(actor_dir) if actor_dir else None)
    if tok_spec:
        _check_tokenizer(tok_spec, report)
    _check_teacher(cfg, tok_spec, report)
    _check_rule_scorers(cfg, report)
    if cfg.actor.load_in_4bit:  # bitsandbytes and a backend for the trainer's device, before anything loads
        from rlhf.models import four_bit_problem  # torch: only for a 4-bit run

        problem = four_bit_problem(cfg.training.device)
        if problem:
            report.problems.append(problem)
    if redis_url:
        _check_redis(redis_url, report)
    return report


def _check_data(cfg: ExperimentConfig, report: Report) -> None:
    """The prompt data set (and the held-out one of an ``eval`` section) loads."""
    from rlhf.data import load_eval_prompts, load_prompts

    try:
        load_prompts(cfg.data)
    except ConfigError as err:
        report.problems.append(str(err))
    except OSError as err:
        report.problems.append(f"data.path: {cfg.data.path}: {err}")
    if cfg.eval.interval:
        try:
            load_eval_prompts(cfg)
        except ConfigError as err:
            report.problems.append(str(err))


def _find_models(cfg: ExperimentConfig, report: Report) -> Path | None:
    """Every model the run loads can be found (``tiny:`` ones are built by ``rlhf up``); returns the policy's folder."""
    actor_dir = None
    for key, spec in _model_specs(cfg):
        if spec.startswith("tiny:"):
            continue  # built by rlhf up itself
        from rlhf.models import resolve_model_path  # torch and transformers: only when there is a model to find

        try:
            path = resolve_model_path(spec)
        except (OSError, ValueError) as err:
            report.problems.append(f"{key}: {err}")
            continue
        if key.startswith("actor_rollout_ref.actor_rollout"):
            actor_dir = path
    return actor_dir


def _check_tokenizer(tok_spec: str, report: Report) -> None:
    """The policy's tokenizer loads, has an EOS token, and a pad token of its own (else a warning)."""
    from rlhf.models import load_tokenizer

    try:
        tok = load_tokenizer(tok_spec)
    except Exception as err:  # noqa: BLE001 - whatever the tokenizer library raises, it is this file's problem
        report.problems.append(f"tokenizer {tok_spec}: cannot be loaded ({type(err).__name__}: {err})")
        return
    if tok.eos_token_id is None:
        report.problems.append(f"tokenizer {tok_spec} has no EOS token: responses could never end")
    own = _own_pad_token_id(tok_spec)
    if own is None or own == tok.eos_token_id:
        report.warnings.append(
            f"tokenizer {tok_spec} has no pad token of its own"
            + (
                " (it uses its EOS token as padding, which would mask the EOS that ends a response)"
                if own is not None
                else ""
            )
            + f": padding with {tok.pad_token!r} (id {tok.pad_token_id}) instead"
        )


def _check_teacher(cfg: ExperimentConfig, tok_spec: str | None, report: Report) -> None:
    """With distillation on, the teacher (the reference model) shares the policy's tokenizer."""
    teacher = cfg.actor_rollout_ref.ref.load
    # tiny: models share one tokenizer by construction; others are checked here in a second, not after loading
    both_tiny = (
        teacher is not None and teacher.startswith("tiny:") and tok_spec is None and cfg.actor.load.startswith("tiny:")
    )
    if cfg.algorithm.distill.coef > 0 and teacher and not both_tiny:
        try:
            check_teacher_tokenizer(tok_spec or cfg.actor.load, teacher)
        except ValueError as err:
            report.problems.append(str(err))
        except Exception as err:  # noqa: BLE001 - whatever the tokenizer library raises, it is this file's problem
            report.problems.append(
                f"actor_rollout_ref.ref.load {teacher}: the teacher's tokenizer cannot be loaded "
                f"({type(err).__name__}: {err})"
            )


def _check_rule_scorers(cfg: ExperimentConfig, report: Report) -> None:
    """A rule scorer named ``module:function`` imports as the reward service will import it."""
    for i, s in enumerate(cfg.reward.scorers):
        if s.type == "rule" and s.name and ":" in s.name:
            module, _, fn = s.name.partition(":")
            try:
                with _cwd_on_path():  # where the reward service finds a user's module too
                    found = getattr(importlib.import_module(module), fn, None)
            except Exception as err:  # noqa: BLE001 - a user module may fail to import in any way
                report.problems.append(
                    f"reward.scorers[{i}].name {s.name}: module {module!r} does not import from {os.getcwd()} "
                    f"({type(err).__name__}: {err})"
                )
                continue
            if not callable(found):
                report.problems.append(f"reward.scorers[{i}].name {s.name}: {module} has no function {fn!r}")


def _check_redis(redis_url: str, report: Report) -> None:
    """Some address of ``redis_url`` accepts a connection."""
    from rlhf.transport.connection import addresses, redact

    try:
        addrs = addresses(redis_url)
    except ValueError as err:
        report.problems.append(str(err))
        addrs = []
    errors = []
    for host, port in addrs:  # a Sentinel group or a cluster is usable while any of its addresses answers
        try:
            socket.create_connection((host, port), timeout=2).close()
            break
        except OSError as err:
            errors.append(f"{host}:{port}: {err}")
    else:
        if addrs:
            report.problems.append(f"RLHF_REDIS_URL {redact(redis_url)}: cannot connect ({'; '.join(errors)})")


@contextlib.contextmanager
def _cwd_on_path():
    """The working directory after the installed packages, as the reward service looks for a user's module."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added:
            sys.path.remove(cwd)


def format_report(report: Report, source: str | Path) -> str:
    lines = []
    if report.problems:
        lines.append(f"{len(report.problems)} problem(s) with {source}; nothing was started:")
        lines += [f"  - {p}" for p in report.problems]
    for w in report.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
