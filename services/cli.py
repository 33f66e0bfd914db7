"""The ``rlhf`` command: ``serve NAME`` (a service), ``up`` (a whole run on one machine), ``report RUN_DIR`` (plots),
``eval`` (one evaluation outside training), and the REST clients ``score``, ``logprobs``, ``generate``.

Only this module (and the launcher) knows every service: ``serve NAME`` imports ``services.NAME.main`` lazily and
calls ``serve(config_path, settings)`` (a coroutine function, or a plain function that blocks until stopped).
Usage: docs/running.md, docs/services.md, docs/training.md#rlhf-eval-one-evaluation-outside-training.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import logging
import os
import ssl
import sys
import urllib.error
import urllib.request
from typing import Any

from services import eval_run, launcher, report

SERVICES = ("rollout", "reward", "reference", "trainer", "environment", "training")

log = logging.getLogger("rlhf.cli")


# ------------------------------------------------------------ serve


def _serve(args: argparse.Namespace) -> int:
    from rlhf.serving import ServiceSettings, configure_logging, warn_unknown_env_vars  # noqa: PLC0415 - `rlhf serve` only

    try:
        settings = ServiceSettings.from_env(
            host=args.host,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            config=args.config,
            log_level=args.log_level,
            device=args.device,
        )
    except ValueError as err:
        print(f"rlhf serve: {err}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if not settings.config:
        print("rlhf serve: give --config FILE (or set RLHF_CONFIG)", file=sys.stderr)
        return 2
    if not os.path.isfile(settings.config):
        print(f"rlhf serve: config file {settings.config} does not exist", file=sys.stderr)
        return 2
    module_name = f"services.{args.service}.main"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            print(
                f"rlhf serve: the {args.service} service is not available in this installation "
                f"({module_name} is missing)",
                file=sys.stderr,
            )
            return 2
        raise
    warn_unknown_env_vars()  # after the import: a service module may register the variables it reads
    serve = getattr(module, "serve", None)
    if serve is None:
        print(f"rlhf serve: {module_name} has no serve(config_path, settings)", file=sys.stderr)
        return 2
    from rlhf.config import ConfigError  # noqa: PLC0415 - `rlhf serve` only

    try:
        result = serve(settings.config, settings)
        if inspect.iscoroutine(result):
            asyncio.run(result)
    except ConfigError as err:
        print(f"rlhf serve: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if "cannot bind" in str(err) or isinstance(err, FileNotFoundError):
            print(f"rlhf serve: {args.service} failed to start: {err}", file=sys.stderr)
            return 1
        raise
    except ValueError as err:  # a model or setting that cannot be used (named in the message)
        print(f"rlhf serve: {args.service} failed to start: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if getattr(module, "FAST_EXIT", False):  # the service stopped gracefully and leaves nothing to atexit hooks
        # os._exit: no interpreter finalisation (freeing torch, C extensions): exits 0.05 s after "stopped", not 0.5-1.6
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


# ------------------------------------------------------------ clients


def _post(url: str, path: str, body: dict[str, Any], token: str | None, timeout: float) -> int:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers)
    context = None
    if url.startswith("https:"):  # verify the service with RLHF_TLS_CA when set (else the system's roots)
        context = ssl.create_default_context(cafile=os.environ.get("RLHF_TLS_CA") or None)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            out = json.loads(resp.read() or b"null")
            code = 0
    except urllib.error.HTTPError as err:
        raw = err.read()
        try:
            out = json.loads(raw)
        except ValueError:
            out = {"error": {"type": "http_error", "message": raw.decode(errors="replace"), "code": err.code}}
        code = 1
    except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
        reason = getattr(err, "reason", err)
        print(f"cannot reach {url}: {reason}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return code


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", ",").split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _score(args: argparse.Namespace) -> int:
    if len(args.prompt) != len(args.response):
        print("rlhf score: give one --response per --prompt", file=sys.stderr)
        return 2
    if args.label and len(args.label) != len(args.prompt):
        print("rlhf score: give one --label per --prompt (or none)", file=sys.stderr)
        return 2
    items = []
    for i, (p, r) in enumerate(zip(args.prompt, args.response, strict=True)):
        item: dict[str, Any] = {"prompt": p, "response": r}
        if args.label:
            item["label"] = args.label[i]
        items.append(item)
    return _post(args.url, "/v1/score", {"items": items}, args.token, args.timeout)


def _logprobs(args: argparse.Namespace) -> int:
    if len(args.prompt_ids) != len(args.response_ids):
        print("rlhf logprobs: give one --response-ids per --prompt-ids", file=sys.stderr)
        return 2
    items = [{"prompt_ids": p, "response_ids": r} for p, r in zip(args.prompt_ids, args.response_ids, strict=True)]
    body: dict[str, Any] = {"items": items}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return _post(args.url, "/v1/logprobs", body, args.token, args.timeout)


def _generate(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {
        "prompt": args.prompt if len(args.prompt) > 1 else args.prompt[0],
        "max_tokens": args.max_tokens,
        "n": args.n,
        "return_token_ids": True,
    }
    if args.temperature is not None:
        body["temperature"] = args.temperature
    if args.seed is not None:
        body["seed"] = args.seed
    if args.logprobs:
        body["logprobs"] = 1
    if args.model:
        body["model"] = args.model
    return _post(args.url, "/v1/completions", body, args.token, args.timeout)


# ------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rlhf",
        description="RLHF as microservices: run a service, or call a running one over REST.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Service settings also come from RLHF_* environment variables (flags win); see docs/services.md.",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    # in this order in `rlhf --help`
    _add_serve(sub)
    _add_score(sub)
    _add_logprobs(sub)
    _add_generate(sub)
    _add_up(sub)
    _add_report(sub)
    _add_eval(sub)
    return p


def _add_serve(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="run a service (gRPC + HTTP) until SIGTERM/SIGINT",
        description="Run one service: a gRPC server and an HTTP (REST) server in one process. "
        "GET /healthz, /readyz, /metrics and /docs on the HTTP port.",
    )
    s.add_argument("service", choices=SERVICES, help="which service")
    s.add_argument("--config", help="experiment config YAML (default $RLHF_CONFIG)")
    s.add_argument("--host", help="bind address (default $RLHF_HOST or 0.0.0.0)")
    s.add_argument("--grpc-port", type=int, help="gRPC port (default $RLHF_GRPC_PORT or 50051)")
    s.add_argument("--http-port", type=int, help="HTTP port (default $RLHF_HTTP_PORT or 8000)")
    s.add_argument("--device", help="override the config's device: auto, cpu, cuda, npu (default $RLHF_DEVICE)")
    s.add_argument("--log-level", help="debug, info, warning, error (default $RLHF_LOG_LEVEL or info)")
    s.set_defaults(func=_serve)


def _add_client(sub, name: str, help_: str, default_port: int) -> argparse.ArgumentParser:
    """A REST client command: the service's URL, token and timeout."""
    c = sub.add_parser(name, help=help_, description=help_ + "; prints the JSON answer (exit 1 on an error).")
    c.add_argument("--url", default=f"http://127.0.0.1:{default_port}", help="service base URL (default %(default)s)")
    c.add_argument("--token", default=os.environ.get("RLHF_API_TOKEN"), help="bearer token (default $RLHF_API_TOKEN)")
    c.add_argument("--timeout", type=float, default=60.0, help="seconds (default %(default)s)")
    return c


