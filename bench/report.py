"""Run the benchmarks and write docs/benchmarks.md from their JSON lines.

::

    python -m bench.report --run                       # every benchmark, then docs/benchmarks.md (`make bench`)
    python -m bench.report --run --only queue,serving  # rerun some; the report keeps the others' last results
    python -m bench.report RESULTS_DIR                 # only render the JSON files a run left in RESULTS_DIR

Each benchmark runs as its own process (``python -m bench.<name>``, stdout = its one JSON line, stderr = its log);
the JSON and the log are kept under ``.cache/bench/results/``. A benchmark that fails is reported as failed (with
the end of its log) and the others still run; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCHES = (
    "queue",
    "weight_sync",
    "recv_slices",
    "weight_sync_delta",
    "weight_sync_lora",
    "serving",
    "engines",
    "vllm_parity",
    "padding_free",
    "critic_threads",
    "pipeline",
    "long_tail",
    "trainer_scale",
)
RESULTS = REPO / ".cache" / "bench" / "results"
TITLES = {
    "queue": "Queue: experience records through rlhf.transport vs raw Redis",
    "weight_sync": "Weight sync: a 104M-parameter policy to a rollout replica vs a raw loopback copy",
    "recv_slices": "Weight sync: the data plane's receive beside a thread that holds the GIL, 4 MiB vs 16 MiB slices",
    "weight_sync_delta": "Weight sync: delta pushes vs full pushes after optimizer steps at two learning rates",
    "weight_sync_lora": "Weight sync: a LoRA actor's adapter-only push to vLLM vs the merged model",
    "serving": "Serving: REST and gRPC vs the engine in-process",
    "engines": "Rollout engines: generated tokens/s, vllm vs hf",
    "vllm_parity": "vLLM parity: rlhf serve rollout vs vLLM's own OpenAI server, streamed completions",
    "padding_free": "Padding-free passes: the trainer's PPO step and the reference forward, padded vs packed",
    "critic_threads": "Critic threads: the PPO step with the critic beside the actor on half the threads each",
    "pipeline": "Pipeline: training samples/s vs TRL 1.12 and vs the compute bound",
    "long_tail": "Long tail: a GRPO ring on long-tailed response lengths, sync vs async, partial rollouts off vs on",
    "trainer_scale": "Trainer scale: per-rank training state and step time, FSDP2 world size 2 vs 1",
}


def run(names: list[str], out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, Any] = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else {}
    for name in names:
        print(f"== python -m bench.{name}", flush=True)
        t0 = time.monotonic()
        with open(out / f"{name}.json", "wb") as fo, open(out / f"{name}.log", "wb") as fe:
            code = subprocess.call([sys.executable, "-m", f"bench.{name}"], cwd=REPO, stdout=fo, stderr=fe)
        seconds = time.monotonic() - t0
        runs[name] = {"exit": code, "seconds": round(seconds, 1)}
        status = "ok" if code == 0 else f"FAILED (exit {code}; log .cache/bench/results/{name}.log)"
        print(f"   {status} in {seconds:.0f}s", flush=True)
    (out / "run.json").write_text(json.dumps(runs, indent=2))
    return runs


def load(out: Path, names: list[str]) -> dict[str, dict | None]:
    res: dict[str, dict | None] = {}
    for name in names:
        path = out / f"{name}.json"
        res[name] = None
        if path.exists():
            lines = [x for x in path.read_text().splitlines() if x.strip().startswith("{")]
            if lines:
                res[name] = json.loads(lines[-1])
    return res


# ------------------------------------------------------------------------------------------------- rendering


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return ", ".join(fmt(x) for x in v)
    return str(v)


def flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict):
        rows = []
        for k, v in d.items():
            rows += flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return rows
    return [(prefix, d)]


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return out


def _parts(v: dict, on_cpu: bool) -> str | None:
    """bench.vllm_parity: a server's ms per request by part (main thread / other threads / child processes), on a
    CPU or runnable and waiting for one."""
    parts = v.get("server_cpu_ms_per_request_by_part", {})
    keys = [k for k in parts if k.endswith("_cpu_wait") != on_cpu]
    return " / ".join(fmt(parts[k]) for k in keys) or None


def figures_md(name: str, r: dict) -> list[str]:
    f = r["figures"]
    if name == "serving":
        rows = []
        for svc, per in f.items():
            for conc, ways in per.items():
                for way, v in ways.items():
                    rows.append(
                        [
                            svc,
                            conc[1:],
                            way,
                            v["p50_ms"],
                            v["p99_ms"],
                            v["req_per_s"],
                            v.get("p50_overhead_ms"),
                            v.get("caller_cpu_ms_per_req"),
                            v.get("service_cpu_ms_per_req"),
                            v.get("cpu_over_in_process_ms_per_req"),
                        ]
                    )
        return table(
            [
                "service",
                "concurrency",
                "way in",
                "p50 ms",
                "p99 ms",
                "requests/s",
                "p50 over in-process ms",
                "caller CPU ms/request",
                "service CPU ms/request",
                "CPU over in-process ms/request",
            ],
            rows,
        )
    if name == "weight_sync_delta":  # per learning rate, per optimizer step: what a delta push sent and took
        rows = []
        for lr, steps in f.items():
            for st in steps:
                d, full = st["delta"], st["full"]
                rows.append(
                    [
                        lr.removeprefix("lr_"),
                        st["step"],
                        st["changed_fraction"],
                        d["bytes"],
                        full["bytes"],
                        round(d["bytes"] / full["bytes"], 3),
                        d["encode_s"],
                        d["push_s"],
                        full["push_s"],
                        d["replica_stage_s"],
                        full["replica_stage_s"],
                    ]
                )
        return table(
            [
                "lr",
                "step",
                "changed fraction",
                "delta bytes",
                "full bytes",
                "delta / full bytes",
                "delta encode s",
                "delta push s",
                "full push s",
                "replica staging s, delta",
                "replica staging s, full",
            ],
            rows,
        )
    if name == "engines":
        rows = []
        for size, per in f["generated_tokens_per_s"].items():
            for batch, v in per.items():
                rows.append(
                    [size, batch.split("_")[1], v["vllm"], v["hf"], r["ratio"].get(f"{size}/{batch}/vllm_vs_hf")]
                )
        return table(["model", "batch", "vllm tokens/s", "hf tokens/s", "vllm / hf"], rows)
    if name == "vllm_parity":
        rows = []
        for conc, sides in f.items():
            for who, v in sides.items():
                vs = r["ratio"].get(conc, {}) if who == "rlhf" else {}
                rows.append(
                    [
                        conc[1:],
                        "rlhf serve rollout" if who == "rlhf" else "vLLM api_server",
                        v["output_tokens_per_s"],
                        vs.get("output_tokens_per_s"),
                        v["ttft_p50_ms"],
                        v["ttft_p99_ms"],
                        vs.get("ttft_p50"),
                        v["tpot_p50_ms"],
                        v["tpot_p99_ms"],
                        v["server_cpu_ms_per_request"],
                        _parts(v, on_cpu=True),
                        _parts(v, on_cpu=False),
                        v["requests"],
                        v["failed"],
                    ]
                )
        return table(
            [
                "concurrency",
                "server",
                "output tokens/s",
                "/ vLLM",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "TTFT p50 / vLLM",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "server CPU ms/request",
                "of which main thread / other threads / child processes",
                "waiting for a CPU ms/request, same parts",
                "requests",
                "failed",
            ],
            rows,
        )
    if name == "long_tail":
        rows = []
        for setting, v in f.items():
            mode, partial = setting.split("/")
            sync = f.get(f"sync/{partial}", {}).get("samples_per_s")
            rows.append(
                [
                    "sync (max_staleness 0)" if mode == "sync" else "async (max_staleness 1)",
                    partial,
                    v["samples_per_s"],
                    round(v["samples_per_s"] / sync, 2) if sync else None,
                    v["generated_tokens_per_s"],
                    f"{v['idle_fraction'] * 100:.1f}%",
                    v["push_wait_s_per_step"],
                    f"{v['push_wait_fraction'] * 100:.1f}%",
                    v["push_pause_s_per_step"],
                    f"{v['push_stall_fraction'] * 100:.1f}%" if "push_stall_fraction" in v else None,
                    v["response_length_mean"],
                    v["staleness_mean"],
                    v["step_seconds"],
                ]
            )
        return table(
            [
                "ring",
                "partial rollouts",
                "samples/s",
                "vs sync",
                "generated tokens/s",
                "replica idle",
                "push wait s/step",
                "push wait / step",
                "push pause s/step",
                "held by pushes",
                "mean response tokens",
                "staleness",
                "measured step times s",
            ],
            rows,
        )
    if name == "pipeline":
        rows = []
        labels = {
            "trl": "TRL 1.12",
            "bound": "compute bound (each phase at its best thread count, core-seconds over the cores)",
            "sync": "ours, max_staleness 0",
            "async": "ours, max_staleness 1",
        }
        for size, per in f["samples_per_s"].items():
            for algo, runs in per.items():
                for which in ("trl", "bound", "sync", "async"):
                    v = runs.get(which)
                    if v is None:  # a result from before the compute bound was measured
                        continue
                    vs_trl = 1.0 if which == "trl" else r["ratio"].get(f"{size}/{algo}/{which}_vs_trl")
                    vs_bound = r["ratio"].get(f"{size}/{algo}/{which}_step_vs_bound")
                    rows.append(
                        [
                            size,
                            algo,
                            labels[which],
                            v["samples_per_s"],
                            vs_trl,
                            vs_bound,
                            v["step_seconds"],
                            v.get("staleness_mean"),
                            v.get("torch_threads"),
                        ]
                    )
        out = table(
            [
                "model",
                "algorithm",
                "run",
                "samples/s",
                "vs TRL",
                "step time / bound",
                "measured step times s",
                "staleness",
                "torch threads",
            ],
            rows,
        )
        roof = [
            [
                size,
                algo,
                x["update_gflop"],
                x["update_s"],
                x["update_gflop_per_s"],
                "; ".join(f"{k}: {v}" for k, v in x["mm_gflop_per_s"].items()),
                x["update_vs_mm_rate"],
            ]
            for size, per in f["samples_per_s"].items()
            for algo, runs in per.items()
            for x in runs.get("bound", {}).get("roofline", [])
        ]
        if roof:  # bench._bound.roofline: how near the fp32 matmul rate of this machine the update runs
            out += ["", "The compute bound's update against this machine's matmul rate (one row per run):", ""]
            out += table(
                [
                    "model",
                    "algorithm",
                    "update GFLOP",
                    "update s (median)",
                    "update GFLOP/s",
                    "torch.mm GFLOP/s",
                    "update / best mm rate",
                ],
                roof,
            )
        return out
    return table(["figure", "value"], [[k, v] for k, v in flatten(f)])


def target_rows(name: str, r: dict | None) -> list[list[Any]]:
    """The Targets table's rows of one benchmark."""
    if r is None:
        return [[f"bench.{name}", "did not produce a result (see its log)", "-", "-", "**failed**"]]
    return [[f"bench.{name}", t["figure"], t["value"], t["target"], t["met"]] for t in r["targets"]]


