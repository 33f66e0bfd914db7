"""An OpenEnv environment server (``openenv-core`` 0.3) as an :class:`~rlhf.environments.base.Environment`:
``openenv:<http-url>`` in the environment registry (``openenv:http://127.0.0.1:8000``).

One episode is one session of the server through openenv-core's own client; the model sees the observation and the
action's JSON schema and answers with the action, or, for an MCP environment, with tool calls. An answer that is not
an action is the model's mistake (a message, reward 0, ``action_errors``); the server failing is an
:class:`EnvironmentFailure`. Design (the session, the answer's forms, MCP environments, options):
docs/environments.md#library-environments-verifiers-and-openenv.
"""

from __future__ import annotations

import contextlib
import functools
import json
from typing import Any

from rlhf.environments.base import Environment, EnvironmentFailure, Message, Opening, Outcome
from rlhf.tool_calls import check_parser, parse_tool_calls

DEFAULT_TIMEOUT_S = 60.0
# The action schema titles of OpenEnv's MCP actions (verifiers' OpenEnv taskset tells them apart the same way).
MCP_ACTIONS = {"Action", "CallToolAction", "ListToolsAction"}


class InvalidAction(ValueError):
    """The model's text is not an action of this environment."""


def parse_action(text: str, action_schema: dict[str, Any]) -> dict[str, Any]:
    """The model's reply as an OpenEnv action dict (JSON, fenced JSON, or the raw value of the single required
    field); InvalidAction says why not."""
    text = text.strip()
    if text.startswith("```") and text.endswith("```") and len(text) >= 6:
        text = "\n".join(text.splitlines()[1:-1]).strip()
    try:
        action: Any = json.loads(text)
    except ValueError:
        action = text
    if isinstance(action, dict):
        return action
    required = action_schema.get("required") or []
    if len(required) != 1:
        raise InvalidAction(f"answer with a JSON object of this schema: {json.dumps(action_schema)}")
    field = (action_schema.get("properties") or {}).get(required[0]) or {}
    if field.get("type") == "string" or not isinstance(action, (int, float, bool, list)):
        action = text  # a string field takes the text as written (json.loads may have read "42" as a number)
    return {required[0]: action}


def _schema_hint(action_schema: dict[str, Any]) -> dict[str, Any]:
    """The schema without OpenEnv's base ``metadata`` field (internal to the client, noise to the model)."""
    props = {k: v for k, v in (action_schema.get("properties") or {}).items() if k != "metadata"}
    out = {k: v for k, v in action_schema.items() if k not in ("properties", "$defs")}
    out["properties"] = props
    return out


