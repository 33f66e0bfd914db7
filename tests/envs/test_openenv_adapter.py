"""OpenEnv HTTP environments through the adapter (rlhf.environments.adapters.openenv_env), with the real
openenv-core: a guessing game written here as an OpenEnv server (its Environment, Action and Observation types and
create_app), served by uvicorn on loopback, played through the registry's ``openenv:<url>``. Runs in .venv-envs."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server import (
    Action,
    CallToolAction,
    CallToolObservation,
    Environment,
    Observation,
    State,
    create_app,
)
from openenv.core.env_server.mcp_environment import MCPEnvironment

from rlhf.environments import registry
from rlhf.environments.adapters.openenv_env import InvalidAction, parse_action
from rlhf.environments.base import EnvironmentFailure


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnv(Environment):
    """Guess a digit: the seed picks it; -0.1 per wrong guess, 1.0 for the right one."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State()
        self.target = 7

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target = 7 if seed is None else seed % 10
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(feedback="guess a digit")

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if action.guess == self.target:
            return GuessObservation(feedback="right", done=True, reward=1.0)
        return GuessObservation(feedback="higher" if action.guess < self.target else "lower", reward=-0.1)

    @property
    def state(self):
        return self._state


class NotesEnv(MCPEnvironment):
    """An MCP environment: one tool, ``add_note``; the second note stored ends the episode with reward 1."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("notes")
        self.notes: list[str] = []

        @mcp.tool()
        def add_note(text: str) -> str:
            """Store a note."""
            self.notes.append(text)
            return f"{len(self.notes)} notes"

        super().__init__(mcp)
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.notes = []
        return Observation()

    async def step_async(self, action, timeout_s=None, **kwargs):
        obs = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and len(self.notes) >= 2:
            obs.reward, obs.done = 1.0, True
        return obs

    def _step_impl(self, action, timeout_s=None, **kwargs):
        return Observation(done=True)

    @property
    def state(self):
        return self._state


def serve(app):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the OpenEnv server did not start"
        time.sleep(0.05)
    return server, thread, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server_url():
    server, thread, url = serve(create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=4))
    yield url
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def mcp_url():
    server, thread, url = serve(create_app(NotesEnv, CallToolAction, CallToolObservation, max_concurrent_envs=4))
    yield url
    server.should_exit = True
    thread.join(10)


def observation(message: dict) -> dict:
    assert message["role"] == "user"
    return json.loads(message["content"])["observation"]


def test_an_episode_is_one_session_of_the_server(server_url):
    env = registry.make(f"openenv:{server_url}", {"timeout_s": 10})
    try:
        prompt = [{"role": "system", "content": "Play the game."}]
        opening = env.reset(prompt, None, {}, 13)  # the job's seed reaches OpenEnv's reset: target 3
        assert opening.messages[0] == prompt[0]
        body = json.loads(opening.messages[1]["content"])
        assert body["observation"] == {"feedback": "guess a digit"}
        assert body["action_schema"]["required"] == ["guess"] and "metadata" not in body["action_schema"]["properties"]

        out = env.step("1")  # the raw value of the one required field
        assert not out.done and out.reward == pytest.approx(-0.1)
        assert observation(out.messages[0]) == {"feedback": "higher"}
        out = env.step('{"guess": 9}')
        assert observation(out.messages[0]) == {"feedback": "lower"}
        # not an action: the model is told, nothing is scored, the episode goes on
        out = env.step("three")
        assert not out.done and out.reward == 0.0 and out.metrics["action_errors"] == 1.0
        assert "not a valid action" in out.messages[0]["content"]
        out = env.step('{"guess": "x"}')  # refused by the server's validation
        assert out.metrics["action_errors"] == 1.0
        out = env.step('```json\n{"guess": 3}\n```')
        assert out.done and out.reward == 1.0 and out.messages == [] and out.info["return"] == "0.8"
        with pytest.raises(EnvironmentFailure, match="outside an episode"):
            env.step('{"guess": 3}')
    finally:
        env.close()


def test_episodes_are_independent_sessions(server_url):
    a = registry.make(f"openenv:{server_url}", {"include_prompt": False})
    b = registry.make(f"openenv:{server_url}", {"reset": {"seed": 5}})
    try:
        assert len(a.reset([{"role": "user", "content": "hi"}], None, {}, 2).messages) == 1
        b.reset([], None, {}, None)
        assert b.step("5").done  # b's target is 5, a's is 2: each session keeps its own game
        assert not a.step("5").done
        assert a.step("2").done
    finally:
        a.close()
        b.close()


def test_an_unreachable_server_fails_the_sample():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    env = registry.make(f"openenv:http://127.0.0.1:{port}", {"timeout_s": 5})
    with pytest.raises(EnvironmentFailure, match="OpenEnv server"):
        env.reset([], None, {}, None)
    env.close()
    with pytest.raises(registry.UnknownEnvironment, match="http"):
        registry.resolve("openenv:127.0.0.1:8000")


def test_parse_action():
    schema = {"required": ["guess"], "properties": {"guess": {"type": "integer"}}}
    assert parse_action(" 4 ", schema) == {"guess": 4}
    assert parse_action('```\n{"guess": 4, "x": 1}\n```', schema) == {"guess": 4, "x": 1}
    assert parse_action("42", {"required": ["word"], "properties": {"word": {"type": "string"}}}) == {"word": "42"}
    with pytest.raises(InvalidAction):
        parse_action("4", {"required": ["a", "b"], "properties": {}})


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def test_an_mcp_environment_is_played_with_tool_calls(mcp_url):
    env = registry.make(f"openenv:{mcp_url}", {})
    try:
        opening = env.reset([{"role": "user", "content": "Store two notes."}], None, {}, None)
        (tool,) = opening.tools
        assert tool["function"]["name"] == "add_note" and tool["function"]["parameters"]["required"] == ["text"]
        assert "action_schema" not in json.loads(opening.messages[-1]["content"])  # the tools say how to act

        out = env.step("First: " + call("add_note", text="milk") + call("add_note", wrong=1))
        assert not out.done and out.reward == 0.0
        ok, bad = out.messages
        assert (ok["role"], ok["name"], ok["content"]) == ("tool", "add_note", "1 notes")
        assert ok["tool_call_id"].startswith("call_") and bad["content"].startswith("error: ")
        assert out.metrics == {"tool_calls": 2.0, "tool_errors": 1.0}
        out = env.step(call("no_such_tool"))
        assert out.messages[0]["content"].startswith("error: ") and "no_such_tool" in out.messages[0]["content"]
        out = env.step(call("add_note", text="eggs"))
        assert out.done and out.reward == 1.0 and out.info["return"] == "1"
    finally:
        env.close()
    env = registry.make(f"openenv:{mcp_url}", {})
    try:
        env.reset([], None, {}, None)
        out = env.step("Nothing to store.")  # a turn without a tool call is the final answer
        assert out.done and out.reward == 0.0
    finally:
        env.close()
