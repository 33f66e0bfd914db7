"""The learning tasks (rlhf.learning_tasks): held-out problems never reach training or the warm start, the data
sources, the lcs_ratio rule, and the warm start's cache."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from rlhf.config import ConfigError
from rlhf.data import _read_rows
from rlhf.learning_tasks import TASKS, build_warm, demonstration
from rlhf.tiny import WARM_TASKS
from services.reward.rules import lcs_ratio


@pytest.mark.parametrize("name", sorted(TASKS))
def test_heldout_problems_never_appear_in_training_or_the_warm_start(name):
    task = TASKS[name]
    heldout = {r["prompt"] for r in task.rows("heldout")}
    assert len(heldout) == task.heldout_size
    train = {r["prompt"] for r in task.rows("train", n=2000, seed=3)}
    rng = random.Random(0)
    warm = {demonstration(task, rng)[0] for _ in range(2000)}
    assert not heldout & train and not heldout & warm
    assert all(task.is_heldout(p) for p in heldout) and not any(task.is_heldout(p) for p in train | warm)


def test_the_builtin_sources_are_the_splits_and_an_unknown_one_names_the_known():
    assert _read_rows("builtin:addition/heldout") == TASKS["addition"].rows("heldout")
    rows = _read_rows("builtin:reverse_words")
    assert rows == TASKS["reverse_words"].rows("train")
    prompt, label = rows[0]["prompt"], rows[0]["label"]
    assert prompt.startswith("reverse: ") and label.split() == prompt.split()[1:][::-1]
    with pytest.raises(ConfigError, match="builtin:reverse_words"):
        _read_rows("builtin:reverse_words/test")


def test_lcs_ratio_gives_partial_credit_and_one_only_for_an_exact_answer():
    assert lcs_ratio("", " sun dog cat ", "sun dog cat") == 1.0
    assert lcs_ratio("", "sun cat", "sun dog cat") == pytest.approx(2 * 7 / (7 + 11))
    assert lcs_ratio("", "ab", "ba") == pytest.approx(0.5)
    assert lcs_ratio("", "xyz", "abc") == 0.0


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_demonstrator_is_right_as_often_as_its_task_says_and_slips_the_same_way(name):
    task = TASKS[name]
    rng, check = random.Random(7), random.Random(7)
    right, distinct = 0, 0
    for _ in range(4000):
        prompt, answer = demonstration(task, rng)
        expected_prompt, correct = task.problem(check, heldout=False)
        check.random()
        slipped = task.slip(expected_prompt, correct)
        assert prompt == expected_prompt and answer in (correct, slipped)
        if slipped != correct:  # a palindrome of words reverses to itself
            distinct += 1
            right += answer == correct
    assert distinct > 3000 and right / distinct == pytest.approx(task.warm_right, abs=0.03)


def test_the_warm_start_is_built_once_and_rebuilt_when_forced(tmp_path, monkeypatch):
    monkeypatch.setitem(TASKS, "reverse_words", replace(TASKS["reverse_words"], warm_steps=3))  # the cache, not the SFT
    out = build_warm(tmp_path, "reverse_words")
    weights = out / "model.safetensors"
    first = weights.stat().st_mtime_ns
    assert build_warm(tmp_path, "reverse_words") == out and weights.stat().st_mtime_ns == first
    assert (tmp_path / "warm-reverse_words" / "warm.json").exists()
    build_warm(tmp_path, "reverse_words", force=True)
    assert weights.stat().st_mtime_ns != first


def test_the_tiny_references_name_exactly_the_tasks():
    assert set(WARM_TASKS) == set(TASKS)  # rlhf.tiny names them without importing the tasks
