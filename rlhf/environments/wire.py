"""Chat messages between their dict shape (OpenAI's, what environments see) and ``rlhf.v1.ChatMessage``: used by the
environment service and its client, so both ends agree. Keys other than role, content, name and tool_call_id (an
assistant's ``tool_calls``, a content that is not text) travel as one JSON object in ``extra_json``."""

from __future__ import annotations

import json
from typing import Any

from rlhf.environments.base import Message
from rlhf.v1 import environment_pb2

_PLAIN = ("role", "content", "name", "tool_call_id")


def message_to_proto(m: Message) -> environment_pb2.ChatMessage:
    """A dict message -> ChatMessage; TypeError / ValueError when it is not a message (no string role, keys or
    values that are not JSON)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
        raise TypeError(f"a message is a dict with a string role, not {type(m).__name__} {str(m)[:80]!r}")
    out = environment_pb2.ChatMessage(role=m["role"])
    extra: dict[str, Any] = {k: v for k, v in m.items() if k not in _PLAIN}
    content = m.get("content")
    if isinstance(content, str):
        out.content = content
    elif "content" in m:  # None (an assistant turn of tool calls only) or a list of parts: kept as they are
        extra["content"] = content
    for key in ("name", "tool_call_id"):
        v = m.get(key)
        if isinstance(v, str):
            setattr(out, key, v)
        elif v is not None:
            raise TypeError(f"message {key} must be a string, not {type(v).__name__}")
    if extra:
        out.extra_json = json.dumps(extra, ensure_ascii=False)
    return out


def message_from_proto(p: environment_pb2.ChatMessage) -> Message:
    m: Message = {"role": p.role, "content": p.content}
    if p.HasField("name"):
        m["name"] = p.name
    if p.HasField("tool_call_id"):
        m["tool_call_id"] = p.tool_call_id
    if p.extra_json:
        extra = json.loads(p.extra_json)
        if not isinstance(extra, dict):
            raise ValueError("ChatMessage.extra_json must be a JSON object")
        m.update(extra)
    return m