def _add_score(sub) -> None:
    c = _add_client(sub, "score", "score prompt/response pairs with a reward service (POST /v1/score)", 8001)
    c.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    c.add_argument("--response", action="append", required=True, help="response text, one per --prompt")
    c.add_argument("--label", action="append", help="reference answer, one per --prompt (rule scorers)")
    c.set_defaults(func=_score)


def _add_logprobs(sub) -> None:
    c = _add_client(sub, "logprobs", "per-token reference log-probs of responses (POST /v1/logprobs)", 8002)
    c.add_argument("--prompt-ids", action="append", type=_ids, required=True, help="comma-separated token ids")
    c.add_argument("--response-ids", action="append", type=_ids, required=True, help="comma-separated token ids")
    c.add_argument("--temperature", type=float, help="default: the service's configured temperature")
    c.set_defaults(func=_logprobs)


def _add_generate(sub) -> None:
    c = _add_client(sub, "generate", "generate completions with a rollout service (POST /v1/completions)", 8000)
    c.add_argument("prompt", nargs="+", help="prompt text(s)")
    c.add_argument("--max-tokens", type=int, default=16, help="new tokens per sample (default %(default)s)")
    c.add_argument("--n", type=int, default=1, help="samples per prompt (default %(default)s)")
    c.add_argument("--temperature", type=float, help="sampling temperature (default the service's)")
    c.add_argument("--seed", type=int, help="makes sampling reproducible")
    c.add_argument("--logprobs", action="store_true", help="return per-token sampling log-probs")
    c.add_argument("--model", help="model name (accepted for OpenAI compatibility)")
    c.set_defaults(func=_generate)


