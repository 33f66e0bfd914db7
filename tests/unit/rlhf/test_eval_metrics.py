"""The eval section: metrics arithmetic, its config rules, and how its rows show (progress line, report)."""

import asyncio
import json
import math
import socket
import time

import pytest

from rlhf.config import ConfigError, parse_config
from rlhf.data import load_eval_prompts, load_prompts
from rlhf.evaluation import eval_metrics, pass_at_k
from rlhf.models import load_tokenizer
from rlhf.serving.settings import ServiceSettings
from rlhf.tracking import Tracker
from services import report
from services.progress import format_progress
from services.report import EVAL_PLOT, family, summary
from services.trainer.evaluate import Evaluator


def test_eval_metrics_fixed_batch():
    # 3 prompts x 2 samples; None: a failed score (an error, not a reward of 0)
    rewards = [[1.0, 0.0], [0.5, None], [1.0, 1.0]]
    lengths = [[4, 6], [10, 2], [3, 3]]
    m = eval_metrics(rewards, lengths, pass_threshold=1.0)
    assert m["eval/reward_mean"] == pytest.approx(3.5 / 5)
    assert m["eval/pass@2"] == pytest.approx(2 / 3)  # prompts 0 and 2 have a passing sample
    assert m["eval/pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)  # c / n per prompt
    assert m["eval/response_length_mean"] == pytest.approx(28 / 6)
    assert m["eval/failed_fraction"] == pytest.approx(1 / 6)
    assert m["eval/prompts"] == 3 and m["eval/samples"] == 6
    assert eval_metrics(rewards, lengths, pass_threshold=0.5)["eval/pass@2"] == 1.0
    greedy = eval_metrics([[1.0], [0.2]], [[1], [3]], 1.0)
    assert greedy["eval/pass@1"] == 0.5 and "eval/pass@2" not in greedy
    assert math.isnan(eval_metrics([[None]], [[1]], 1.0)["eval/reward_mean"])


def test_pass_at_k_unbiased():
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 3, 3) == 1.0
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


@pytest.mark.parametrize(
    ("section", "names"),
    [
        ({"interval": -1}, "eval.interval"),
        ({"interval": 2}, "eval.path"),
        ({"path": "builtin:arithmetic"}, "eval.path is set but eval.interval is 0"),
        ({"interval": 1, "path": "builtin:arithmetic", "n": 4}, "eval.n"),
        ({"interval": 1, "path": "builtin:arithmetic", "generator_seed": 3}, "eval.generator_seed"),
        ({"interval": 1, "path": "x.jsonl", "map_keys": {"text": "t"}}, "eval.map_keys.text"),
        ({"interval": 1, "path": "x.jsonl", "map_keys": {"max_tokens": "n"}}, "eval.map_keys.max_tokens"),
    ],
)
def test_eval_config_rules(section, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        parse_config({"eval": section})


def test_eval_config_loads_through_the_data_loader():
    cfg = parse_config({"eval": {"interval": 2, "path": "builtin:arithmetic", "max_samples": 3, "n": 2,
                                 "temperature": 1.0}})  # fmt: skip

    assert len(load_prompts(cfg.eval.data_config(cfg.data))) == 3


def test_eval_rows_in_progress_and_report():
    row = {"step": 4, "eval/reward_mean": 0.5, "eval/pass@1": 0.25, "eval/failed_fraction": 0.0}
    line = format_progress(row, 10)
    assert line.startswith("step 4/10") and "eval" in line and "pass@1 0.250" in line
    assert family("eval/pass@1") == EVAL_PLOT and family("eval/response_length_mean") == "lengths.png"
    text = summary([{"step": 4, "reward/mean": 0.1}, row])
    assert "steps: 1" in text and "eval at step 4" in text


def test_eval_path_errors_name_the_eval_field(tmp_path):
    cfg = parse_config({"eval": {"interval": 1, "path": str(tmp_path / "missing.jsonl")}})
    with pytest.raises(ConfigError, match=r"^eval\.path"):
        load_eval_prompts(cfg)


def test_eval_section_reads_its_source_as_data_does(tmp_path):
    """eval.map_keys / system / max_samples go through the data loader; generator options and seed make the
    held-out prompts (another seed, other prompts)."""
    rows = tmp_path / "held_out.jsonl"
    rows.write_text("\n".join(json.dumps({"q": f"{i} + 1 =", "a": str(i + 1)}) for i in range(5)))
    cfg = parse_config(
        {
            "data": {"system": "be brief"},
            "eval": {"interval": 1, "path": str(rows), "map_keys": {"prompt": "q", "label": "a"}, "max_samples": 2},
        }
    )
    recs = load_eval_prompts(cfg)
    assert [(r.prompt, r.label, r.system) for r in recs] == [("0 + 1 =", "1", "be brief"), ("1 + 1 =", "2", "be brief")]
    cfg = parse_config({"eval": {"interval": 1, "path": str(rows), "map_keys": {"prompt": "q"}, "system": "eval"}})
    assert {r.system for r in load_eval_prompts(cfg)} == {"eval"}

    def gym(**kw):
        section = {"interval": 1, "path": "reasoning_gym:chain_sum", "generator_size": 4, **kw}
        return [r.prompt for r in load_eval_prompts(parse_config({"eval": section}))]

    assert len(gym()) == 4 and gym() == gym() and gym() != gym(generator_seed=7)
    opts = {"min_terms": 5, "max_terms": 5, "min_digits": 1, "max_digits": 1}
    assert all(p.count("+") + p.count("-") >= 4 for p in gym(generator_options=opts))


def test_an_evaluation_past_its_deadline_is_a_failed_row(tmp_path, tiny_models):
    """eval.timeout_s bounds a Generate call: a replica that never answers makes a failed row (never rewards of 0),
    written on the step, and eval.max_new_tokens is the request's budget."""
    silent = socket.socket()  # accepts TCP, never speaks HTTP/2
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    addr = f"127.0.0.1:{silent.getsockname()[1]}"
    cfg = parse_config(
        {
            "actor_rollout_ref": {"actor_rollout": {"load": str(tiny_models.policy)}},
            "eval": {"interval": 2, "path": "builtin:arithmetic", "max_samples": 2, "timeout_s": 0.5,
                     "max_new_tokens": 3},
        }
    )  # fmt: skip

    tracker = Tracker(tmp_path, "t", {})
    settings = ServiceSettings(rollout_addrs=[addr], reward_addr=addr)
    ev = Evaluator(cfg, settings, load_tokenizer(tiny_models.policy), tmp_path, tracker)
    assert ev.params.max_tokens == 3 and ev.due(2) and not ev.due(3) and ev.due(cfg.training.train_iters)

    async def run():
        ev.schedule(2, None)
        await ev.wait()

    t0 = time.monotonic()
    try:
        asyncio.run(run())
    finally:
        tracker.close()
        silent.close()
    assert time.monotonic() - t0 < 5
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 2 and row["eval/failed_fraction"] == 1.0 and "eval/reward_mean" not in row


def test_report_draws_the_eval_plot(tmp_path):
    rows = [{"step": s, "reward/mean": 0.1 * s, "response_length/mean": 5.0} for s in (1, 2, 3)]
    rows += [{"step": s, "eval/reward_mean": 0.2 * s, "eval/pass@1": 0.1 * s} for s in (2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    names = [p.name for p in report.draw(tmp_path)]
    assert EVAL_PLOT in names and (tmp_path / EVAL_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.series(rows, "eval/pass@1") == ([2.0, 3.0], [0.2, pytest.approx(0.3)])
