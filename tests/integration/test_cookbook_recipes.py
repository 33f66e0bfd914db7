"""tinker-cookbook 0.6.1's own recipes, unmodified, against ``rlhf serve training`` on loopback.

The recipe runs as a client process from the cookbook's environment (``.venv-cookbook``, built by ``make setup``), in
a working directory that holds everything it would fetch from the Hub, under the Hub's names:

- ``Qwen/Qwen3-8B-Base/``: the tiny policy (weights and tokenizer). The recipe picks its renderer by that name
  (``role_colon``) and loads the tokenizer from that folder; the service, started in the same directory with
  ``actor_rollout.load: Qwen/Qwen3-8B-Base``, loads the weights from it and answers to that name.
- ``HuggingFaceH4/no_robots/`` and ``openai/gsm8k/`` (config ``main``): a few hundred generated rows in the Hub data
  sets' formats, which ``datasets.load_dataset`` finds there before the Hub (offline).

Sizes (batch, rank, lengths, learning rate, steps) go on the recipe's own command line. docs/tinker.md lists what is
swapped."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.procs import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "tml-cookbook-0123456789"
MODEL = "Qwen/Qwen3-8B-Base"  # the cookbook's table: a base model, renderer role_colon
COOKBOOK_PY = Path(os.environ.get("RLHF_COOKBOOK_PYTHON", REPO / ".venv-cookbook" / "bin" / "python"))


def _no_robots_rows(n: int, seed: int) -> list[dict]:
    """Rows shaped like HuggingFaceH4/no_robots (prompt, prompt_id, messages, category), with a pattern to learn."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        prompt = f"what is {a} plus {b}?"
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": f"The sum of {a} and {b} is {a + b}."},
        ]
        rows.append({"prompt": prompt, "prompt_id": f"{i:08x}", "messages": messages, "category": "Open QA"})
    return rows


def _gsm8k_rows(n: int, seed: int) -> list[dict]:
    """Rows shaped like openai/gsm8k ``main`` (question, answer ending ``#### <number>``)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        rows.append(
            {"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
        )
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_models) -> Path:
    if not COOKBOOK_PY.exists():
        pytest.skip(f"no cookbook environment at {COOKBOOK_PY}: `make setup` builds .venv-cookbook")
    work = tmp_path_factory.mktemp("cookbook")
    shutil.copytree(tiny_models.policy, work / MODEL)
    _write_jsonl(work / "HuggingFaceH4" / "no_robots" / "data" / "train.jsonl", _no_robots_rows(320, seed=0))
    gsm8k = work / "openai" / "gsm8k"
    _write_jsonl(gsm8k / "main" / "train.jsonl", _gsm8k_rows(64, seed=1))
    # the Hub card's YAML that names the config `main` and its train split
    (gsm8k / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
    )
    return work


@pytest.fixture(scope="module")
def service(workdir):
    from tests.integration._procs import ServiceProc, write_config  # noqa: PLC0415 - test helper

    config = {
        "run_id": "cookbook",
        "training": {"save": str(workdir / "checkpoints"), "device": "cpu"},
        # relative: resolved in the service's working directory, as the recipe resolves its tokenizer
        "actor_rollout_ref": {"actor_rollout": {"load": MODEL}},
    }
    cfg = write_config(workdir / "training.yaml", config)
    proc = ServiceProc("training", cfg, workdir / "logs", env={"RLHF_API_TOKEN": TOKEN}, cwd=workdir)
    proc.start(timeout=120)
    yield proc
    proc.stop()


def _recipe(workdir: Path, service, name: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "TINKER_BASE_URL", "TINKER_API_KEY", "RLHF_CACHE_DIR")
    }
    env.update(
        TINKER_API_KEY=TOKEN,
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(workdir / "hf-home"),  # the data sets' cache: this test's, not the user's
        TOKENIZERS_PARALLELISM="false",
    )
    argv = [str(COOKBOOK_PY), "-m", f"tinker_cookbook.recipes.{name}", f"base_url={service.http_url}", *args]
    return subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def _metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_sl_loop_lowers_its_nll(workdir, service):
    log_path = workdir / "runs" / "sl-loop"
    steps = 20  # 320 rows / batch 16
    out = _recipe(
        workdir,
        service,
        "sl_loop",
        [
            f"model_name={MODEL}",
            f"log_path={log_path}",
            "batch_size=16",
            "lora_rank=8",
            "learning_rate=1e-2",
            "max_length=128",
            "save_every=10",
        ],
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Using renderer: role_colon" in out.stderr + out.stdout
    rows = [r for r in _metrics(log_path) if "train_mean_nll" in r]
    assert [r["step"] for r in rows] == list(range(steps)), rows
    nll = [r["train_mean_nll"] for r in rows]
    # the recipe's own metric: the first steps' mean NLL per token against the last steps'
    first, last = sum(nll[:3]) / 3, sum(nll[-3:]) / 3
    assert last < 0.6 * first, nll  # measured: 5.81 -> 2.59
    assert all(r["num_sequences"] == 16 for r in rows)
    # its checkpoints: a state at step 10, then the final state and sampler weights, all tinker:// paths it can resume
    ckpts = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert [c["name"] for c in ckpts] == ["000010", "final"], ckpts
    assert ckpts[-1]["state_path"].startswith("tinker://") and ckpts[-1]["sampler_path"].startswith("tinker://")
    print(json.dumps({"sl_loop_train_mean_nll": [round(x, 4) for x in nll]}), file=sys.stderr)


def test_rl_loop_runs_to_sampling(workdir, service):
    """rl_loop with ``loss_fn=importance_sampling`` (its default ``stable_reinforce`` is refused) gets its tokenizer,
    renderer, data set and training client, then stops at its first sampling call, which the service does not build
    yet: the refusal says so, at request time, instead of a hang or a retry loop."""
    log_path = workdir / "runs" / "rl-loop"
    out = _recipe(
        workdir,
        service,
        "rl_loop",
        [
            f"model_name={MODEL}",
            f"log_path={log_path}",
            "loss_fn=importance_sampling",
            "batch_size=8",
            "group_size=4",
            "lora_rank=8",
            "max_tokens=16",
            "learning_rate=1e-3",
        ],
        timeout=300,
    )
    assert out.returncode != 0
    refusal = [line for line in out.stderr.splitlines() if "is not built" in line]
    assert refusal and "save_weights_and_get_sampling_client" in refusal[-1], out.stderr[-4000:]
    print(refusal[-1], file=sys.stderr)
