"""Verifiable tasks without downloads: reasoning-gym generators as ``data.path: reasoning_gym:<task>`` with each
task's own verifier as the ``reasoning_gym`` rule, and ``math_verify`` against the hand-written ``math_answer``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rlhf.config import ConfigError, DataConfig, ScorerConfig, load_config, parse_config
from rlhf.data import load_prompts
from services.reward import rules
from services.reward.scorers import INVALID_INPUT, Failure, Item, RuleScorer

reasoning_gym = pytest.importorskip("reasoning_gym")
pytest.importorskip("math_verify")

CHAIN_SUM = {"path": "reasoning_gym:chain_sum", "generator_size": 6, "generator_seed": 7}


def test_a_reasoning_gym_task_is_a_seeded_data_source_whose_labels_recover_the_entry():
    cfg = DataConfig(**CHAIN_SUM, generator_options={"min_terms": 2, "max_terms": 2}, system="Answer in tags.")
    records = load_prompts(cfg)
    want = reasoning_gym.create_dataset("chain_sum", seed=7, size=6, min_terms=2, max_terms=2)
    assert [r.prompt for r in records] == [e["question"] for e in want]
    assert all(r.system == "Answer in tags." for r in records)
    assert load_prompts(cfg) == records  # the same seed, the same prompts
    other = load_prompts(DataConfig(**{**CHAIN_SUM, "generator_seed": 8}))
    assert [r.prompt for r in other] != [r.prompt for r in records]
    label = json.loads(records[2].label)
    assert (label["reasoning_gym"], label["index"], label["answer"]) == ("chain_sum", 2, want[2]["answer"])
    assert len(load_prompts(DataConfig(**CHAIN_SUM, max_samples=2))) == 2


def test_the_reasoning_gym_rule_is_the_tasks_own_verifier():
    (r,) = load_prompts(DataConfig(**CHAIN_SUM, max_samples=1))
    answer = json.loads(r.label)["answer"]
    assert rules.reasoning_gym(r.prompt, f"thinking... <answer>{answer}</answer>", r.label) == 1.0
    assert rules.reasoning_gym(r.prompt, f"<answer>{int(answer) + 1}</answer>", r.label) == 0.0
    assert rules.reasoning_gym(r.prompt, answer, r.label) == 0.0  # no <answer> tag
    assert rules.reasoning_gym(r.prompt, f" {answer}\n", r.label, extract="none") == 1.0
    assert rules.reasoning_gym(r.prompt, f"so \\boxed{{{answer}}}", r.label, extract="boxed") == 1.0
    # a task whose verifier gives partial credit (a word sorted almost right) keeps it
    (w,) = load_prompts(DataConfig(path="reasoning_gym:word_sorting", generator_size=1, generator_seed=1))
    right = json.loads(w.label)["answer"]
    assert rules.reasoning_gym(w.prompt, f"<answer>{right}</answer>", w.label) == 1.0


def test_the_rule_scorer_reports_a_foreign_label_as_invalid_input_and_checks_its_kwargs():
    scorer = RuleScorer(ScorerConfig(type="rule", name="reasoning_gym"), "rg")
    (r,) = load_prompts(DataConfig(**CHAIN_SUM, max_samples=1))
    items = [
        Item(r.prompt, f"<answer>{json.loads(r.label)['answer']}</answer>", r.label),
        Item("what is 2 plus 2?", "4", "4"),
    ]
    got = asyncio.run(scorer.score(items))
    assert got[0] == 1.0
    assert isinstance(got[1], Failure) and got[1].status == INVALID_INPUT and "reasoning_gym" in got[1].message
    with pytest.raises(ValueError, match="extract must be answer, boxed or none"):
        RuleScorer(ScorerConfig(type="rule", name="reasoning_gym", kwargs={"extract": "last"}), "rg")


def test_generator_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="data.generator_options: reasoning-gym task 'chain_sum' refuses"):
        load_prompts(DataConfig(**CHAIN_SUM, generator_options={"no_such_option": 1}))
    with pytest.raises(ConfigError, match="data.generator_options: .*set data.generator_seed"):
        load_prompts(DataConfig(**CHAIN_SUM, generator_options={"seed": 1}))
    with pytest.raises(ConfigError, match="data.map_keys.prompt: reasoning_gym:chain_sum is a reasoning-gym generator"):
        load_prompts(DataConfig(**CHAIN_SUM, map_keys={"prompt": "question"}))
    with pytest.raises(ConfigError, match="unknown reasoning-gym task 'chian_sum'; did you mean chain_sum"):
        load_prompts(DataConfig(path="reasoning_gym:chian_sum"))
    with pytest.raises(ConfigError, match="data.generator_seed: only used with data.path: reasoning_gym:<task>"):
        parse_config({"data": {"path": "prompts.jsonl", "generator_seed": 3}})


# response, label, math_answer, math_verify: where the two agree, and where math-verify is the more exact
ANSWERS = [
    ("The answer is \\boxed{42}.", "42", 1.0, 1.0),
    ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("1,234 apples", "1234", 1.0, 1.0),
    ("\\boxed{41}", "42", 0.0, 0.0),
    ("no answer here", "42", 0.0, 0.0),
    ("\\boxed{1+x}", "x+1", 0.0, 1.0),  # the same expression, written the other way round
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 0.0, 1.0),  # the same set
    ("\\boxed{0.1}", "10\\%", 0.0, 1.0),  # a percentage
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 0.0, 1.0),  # a simplified radical
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0.0, 1.0),  # a LaTeX label: math_answer takes its last number (2)
    ("\\boxed{x^2-1}", "(x-1)(x+1)", 0.0, 1.0),  # expanded vs factored
    ("\\boxed{x+2}", "x+1", 0.0, 0.0),
]


@pytest.mark.parametrize(("response", "label", "by_math_answer", "by_math_verify"), ANSWERS)
def test_math_verify_against_math_answer(response, label, by_math_answer, by_math_verify):
    assert rules.math_answer("", response, label) == by_math_answer
    assert rules.math_verify("", response, label) == by_math_verify


def test_math_verify_is_a_rule_scorer_that_needs_a_label():
    scorer = RuleScorer(ScorerConfig(type="rule", name="math_verify"), "mv")
    got = asyncio.run(scorer.score([Item("q", "\\boxed{1+x}", "x+1"), Item("q", "3", None)]))
    assert got[0] == 1.0 and isinstance(got[1], Failure) and got[1].status == INVALID_INPUT


def test_the_grpo_reasoning_gym_example_config_loads_and_its_reward_verifies_its_prompts():
    cfg = load_config(Path(__file__).parents[4] / "configs" / "grpo-reasoning-gym.yaml")
    assert cfg.training.stage == "ray_grpo" and cfg.data.path == "reasoning_gym:chain_sum"
    records = load_prompts(cfg.data)
    assert len(records) == cfg.data.generator_size
    (rg,) = [RuleScorer(s, s.name) for s in cfg.reward.scorers if s.name == "reasoning_gym"]
    r = records[3]
    right, wrong = json.loads(r.label)["answer"], "not a number"
    assert asyncio.run(rg.score([Item(r.prompt, right, r.label), Item(r.prompt, wrong, r.label)])) == [1.0, 0.0]