def _add_up(sub) -> None:
    u = sub.add_parser(
        "up",
        help="run a whole training run locally: redis-server, reward, reference, rollout and trainer processes",
        description="Start a private redis-server (unless RLHF_REDIS_URL is set), the reward and reference services, "
        "the rollout replica(s) and the trainer as local processes on free loopback ports; show one line per "
        "training step; stop everything when training is done (or on Ctrl-C) and draw the plots. "
        "Writes the run folder: metrics.jsonl, the plots, checkpoints, logs/.",
        epilog="examples:\n  rlhf up --config configs/demo.yaml\n"
        "  rlhf up --config-name demo training.train_iters=5 actor_rollout_ref.actor_rollout.do_sample=false\n"
        "  rlhf up --config-dir my/configs --config-name=ppo_trainer_llama32_1b critic.lr=9e-6",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    u.set_defaults(func=_up)
    launcher.add_arguments(u)


def _add_report(sub) -> None:
    r = sub.add_parser(
        "report",
        help="(re)draw a run's plots from its metrics.jsonl and print a summary",
        description="Draw reward.png, kl.png, losses.png, lengths.png, throughput.png (and dpo_rewards.png) in RUN_DIR "
        "from RUN_DIR/metrics.jsonl; print the "
        "first/last mean reward.",
    )
    r.add_argument("run_dir", help="the run folder (holds metrics.jsonl)")
    r.set_defaults(func=_report)


def _add_eval(sub) -> None:
    e = sub.add_parser(
        "eval",
        help="evaluate a running rollout service or a checkpoint on the config's eval section (eval/* metrics)",
        description="Generate the eval section's held-out prompts with a rollout service (gRPC Generate) and score "
        "them with a reward service (gRPC Score); report eval/reward_mean, eval/pass@k, eval/response_length_mean, "
        "eval/failed_fraction as the trainer's evaluation does: a row appended to OUT/metrics.jsonl, TensorBoard in "
        "OUT/tensorboard (with the plots extra installed), the row as JSON on stdout. Services not given by address "
        "(--checkpoint: a rollout replica; no --reward: the config's reward section) are started as child processes "
        "on free loopback ports and stopped at the end. Exit 0 when the evaluation ran, 1 when it failed, 2 for bad "
        "arguments. For lm-eval benchmarks, point lm-eval's local-completions model at a rollout's /v1/completions "
        "instead (docs/training.md).",
        epilog="examples:\n"
        "  rlhf eval --config configs/demo.yaml --rollout 127.0.0.1:50051 --reward 127.0.0.1:50052\n"
        "  rlhf eval --config configs/demo.yaml --checkpoint runs/demo-x/checkpoints --out runs/demo-x\n"
        "  rlhf eval --config my.yaml --checkpoint out/step_40 eval.path=data/heldout.jsonl eval.n=4 "
        "eval.temperature=1.0",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    eval_run.add_arguments(e)
    e.set_defaults(func=_eval)


def _up(args: argparse.Namespace) -> int:
    return launcher.main(args)


def _eval(args: argparse.Namespace) -> int:
    return eval_run.main(args)


def _report(args: argparse.Namespace) -> int:
    return report.main(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse takes one run of positionals: KEY=VALUE overrides of `rlhf up` given before and after options
    # arrive here in pieces
    if extra and args.command in ("up", "eval") and not any(e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