def section(name: str, r: dict | None, run_info: dict | None) -> list[str]:
    """One benchmark's section: its heading, command, settings, figures, targets and notes."""
    lines = [f"## {TITLES.get(name, name)}", ""]
    if r is None:
        lines.append(
            f"`python -m bench.{name}` produced no result" + (f" (exit {run_info['exit']})" if run_info else "") + "."
        )
        log = RESULTS / f"{name}.log"
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-15:]
            lines += ["", "```", *tail, "```"]
        return lines
    doc = ast.get_docstring(ast.parse((REPO / "bench" / f"{name}.py").read_text())) or ""
    intro = doc.strip().split("\n\n", 1)
    lines += [
        f"Command: `{r.get('command') or f'python -m bench.{name}'}` ({r.get('seconds')} s; load average at start "
        f"{fmt([round(x, 1) for x in r['machine'].get('load_average', [])])}).",
        "",
    ]
    if len(intro) > 1:
        lines += [intro[1].strip(), ""]
    lines += ["Settings:", ""]
    lines += [f"- {k}: {fmt(v)}" for k, v in flatten(r["settings"])]
    lines += ["", *figures_md(name, r), ""]
    if name not in ("pipeline", "engines", "serving", "vllm_parity"):
        lines += ["Ratios: " + "; ".join(f"{k} {fmt(v)}" for k, v in flatten(r["ratio"])), ""]
    for t in r["targets"]:
        lines.append(
            f"- target: {t['figure']}: {fmt(t['value'])} (target {t['target']}): {'met' if t['met'] else '**missed**'}"
        )
    lines += [f"- note: {n}" for n in r["notes"]]
    return lines


