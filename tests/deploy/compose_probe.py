"""The checks `make compose-check` (tests/deploy/compose_check.sh) makes on a stack that Docker Compose runs.

Standard library only: the host side runs on the machine's python3, and ``ledger`` runs inside the trainer image
(with the run's volume mounted), where it also imports ``rlhf`` to replay the prompt order the trainer issued jobs in.
Each subcommand prints what it found and exits 1 with the reason when a check fails.

  order EVENTS              `docker events` JSON lines: every service healthy (or, for `models`, exited 0) before
                            any service that depends on it started
  ready PORT...             GET /readyz answers 200 on each published port
  rest ROLLOUT REWARD REF   the REST calls of docs/services.md (generate, completions with logprobs, score, logprobs)
  status TRAINER            the trainer's GET /v1/status as JSON (step, policy_version)
  version ROLLOUT           the rollout's served weights version
  ledger RUN_DIR CONFIG     (in the trainer image) metrics.jsonl, checkpoints and the ledger: every issued job
                            trained exactly once
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

# service -> the services it waits for, and how (docker-compose.yml's depends_on)
DEPENDS = {
    "reward": {"redis": "healthy", "models": "exited0"},
    "reference": {"redis": "healthy", "models": "exited0"},
    "rollout": {"redis": "healthy", "reward": "healthy", "reference": "healthy"},
    "trainer": {"redis": "healthy", "rollout": "healthy"},
}


def fail(msg: str) -> None:
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def http(method: str, url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:  # not listening (yet), or reset
        return 0, f"{type(err).__name__}: {err}"
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def cmd_order(events_file: str) -> None:
    """The first time each service became healthy / exited 0 / started, from the daemon's event stream."""
    started: dict[str, float] = {}
    healthy: dict[str, float] = {}
    exited0: dict[str, float] = {}
    for line in Path(events_file).read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        attrs = ev.get("Actor", {}).get("Attributes", {})
        svc = attrs.get("com.docker.compose.service")
        if ev.get("Type") != "container" or not svc:
            continue
        t = ev.get("timeNano", 0) / 1e9
        status = ev.get("status") or ev.get("Action", "")
        if status == "start":
            started.setdefault(svc, t)
        elif status == "health_status: healthy":
            healthy.setdefault(svc, t)
        elif status == "die" and attrs.get("exitCode") == "0":
            exited0.setdefault(svc, t)
    t0 = min(started.values(), default=0)
    for svc, deps in DEPENDS.items():
        if svc not in started:
            fail(f"{svc} never started (events seen for: {sorted(started)})")
        for dep, how in deps.items():
            when = (healthy if how == "healthy" else exited0).get(dep)
            if when is None:
                fail(f"{svc} started but {dep} was never {how}")
            if when > started[svc]:
                fail(f"{svc} started at +{started[svc] - t0:.1f}s, before {dep} was {how} (+{when - t0:.1f}s)")
    # (the trainer is last: nothing waits for it, and a short run may end before Docker's first check of it;
    # the check reads its /readyz itself)
    order = sorted(
        [(t, f"{s} healthy") for s, t in healthy.items()] + [(t, f"{s} exited 0") for s, t in exited0.items()]
    )
    print("dependency order ok: " + ", ".join(f"{what} +{t - t0:.0f}s" for t, what in order))


def cmd_ready(*ports: str) -> None:
    for port in ports:
        status, body = http("GET", f"http://127.0.0.1:{port}/readyz", timeout=10)
        if status != 200:
            fail(f"GET 127.0.0.1:{port}/readyz answered {status}: {body}")
    print(f"/readyz 200 on {', '.join(ports)}")


def _expect(cond: bool, what: str, body) -> None:
    if not cond:
        fail(f"{what}: {json.dumps(body)[:600] if not isinstance(body, str) else body[:600]}")


def cmd_rest(rollout: str, reward: str, reference: str) -> None:
    """The calls of the Rollout, Reward and Reference sections of docs/services.md, through the published ports."""
    base = "http://127.0.0.1:"
    status, body = http(
        "POST",
        base + rollout + "/v1/completions",
        {
            "model": "tiny:policy",
            "prompt": "User: what is 1 plus 2?\nAssistant:",
            "max_tokens": 8,
            "seed": 3,
            "logprobs": 1,
            "return_token_ids": True,
        },
    )
    choice = body.get("choices", [{}])[0] if isinstance(body, dict) else {}
    _expect(status == 200 and len(choice.get("token_ids", [])) >= 1, "rollout /v1/completions", body)
    _expect(len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]), "completions logprobs", body)
    status, body = http(
        "POST",
        base + rollout + "/v1/generate",
        {"prompt_token_ids": [[2, 5, 6, 7]], "n": 2, "max_tokens": 4, "seed": 1},
    )
    ok = status == 200 and len(body["results"][0]["completions"]) == 2
    _expect(
        ok and all(len(c["logprobs"]) == len(c["token_ids"]) > 0 for c in body["results"][0]["completions"]),
        "rollout /v1/generate",
        body,
    )
    status, body = http("POST", base + rollout + "/v1/completions", {"prompt": [2, 5, 600]})
    _expect(status == 400 and body["error"]["type"] == "invalid_argument", "rollout rejects id 600 with 400", body)
    status, body = http(
        "POST", base + reward + "/v1/score", {"items": [{"prompt": "what is 1 plus 2?", "response": " 3"}]}
    )
    _expect(
        status == 200
        and body["results"][0] == {"score": 1.0, "status": "ok", "error": None, "components": {"char_fraction": 1.0}},
        "reward /v1/score",
        body,
    )
    status, body = http(
        "POST", base + reference + "/v1/logprobs", {"items": [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9]}]}
    )
    lps = body["results"][0]["logprobs"] if status == 200 else []
    _expect(len(lps) == 2 and all(lp < 0 for lp in lps), "reference /v1/logprobs", body)
    status, body = http(
        "POST", base + reference + "/v1/logprobs", {"items": [{"prompt_ids": [5, 6, 7], "response_ids": [8, 600]}]}
    )
    _expect(status == 400, "reference rejects id 600 with 400", body)
    print("REST ok: rollout completions/generate (+400 on a bad id), reward score, reference logprobs (+400)")


