"""verifiers 0.4 environments through the adapter (rlhf.environments.adapters.verifiers_env), with the real library:
tasksets written in this folder (rlhf_vf_quiz: a scripted user over several turns, rewards, a metric, a @stop hook,
a rubric that raises; rlhf_vf_tools: an MCP toolset), driven by scripted model turns. Runs in .venv-envs."""

from __future__ import annotations

import pytest

from rlhf.config import parse_config
from rlhf.data import load_prompts
from rlhf.environments import registry
from rlhf.environments.adapters.verifiers_env import VerifiersEnvironment, main, verifiers_rows
from rlhf.environments.base import EnvironmentFailure

QUIZ = "verifiers:rlhf_vf_quiz"


@pytest.fixture(scope="module")
def quiz_rows():
    return verifiers_rows("rlhf_vf_quiz")


def start(spec: str, row: dict, **options):
    env = registry.make(spec, {"timeout_s": 30, **options})
    return env, env.reset(row["messages"], row["label"], row["info"], None)


def job_prompt(row: dict) -> list[dict]:
    """The prompt a rollout replica sends for a data row (its system, then its text as the user message)."""
    return ([{"role": "system", "content": row["system"]}] if row["system"] else []) + [
        {"role": "user", "content": row["prompt"]}
    ]


def test_rows_are_the_tasksets_prompts_and_answers(quiz_rows):
    assert len(quiz_rows) == 3
    assert quiz_rows[0] == {
        "prompt": "What is the capital of France?",
        "system": "Answer with one word.",
        "messages": [
            {"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        "label": "Paris",
        "info": {"verifiers_idx": "0"},
    }
    assert [r["label"] for r in quiz_rows] == ["Paris", "42", "2"]


def test_a_job_without_the_index_finds_its_task_by_prompt(quiz_rows):
    env = registry.make(QUIZ, {})
    try:
        opening = env.reset(job_prompt(quiz_rows[1]), "42", {}, None)
        assert opening.messages == quiz_rows[1]["messages"] and opening.info == {"verifiers_task": "1"}
        assert env.step("42").done
    finally:
        env.close()
    env = registry.make(QUIZ, {})
    with pytest.raises(EnvironmentFailure, match="no task"):
        env.reset([{"role": "user", "content": "What is 6 * 8?"}], None, {}, None)


def test_a_multi_turn_episode_is_scored_by_the_rubric(quiz_rows):
    env, opening = start(QUIZ, quiz_rows[0])
    try:
        assert opening.messages == quiz_rows[0]["messages"] and opening.tools == []
        out = env.step("Lyon")
        # the env's scripted user answers a wrong reply with a hint; nothing is scored before the end
        assert out.messages == [{"role": "user", "content": "Not quite. Hint: it starts with P"}]
        assert not out.done and out.reward == 0.0
        out = env.step("Paris")
        assert out.done and out.messages == []
        # correct (weight 1) + quick (weight 0.5, 1 / 2 turns): the rubric's own weighted sum
        assert out.reward == pytest.approx(1.0 + 0.5 * 0.5)
        assert out.metrics["reward_correct"] == 1.0 and out.metrics["reward_quick"] == 0.5
        assert out.metrics["turns"] == 2.0
        with pytest.raises(EnvironmentFailure, match="outside an episode"):
            env.step("again")
    finally:
        env.close()


def test_the_scripted_user_ends_the_episode_after_three_wrong_answers(quiz_rows):
    env, _ = start(QUIZ, quiz_rows[1])
    try:
        assert not env.step("41").done
        assert not env.step("43").done
        out = env.step("44")
        assert out.done and out.reward == pytest.approx(0.5 / 3)
    finally:
        env.close()


def test_a_stop_hook_ends_the_episode_before_the_next_model_turn(quiz_rows):
    env, _ = start(QUIZ, quiz_rows[0])
    try:
        out = env.step("I give up")
        assert out.done and out.info["stop_condition"] == "gave_up"
        assert out.reward == pytest.approx(0.5)  # wrong (0) + quick after one turn (0.5 * 1)
    finally:
        env.close()


def test_max_turns_caps_the_seat(quiz_rows):
    env, _ = start(QUIZ, quiz_rows[0], max_turns=1)
    try:
        out = env.step("Lyon")
        assert out.done and out.info["stop_condition"] == "max_turns"
    finally:
        env.close()


def test_a_rubric_that_raises_fails_the_episode_instead_of_scoring_zero(quiz_rows):
    env, _ = start(QUIZ, quiz_rows[2])
    try:
        with pytest.raises(EnvironmentFailure, match="cannot score"):
            env.step("2")
    finally:
        env.close()


def test_tool_calls_run_the_tasksets_mcp_tools():
    (row,) = verifiers_rows("rlhf_vf_tools")
    env, opening = start("verifiers:rlhf_vf_tools", row)
    try:
        assert opening.messages == [{"role": "user", "content": "What is 1234 + 4321? Use the tool."}]
        assert row["prompt"] == "What is 1234 + 4321? Use the tool." and row["system"] is None
        (tool,) = opening.tools
        assert tool["function"]["name"] == "calc_add"
        assert tool["function"]["parameters"]["required"] == ["a", "b"]
        out = env.step('<tool_call>{"name": "calc_add", "arguments": {"a": 1234, "b": 4321}}</tool_call>')
        assert not out.done
        ((msg),) = out.messages
        assert (msg["role"], msg["name"], msg["content"]) == ("tool", "calc_add", "5555")
        assert msg["tool_call_id"].startswith("call_")
        out = env.step('<tool_call>{"name": "calc_mul", "arguments": {"a": 1}}</tool_call>')
        assert out.messages[0]["content"].startswith("error") and out.metrics["tool_errors"] == 1.0
        out = env.step("5555")
        assert out.done and out.reward == 1.0
        assert out.metrics["used_tool"] == 2.0 and out.metrics["tool_calls"] == 2.0
        assert out.metrics["additions"] == 1.0  # the tool's write to the rollout state reached the task's hook
    finally:
        env.close()


def test_bad_specs_and_jobs_are_refused(quiz_rows):
    with pytest.raises(registry.UnknownEnvironment):
        registry.resolve("verifiers:")
    with pytest.raises(registry.UnknownEnvironment, match="options"):
        registry.check(QUIZ, {"no_such_option": 1})
    env = VerifiersEnvironment("rlhf_vf_quiz")
    with pytest.raises(EnvironmentFailure, match="no task 9"):
        env.reset([], None, {"verifiers_idx": "9"}, None)
    env = VerifiersEnvironment("rlhf_vf_no_such_module")
    with pytest.raises(EnvironmentFailure, match="cannot load"):
        env.reset([], None, {"verifiers_idx": "0"}, None)


def test_rows_exported_as_a_data_set_find_their_tasks(tmp_path, quiz_rows):
    """The rows as JSON lines are a data.path file the trainer reads (no verifiers there); the prompt a replica makes
    of such a record finds the task it came from."""
    out = tmp_path / "quiz.jsonl"
    assert main(["rlhf_vf_quiz", "--out", str(out)]) == 0
    cfg = parse_config({"data": {"path": str(out), "map_keys": {"system": "system"}}})
    records = load_prompts(cfg.data)
    want = [(row["prompt"], row["system"], row["label"]) for row in quiz_rows]
    assert [(r.prompt, r.system, r.label) for r in records] == want
    env = registry.make(QUIZ, {})
    try:
        prompt = [{"role": "system", "content": records[1].system}, {"role": "user", "content": records[1].prompt}]
        assert env.reset(prompt, records[1].label, {}, None).info == {"verifiers_task": "1"}
    finally:
        env.close()