class OpenEnvEnvironment(Environment):
    """One session of an OpenEnv server (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        reset: dict[str, Any] | None = None,
        include_prompt: bool = True,
        parser: str = "hermes",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"openenv:<http-url>: {base_url!r} is not an http(s) URL")
        self.base_url = base_url.rstrip("/")
        self.reset_kwargs = dict(reset or {})
        self.include_prompt = bool(include_prompt)
        self.parser = check_parser(parser)
        self.timeout_s = float(timeout_s)
        self.mcp = False
        self.client = None
        self.action_schema: dict[str, Any] = {}
        self.done = False
        self.total = 0.0

    def _payload(self, observation: Any) -> Message:
        body = {"observation": observation}
        if not self.mcp:  # an MCP environment's actions are its tools, rendered by the chat template
            body["action_schema"] = _schema_hint(self.action_schema)
        return {"role": "user", "content": json.dumps(body, ensure_ascii=False)}

    def _step(self, action: dict[str, Any]):
        try:
            return self.client.step(action)
        except Exception as err:  # a lost connection, an execution error, a broken reply
            raise EnvironmentFailure(f"OpenEnv server {self.base_url}: {type(err).__name__}: {err}") from err

    def _tools(self) -> list[dict[str, Any]]:
        listed = self._step({"type": "list_tools"}).observation
        tools = listed.get("tools") if isinstance(listed, dict) else None
        if not isinstance(tools, list):
            raise EnvironmentFailure(f"OpenEnv server {self.base_url}: list_tools answered {str(listed)[:200]}")
        return [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description") or "",
                    "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
                },
            }
            for t in tools
        ]

    def reset(self, prompt: list[Message], label: str | None, info: dict[str, str], seed: int | None) -> Opening:
        if self.client is not None:
            raise EnvironmentFailure("reset twice: one instance is one episode")
        try:
            import httpx
            from openenv import GenericEnvClient
        except ImportError as err:
            raise EnvironmentFailure(f"OpenEnv environments need `pip install openenv-core==0.3.0` ({err})") from None
        try:
            schema = httpx.get(f"{self.base_url}/schema", timeout=self.timeout_s)
            schema.raise_for_status()
            self.action_schema = schema.json()["action"]
            self.mcp = self.action_schema.get("title") in MCP_ACTIONS
            # openenv-core's sync wrapper runs the async WebSocket client on a loop thread of its own
            self.client = GenericEnvClient(
                base_url=self.base_url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s
            ).sync()
            kwargs = dict(self.reset_kwargs)
            if seed is not None:
                kwargs.setdefault("seed", int(seed))
            result = self.client.reset(**kwargs)
        except Exception as err:  # any failure to open the session fails the sample
            raise EnvironmentFailure(f"OpenEnv server {self.base_url}: {type(err).__name__}: {err}") from err
        tools = self._tools() if self.mcp else []
        messages = [dict(m) for m in prompt] if self.include_prompt else []
        messages.append(self._payload(result.observation))
        return Opening(messages=messages, tools=tools, info={"openenv_url": self.base_url})

    def step(self, action: str) -> Outcome:
        if self.client is None or self.done:
            raise EnvironmentFailure("step outside an episode (before reset or after done)")
        if self.mcp:
            return self._tool_step(action)
        try:
            parsed = parse_action(action, self.action_schema)
        except InvalidAction as err:
            return self._refused(str(err))
        try:
            result = self.client.step(parsed)
        except RuntimeError as err:
            # the server's validation of the action (WSErrorCode.VALIDATION_ERROR) is the model's mistake
            if "VALIDATION_ERROR" in str(err):
                return self._refused(str(err))
            raise EnvironmentFailure(f"OpenEnv server {self.base_url}: {err}") from err
        except Exception as err:  # a lost connection or a broken reply
            raise EnvironmentFailure(f"OpenEnv server {self.base_url}: {type(err).__name__}: {err}") from err
        reward = float(result.reward or 0.0)
        self.total += reward
        self.done = bool(result.done)
        metrics = {"action_errors": 0.0}
        if self.done:
            return Outcome(messages=[], reward=reward, done=True, metrics=metrics, info={"return": f"{self.total:g}"})
        return Outcome(messages=[self._payload(result.observation)], reward=reward, metrics=metrics)

    def _tool_step(self, action: str) -> Outcome:
        _, calls = parse_tool_calls(action, parser=self.parser)
        if not calls:  # the final answer: nothing more can advance an MCP environment
            self.done = True
            metrics = {"tool_calls": 0.0, "tool_errors": 0.0}
            return Outcome(messages=[], done=True, metrics=metrics, info={"return": f"{self.total:g}"})
        messages, reward, errors = [], 0.0, 0
        for call in calls:
            name = call["function"]["name"]
            try:
                arguments = json.loads(call["function"]["arguments"] or "{}")
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                text, failed = "error: the arguments must be a JSON object", True
            else:
                result = self._step({"type": "call_tool", "tool_name": name, "arguments": arguments})
                reward += float(result.reward or 0.0)
                text, failed = _tool_text(result.observation)
                self.done = self.done or bool(result.done)
            errors += failed
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": text})
            if self.done:
                break
        self.total += reward
        metrics = {"tool_calls": float(len(messages)), "tool_errors": float(errors)}
        if self.done:
            return Outcome(messages=[], reward=reward, done=True, metrics=metrics, info={"return": f"{self.total:g}"})
        return Outcome(messages=messages, reward=reward, metrics=metrics)

    def _refused(self, why: str) -> Outcome:
        return Outcome(
            messages=[{"role": "user", "content": f"That is not a valid action ({why}). Try again."}],
            reward=0.0,
            metrics={"action_errors": 1.0},
        )

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing a dead session has nothing left to release
                client.close()


def _tool_text(observation: Any) -> tuple[str, bool]:
    """A ``call_tool`` observation -> (the tool message's text, whether it is an error): the error's message, else
    the MCP result's text blocks, else the result as JSON."""
    obs = observation if isinstance(observation, dict) else {}
    error = obs.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else str(error)
        return f"error: {message}", True
    result = obs.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        blocks = [b for b in result["content"] if isinstance(b, dict) and b.get("type") == "text"]
        text = "\n".join(str(b.get("text", "")) for b in blocks)
        failed = bool(result.get("is_error"))
        return (f"error: {text}" if failed else text), failed
    return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)), False


def factory(rest: str):
    """The registry's resolver for ``openenv:<http-url>``."""
    if not rest.startswith(("http://", "https://")):
        raise ValueError(f"write openenv:<http-url>, e.g. openenv:http://127.0.0.1:8000 (got {rest!r})")
    return functools.partial(OpenEnvEnvironment, rest)
