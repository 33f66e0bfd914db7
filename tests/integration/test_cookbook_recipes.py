"""tinker-cookbook 0.6.1's own recipes, unmodified, against ``rlhf serve training`` on loopback.

The recipe runs as a client process from the cookbook's environment (``.venv-cookbook``, which ``make test-cookbook``
builds), in a working directory that holds everything it would fetch from the Hub, under the Hub's names:

- ``Qwen/Qwen3-8B-Base/``: the tiny policy (weights and tokenizer); for ``rl_loop``, the tiny policy warm-started
  on the recipe's answer form (tests/support/cookbook_gsm8k.py). The recipe picks its renderer by that name
  (``role_colon``) and loads the tokenizer from that folder; the service, started in the same directory with
  ``actor_rollout.load: Qwen/Qwen3-8B-Base``, loads the weights from it and answers to that name.
- ``HuggingFaceH4/no_robots/`` and ``openai/gsm8k/`` (config ``main``): a few hundred generated rows in the Hub data
  sets' formats, which ``datasets.load_dataset`` finds there before the Hub (offline). The gsm8k rows ask "How many
  r's are in <word>?", as the recipe's own example does.

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
from tests.support.cookbook_gsm8k import EXAMPLE, SUFFIX, build_boxed_policy, gsm8k_rows, prompt_tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOKEN = "tml-cookbook-0123456789"
MODEL = "Qwen/Qwen3-8B-Base"  # the cookbook's table: a base model, renderer role_colon
RL_STEPS, RL_BATCH = 20, 8
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


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _workdir(work: Path, policy: Path) -> Path:
    """``work`` holding ``policy`` under the Hub's name, the no_robots rows and the gsm8k rows."""
    shutil.copytree(policy, work / MODEL)
    _write_jsonl(work / "HuggingFaceH4" / "no_robots" / "data" / "train.jsonl", _no_robots_rows(320, seed=0))
    gsm8k = work / "openai" / "gsm8k"
    _write_jsonl(gsm8k / "main" / "train.jsonl", gsm8k_rows(RL_STEPS * RL_BATCH, seed=1))
    # the Hub card's YAML that names the config `main` and its train split
    (gsm8k / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
    )
    return work


def _service(workdir: Path):
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
    return proc


@pytest.fixture(scope="module")
def cookbook_python() -> Path:
    if not COOKBOOK_PY.exists():
        pytest.skip(f"no cookbook environment at {COOKBOOK_PY}: `make setup` builds .venv-cookbook")
    return COOKBOOK_PY


@pytest.fixture(scope="module")
def workdir(cookbook_python, tmp_path_factory, tiny_models) -> Path:
    """sl_loop's: the tiny policy as built."""
    return _workdir(tmp_path_factory.mktemp("cookbook"), tiny_models.policy)


@pytest.fixture(scope="module")
def service(workdir):
    proc = _service(workdir)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def rl_workdir(cookbook_python, tmp_path_factory, tiny_models) -> Path:
    """rl_loop's: the tiny policy warm-started on the recipe's answer form (tests/support/cookbook_gsm8k.py)."""
    return _workdir(tmp_path_factory.mktemp("cookbook-rl"), build_boxed_policy(tiny_models))


@pytest.fixture(scope="module")
def rl_service(rl_workdir):
    proc = _service(rl_workdir)
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


def test_rl_loop_raises_its_reward(rl_workdir, rl_service):
    """rl_loop with ``loss_fn=importance_sampling`` (its default ``stable_reinforce`` is refused): it samples groups
    from the service's sampling clients, centres their rewards and trains on them; its own ``reward/total`` rises."""
    log_path = rl_workdir / "runs" / "rl-loop"
    out = _recipe(
        rl_workdir,
        rl_service,
        "rl_loop",
        [
            f"model_name={MODEL}",
            f"log_path={log_path}",
            "loss_fn=importance_sampling",
            f"batch_size={RL_BATCH}",
            "group_size=8",
            "lora_rank=8",
            "max_tokens=16",
            # 3e-3 rose faster (+0.31 in 3 runs) but once fell to 0 reward after 2 steps and never recovered
            "learning_rate=2e-3",
        ],
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [r for r in _metrics(log_path) if "reward/total" in r]
    assert [r["step"] for r in rows] == list(range(RL_STEPS)), rows
    reward = [r["reward/total"] for r in rows]
    # the steps that trained: a group with unequal rewards (else the recipe skips the update: no optimiser metric)
    trained = [r["step"] for r in rows if "grad_norm:mean" in r]
    first, last = sum(reward[:5]) / 5, sum(reward[-5:]) / 5
    print(json.dumps({"rl_loop_reward_total": [round(x, 4) for x in reward], "trained": trained}), file=sys.stderr)
    # the recipe's own metric, the mean reward of its groups: the last 5 steps' against the first 5 steps'
    assert last > first + 0.1, reward  # measured, 3 runs: 0.184 -> 0.450, 0.241 -> 0.463, 0.253 -> 0.441
    assert len(trained) >= RL_STEPS - 2, trained
    ckpts = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    assert ckpts[-1]["name"] == "final" and ckpts[-1]["sampler_path"].startswith("tinker://"), ckpts


def test_warm_start_prompt_is_the_recipes(rl_workdir, cookbook_python):
    """The warm start's prompt is token for token what rl_loop's role_colon renderer builds for the same question
    (its strawberry example, its suffix): if the recipe's prompt changed, the warm start would teach another one."""
    from transformers import AutoTokenizer  # noqa: PLC0415 - heavy, this test only

    rows = gsm8k_rows(3, seed=5)
    script = (
        "import json, sys\n"
        "from tinker_cookbook import renderers\n"
        "from tinker_cookbook.tokenizer_utils import get_tokenizer\n"
        f"r = renderers.get_renderer('role_colon', get_tokenizer({MODEL!r}))\n"
        f"suffix, example = {SUFFIX!r}, {EXAMPLE[1][1]!r}\n"
        "for q in json.loads(sys.argv[1]):\n"
        f"    convo = [{{'role': 'user', 'content': {EXAMPLE[0][1]!r}}}, {{'role': 'assistant', 'content': example}},\n"
        "             {'role': 'user', 'content': q + suffix}]\n"
        "    print(json.dumps(r.build_generation_prompt(convo).to_ints()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    questions = json.dumps([r["question"] for r in rows])
    out = subprocess.run(
        [str(cookbook_python), "-c", script, questions], cwd=rl_workdir, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-4000:]
    tok = AutoTokenizer.from_pretrained(rl_workdir / MODEL)
    theirs = [json.loads(line) for line in out.stdout.splitlines()]
    assert theirs == [prompt_tokens(tok, r["question"]) for r in rows]
