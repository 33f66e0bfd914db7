"""rlhf.tool_calls: hermes blocks -> OpenAI tool calls (content outside them, malformed blocks kept as text, never
raising), and OpenAI messages prepared for chat templates."""

from __future__ import annotations

import json
import random

import pytest

from rlhf.config import ConfigError, parse_config
from rlhf.tiny import TinySpec, build_tokenizer
from rlhf.tool_calls import TOOL_CALL_PARSERS, parse_tool_calls, template_messages


def _block(name: str, args: object) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def _shape(call: dict) -> tuple[str, dict]:
    assert set(call) == {"id", "type", "function"} and call["type"] == "function"
    assert call["id"].startswith("call_") and len(call["id"]) > 5
    assert set(call["function"]) == {"name", "arguments"} and isinstance(call["function"]["arguments"], str)
    return call["function"]["name"], json.loads(call["function"]["arguments"])


def test_one_call_and_no_content():
    content, calls = parse_tool_calls(" " + _block("get_weather", {"city": "Paris", "days": 2}) + "\n")
    assert content is None
    assert [_shape(c) for c in calls] == [("get_weather", {"city": "Paris", "days": 2})]


def test_content_around_several_calls_and_unique_ids():
    text = "Let me look.\n" + _block("a", {}) + "\n" + _block("b", {"x": [1, "é"]}) + "\ndone"
    content, calls = parse_tool_calls(text)
    assert content == "Let me look.\n\n\ndone"
    assert [_shape(c) for c in calls] == [("a", {}), ("b", {"x": [1, "é"]})]
    assert calls[0]["id"] != calls[1]["id"]
    assert "é" in calls[1]["function"]["arguments"]  # not \\u-escaped


def test_text_without_calls_is_unchanged():
    for text in ("", "  plain answer  ", "a < b and <tool_cal", "</tool_call> stray close"):
        assert parse_tool_calls(text) == ((text or None), [])


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "{bad"}</tool_call>',
        '<tool_call>["f"]</tool_call>',
        "<tool_call></tool_call>",
        '<tool_call>{"name": "f", "arguments": {}} trailing',  # open, and not one JSON object
    ],
)
def test_malformed_blocks_stay_in_the_content(bad):
    assert parse_tool_calls(bad) == (bad, [])
    # beside a good block: the good one is a call, the bad one stays as it was written
    content, calls = parse_tool_calls(bad + " " + _block("ok", {"k": 1}))
    assert content == bad and [_shape(c) for c in calls] == [("ok", {"k": 1})]


def test_arguments_as_string_missing_and_open_last_block():
    _, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert [_shape(c) for c in calls] == [("f", {"a": 1})]
    _, calls = parse_tool_calls('<tool_call>{"name": "g"}</tool_call>')
    assert [_shape(c) for c in calls] == [("g", {})]
    # the model stopped before </tool_call>: a whole JSON object still counts (vLLM's hermes parser does too)
    content, calls = parse_tool_calls('hi <tool_call>{"name": "h", "arguments": {"q": 2}}')
    assert content == "hi" and [_shape(c) for c in calls] == [("h", {"q": 2})]


def test_never_raises_on_noise():
    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"f"', '"arguments"', ",", "x", " ", "\\", '"']
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        content, calls = parse_tool_calls(text)
        assert content is None or isinstance(content, str)
        assert all(_shape(c) for c in calls)


def test_unknown_parser():
    assert TOOL_CALL_PARSERS == ("hermes",)
    with pytest.raises(ValueError, match="unknown tool call parser 'mistral'.*hermes"):
        parse_tool_calls("x", parser="mistral")


def test_template_messages_turns_arguments_into_objects():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    bad = {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "not json"}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call, bad]}]
    out = template_messages(msgs)
    assert out[0] == msgs[0]
    assert out[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert out[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert call["function"]["arguments"] == '{"a": 1}'  # the input is not modified


def test_tiny_chat_template_renders_tools_and_tool_turns():
    tok = build_tokenizer(TinySpec())
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    text = tok.apply_chat_template(template_messages(msgs), tools=[tool], add_generation_prompt=True, tokenize=False)
    assert text == (
        'Tools: {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}\n'
        "User: hi\n"
        'Assistant: <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call></s>\n'
        "Tool: 42\n"
        "Assistant:"
    )
    # what the model writes between "Assistant:" and EOS parses back to the same call
    written = text.split("Assistant:")[1].split("</s>")[0]
    _, calls = parse_tool_calls(written)
    assert [_shape(c) for c in calls] == [("f", {"a": 1})]
    # without tools the template is as before
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert tok.apply_chat_template(plain, tokenize=False) == "User: hi\nAssistant: hello</s>\n"


def test_the_config_names_the_parser():
    cfg = parse_config({})
    assert cfg.actor_rollout_ref.actor_rollout.tool_call_parser == "hermes"
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor_rollout\.tool_call_parser.*'hermes'"):
        parse_config({"actor_rollout_ref": {"actor_rollout": {"tool_call_parser": "mistral"}}})
