"""Tool calls in generated text: parsing a model's output into OpenAI-shaped ``tool_calls`` (the parser is named as
vLLM's ``--tool-call-parser`` names it) and preparing OpenAI-shaped messages and tools for a chat template.

Pure functions (no model, no I/O): the rollout service's chat endpoint uses them, and so can an agent loop or an
environment that has the text only. ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks, as Hermes-2-Pro and Qwen2.5 emit them. What counts as a call: docs/services.md#rollout (tool calling).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

TOOL_CALL_PARSERS = ("hermes",)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` + 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def check_parser(parser: str) -> str:
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {parser!r}: use one of {', '.join(TOOL_CALL_PARSERS)}")
    return parser


def _hermes_call(body: str) -> dict[str, Any] | None:
    """One block's body -> an OpenAI tool call, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string already
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except ValueError:
            return None
        text = args
    elif isinstance(args, dict):
        text = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": text}}


def _parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    kept: list[str] = []  # the text outside the blocks that parsed, malformed blocks included
    at = 0
    while True:
        start = text.find(HERMES_OPEN, at)
        if start < 0:
            kept.append(text[at:])
            break
        body_at = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_at)
        body = text[body_at:] if end < 0 else text[body_at:end]
        call = _hermes_call(body.strip())
        if call is None:
            # not a call: keep the opening tag as text and look for the next block after it
            kept.append(text[at:body_at])
            at = body_at
            continue
        calls.append(call)
        kept.append(text[at:start])
        if end < 0:
            break
        at = end + len(HERMES_CLOSE)
    content = "".join(kept)
    if calls:
        # the whitespace around blocks is layout, not a message
        content = content.strip()
    return (content or None), calls


def parse_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[dict[str, Any]]]:
    """``text`` -> (the content outside tool-call blocks, or None when nothing is left; the OpenAI tool calls
    ``{"id": "call_...", "type": "function", "function": {"name": str, "arguments": json-string}}``). Without a
    tool call the content is ``text`` unchanged. Never raises on text; an unknown ``parser`` is a ValueError."""
    check_parser(parser)
    return _parse_hermes(text)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> what Hugging Face chat templates expect: an assistant's ``tool_calls[].function.arguments``
    as an object, not a JSON string (templates such as Qwen2.5's write ``arguments | tojson``; vLLM converts them the
    same way). Arguments that are not a JSON object stay as they are. The input is not modified."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        parsed = json.loads(args)
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        fn["arguments"] = parsed
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