def splice(md: str, name: str, r: dict | None) -> str:
    """``md`` (a docs/benchmarks.md) with one benchmark's section and Targets rows replaced by ``r``'s (added where
    it has none yet: the section at the end, the rows at the end of the Targets table); the rest kept as it is."""
    lines = md.rstrip("\n").split("\n")
    prefix = f"| bench.{name} |"
    lines = [x for x in lines if not x.startswith(prefix)]
    start = lines.index("## Targets")
    end = start + 1
    while end < len(lines) and not lines[end].startswith("|"):
        end += 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    new_rows = table(["benchmark", "figure", "value", "target", "met"], target_rows(name, r))[2:]
    lines[end:end] = new_rows
    heading = f"## {TITLES.get(name, name)}"
    body = section(name, r, None)
    if heading in lines:
        a = lines.index(heading)
        b = next((i for i in range(a + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        lines[a:b] = [*body, ""] if b < len(lines) else body
    else:
        lines += ["", *body]
    return "\n".join(lines) + "\n"


def render(results: dict[str, dict | None], runs: dict[str, Any] | None, names: list[str]) -> str:
    machine = next((r["machine"] for r in results.values() if r), {})
    total = sum(v["seconds"] for v in runs.values()) if runs else None
    try:
        commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python -m bench.report --run`): each benchmark is a script under `bench/` that",
        "prints one JSON line, measuring ours and its baseline interleaved in the same run so the ratios hold on a",
        "shared machine. Run one alone with `python -m bench.<name>`. Nothing here is a timed test.",
        "",
        f"- generated: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}, commit `{commit}`",
        "- command: `make bench`"
        + (f" (the benchmarks' run times add up to {total:.0f} s)" if total is not None else ""),
        f"- machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {machine.get('memory_gib', '?')} "
        f"GiB, {machine.get('os', '?')}, Python {machine.get('python', '?')}, torch {machine.get('torch', '?')}, "
        f"OMP_NUM_THREADS={machine.get('omp_num_threads', '?')} per service process, OMP_WAIT_POLICY="
        f"{machine.get('omp_wait_policy', '?')}; each benchmark's settings.resources gives the cores and threads of "
        "each side",
        "- the machine is shared: each benchmark records the load average it started under (below); absolute",
        "  figures move with it, the interleaved ratios much less.",
        "",
        "## Targets",
        "",
    ]
    rows = [row for name in names for row in target_rows(name, results.get(name))]
    lines += table(["benchmark", "figure", "value", "target", "met"], rows)
    for name in names:
        lines += ["", *section(name, results.get(name), (runs or {}).get(name))]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="?", default=str(RESULTS), help="folder of <name>.json files")
    p.add_argument("--run", action="store_true", help="run the benchmarks first")
    p.add_argument("--only", help="comma-separated benchmark names (default: all)")
    p.add_argument("--out", default=str(REPO / "docs" / "benchmarks.md"), help="the Markdown file to write")
    p.add_argument(
        "--splice",
        action="store_true",
        help="replace only the --only benchmarks' sections and Targets rows in the existing --out file",
    )
    args = p.parse_args(argv)
    names = [n.strip() for n in args.only.split(",")] if args.only else list(BENCHES)
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        print(f"unknown benchmark(s): {', '.join(unknown)}; choose from {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    out = Path(args.results)
    if args.run:
        run(names, out)
    # the report covers every benchmark with a result in the folder (--only reruns some, keeps the others' results)
    runs = json.loads((out / "run.json").read_text()) if (out / "run.json").exists() else None
    results = load(out, list(BENCHES))
    md = Path(args.out)
    md.parent.mkdir(parents=True, exist_ok=True)
    if args.splice:  # a benchmark rerun alone, the others' figures kept as the file has them
        text = md.read_text()
        for name in names:
            text = splice(text, name, results.get(name))
        md.write_text(text)
    else:
        md.write_text(render(results, runs, list(BENCHES)))
    total = f" (benchmarks took {sum(v['seconds'] for v in runs.values()):.0f} s)" if runs else ""
    print(f"wrote {md}{total}")
    failed = [n for n in names if results.get(n) is None]
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    raise SystemExit(main())
