"""``python -m bench.device_check``: the command line (the driver, a dry run, or one of the child processes the
driver and the push phase start)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import bench.device_check
from bench.device_check.common import DEADLINE_S, NEEDS_MODEL, PHASES
from bench.device_check.driver import Driver, dry_run, write_json
from bench.device_check.push import push_row_main
from bench.device_check.worker import worker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=bench.device_check.__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run every phase that can run on the CPU, at a small scale")
    ap.add_argument("--only", help=f"comma-separated phases to run ({','.join(PHASES)}); the rest are skipped")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and import what each phase needs")
    ap.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", "/tmp/rlhf-device-check")),
        help="where device_check.json and device_check.log go (default $OUT)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/rlhf-device-check"),
        help="models, checkpoints, the ring's run and the phases' logs",
    )
    ap.add_argument("--deadline-s", type=float, help="no phase starts after this many seconds (default 450, --cpu 900)")
    ap.add_argument("--worker", choices=PHASES, help=argparse.SUPPRESS)
    ap.add_argument("--budget-s", type=float, default=600, help=argparse.SUPPRESS)
    ap.add_argument("--push-row", help=argparse.SUPPRESS)  # TRANSPORT: one push phase row in a process of its own
    ap.add_argument("--addr", help=argparse.SUPPRESS)
    ap.add_argument("--version", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--before", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.push_row:
        return push_row_main(args.work, args.addr, args.push_row, args.version, args.before)
    if args.worker:
        return worker(args.worker, args.work, args.budget_s)
    selected = list(PHASES)
    if args.only:
        selected = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(selected) - set(PHASES))
        if unknown:
            ap.error(f"--only: unknown phase(s) {', '.join(unknown)}; known: {', '.join(PHASES)}")
        # the phases that use the built model need the model phase
        if set(selected) & NEEDS_MODEL and "model" not in selected:
            selected.append("model")
        selected = [s for s in PHASES if s in selected]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        result, rc = dry_run(args, selected)
    else:
        deadline_s = args.deadline_s if args.deadline_s is not None else DEADLINE_S["cpu" if args.cpu else "cuda"]
        if args.work.resolve() == args.out.resolve():
            ap.error("--work must differ from --out: the models and checkpoints must not come back with the JSON")
        result, rc = Driver(args, selected, deadline_s).run()
    result["exit"] = rc
    write_json(args.out, result)
    # one JSON line on stdout: what passed, failed and was skipped (the figures are in device_check.json)
    brief = {k: result[k] for k in ("mode", "summary", "seconds", "exit") if k in result}
    if args.dry_run:
        brief["phases"] = {n: r["status"] for n, r in result["phases"].items()}
    print(json.dumps({"name": "device_check", **brief}, separators=(",", ":")), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