def cmd_status(trainer: str) -> None:
    status, body = http("GET", f"http://127.0.0.1:{trainer}/v1/status", timeout=10)
    if status != 200:
        fail(f"trainer /v1/status answered {status}: {body}")
    print(
        json.dumps(
            {
                "step": int(body.get("step", 0)),
                "policy_version": int(body.get("policyVersion", body.get("policy_version", 0))),
            }
        )
    )


def cmd_version(rollout: str) -> None:
    status, body = http("GET", f"http://127.0.0.1:{rollout}/v1/weights/version", timeout=10)
    if status != 200:
        fail(f"rollout /v1/weights/version answered {status}: {body}")
    print(int(body["version"]))


def cmd_ledger(run_dir: str, config: str) -> None:
    """In the trainer image: the run finished, its files are in the volume, and the ledger holds every job once."""
    from rlhf.config import load_config  # noqa: PLC0415 - rlhf: only the ledger command, in the trainer image (the host side is stdlib only)
    from rlhf.data import PromptCursor, load_prompts  # noqa: PLC0415 - rlhf: only the ledger command, in the trainer image (the host side is stdlib only)
    from services.trainer.checkpoint import latest_checkpoint  # noqa: PLC0415 - rlhf: only the ledger command, in the trainer image (the host side is stdlib only)

    cfg = load_config(config)
    run = Path(run_dir)
    iters, batch = cfg.training.train_iters, cfg.training.global_batch_size
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [int(m["step"]) for m in metrics]
    if steps != list(range(1, iters + 1)):
        fail(f"metrics.jsonl steps are not 1..{iters} once each: {steps[:5]}...{steps[-5:]} ({len(steps)} lines)")
    ckpt = latest_checkpoint(run / "checkpoints")
    if ckpt is None or ckpt.name != f"step_{iters}":
        fail(f"the latest complete checkpoint is {ckpt}, not step_{iters}")
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*") if p.name[5:].isdigit())
    state = json.loads((ckpt / "state.json").read_text())

    lines = [json.loads(x) for x in (run / "trained_jobs.jsonl").read_text().splitlines() if x.strip()]
    trained = [j for line in lines for j in line["job_ids"]]
    dropped = [j for line in lines for j in line.get("dropped_stale", [])]
    twice = len(trained) - len(set(trained))
    if twice:
        fail(f"{twice} job(s) trained twice in the ledger")
    # The checkpoint's own windows (the last few) are the ledger's last lines.
    for st, ids in state["trained_job_windows"]:
        in_ledger = {j for line in lines if line["step"] == st for j in line["job_ids"] + line.get("dropped_stale", [])}
        if set(ids) != in_ledger:
            fail(f"checkpoint {ckpt.name}'s window at step {st} ({len(ids)} jobs) differs from the ledger's")

    # Replay the trainer's seeded prompt order up to the checkpoint's cursor: the jobs it issued, in order.
    records = load_prompts(cfg.data)
    cursor = PromptCursor(records, cfg.training.seed, cfg.data.shuffle)
    issued = []
    while (cursor.epoch, cursor.offset) != (state["data"]["epoch"], state["data"]["offset"]):
        epoch, record = cursor.next()
        issued.append(f"{state['run_id']}-e{epoch}-i{record.index}")
        if len(issued) > 100 * iters * batch:
            fail(f"the checkpoint's data cursor {state['data']} is not reachable from the start")
    unknown = (set(trained) | set(dropped)) - set(issued)
    if unknown:
        fail(f"{len(unknown)} ledger job(s) were never issued: {sorted(unknown)[:3]}")
    # Every issued job was trained once or dropped as stale, except those still in flight when the run ended: at
    # most the admission window, and only the newest issued.
    window = (cfg.training.max_staleness + 1) * batch
    untrained = [j for j in issued if j not in set(trained) | set(dropped)]
    if len(untrained) > window or (untrained and issued.index(untrained[0]) < len(issued) - window):
        fail(f"{len(untrained)} issued job(s) never trained, not only the last {window} in flight: {untrained[:3]}")
    if len(trained) != iters * batch:
        fail(f"{len(trained)} jobs trained in {iters} steps of {batch}")
    print(
        json.dumps(
            {
                "steps": len(steps),
                "checkpoints": saved,
                "last": ckpt.name,
                "policy_version": state["policy_version"],
                "jobs_issued": len(issued),
                "jobs_trained": len(trained),
                "jobs_trained_twice": twice,
                "jobs_dropped_stale": len(dropped),
                "jobs_in_flight_at_end": len(untrained),
                "final_reward_mean": metrics[-1].get("reward/mean"),
            }
        )
    )


if __name__ == "__main__":
    commands = {
        "order": cmd_order,
        "ready": cmd_ready,
        "rest": cmd_rest,
        "status": cmd_status,
        "version": cmd_version,
        "ledger": cmd_ledger,
    }
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    commands[sys.argv[1]](*sys.argv[2:])
