"""rlhf.environments without a server: the safe calculator, the calculator environment, the registry, the wire shape
of messages and the ``environment`` config section."""

from __future__ import annotations

import json
import sys
import types

import pytest

from rlhf.config import ConfigError, parse_config
from rlhf.data import builtin_arithmetic
from rlhf.environments import registry
from rlhf.environments.base import Environment, EnvironmentFailure, Opening, Outcome
from rlhf.environments.builtin import Calculator, CalculatorError, answer_matches, safe_eval
from rlhf.environments.wire import message_from_proto, message_to_proto
from rlhf.serving.settings import KNOWN_ENV_VARS, ServiceSettings
from services import plan


@pytest.mark.parametrize(
    ("expr", "want"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 ** 3 ** 2", 512),  # right-associative, as Python
        ("-2 ** 2", -4),
        ("7 // 2 + 7 % 2", 4),
        ("7 / 2", 3.5),
        ("1e3 - .5", 999.5),
        ("+-+3", -3),
        ("2 ** -1", 0.5),
        ("  12  ", 12),
    ],
)
def test_safe_eval_computes_arithmetic(expr, want):
    got = safe_eval(expr)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize(
    ("expr", "message"),
    [
        ("__import__('os').system('true')", "unsupported element"),
        ("open('/etc/passwd')", "unsupported element"),
        ("x + 1", "unsupported element Name"),
        ("(1).real", "unsupported element Attribute"),
        ("True + 1", "unsupported element True"),
        ("'a' * 3", "unsupported element 'a'"),
        ("[1, 2]", "unsupported element List"),
        ("lambda: 1", "unsupported element Lambda"),
        ("1 if 1 else 2", "unsupported element IfExp"),
        ("1 << 3", "unsupported element BinOp"),
        ("1 < 2", "unsupported element Compare"),
        ("1j * 2", "unsupported element 1j"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 2000 * 10 ** 2000", "too large"),
        ("1.5 ** 10000", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("", "not an arithmetic expression"),
        ("1" * 201, "at most 200"),
    ],
)
def test_safe_eval_refuses_everything_else(expr, message):
    with pytest.raises(CalculatorError, match=message):
        safe_eval(expr)


def test_answer_matching_reads_the_final_number():
    assert answer_matches("The answer is 42.", "42")
    assert answer_matches("17 + 25 = \\boxed{42}", "42")
    assert answer_matches("1,234", "1234") and answer_matches("0.5", "0.50")
    assert not answer_matches("42 or maybe 41", "42")
    assert not answer_matches("no idea", "42")


def call(expr: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>'


def test_calculator_episode_on_the_arithmetic_data():
    row = builtin_arithmetic(n=1, seed=5)[0]
    a, b = (int(x) for x in row["prompt"].removeprefix("what is ").removesuffix("?").split(" plus "))
    env = Calculator()
    opening = env.reset(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": row["prompt"]}], row["label"], {}, None
    )
    assert opening.messages[0]["role"] == "system" and opening.messages[0]["content"].endswith("Be brief.")
    assert len(opening.messages) == 2 and opening.tools[0]["function"]["name"] == "calculator"
    out = env.step(call(f"{a} + {b}"))
    assert out.messages == [
        {"role": "tool", "tool_call_id": out.messages[0]["tool_call_id"], "name": "calculator", "content": str(a + b)}
    ]
    assert (out.reward, out.done, out.metrics) == (0.0, False, {"tool_calls": 1.0, "tool_errors": 0.0})
    # a wrong tool, arguments that are not an expression, an expression it refuses: tool errors, the episode goes on
    out = env.step(
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>' + call("1/0")
    )
    assert [m["content"].split(":")[0] for m in out.messages] == ["error"] * 3
    assert out.messages[0]["name"] == "search" and "division by zero" in out.messages[2]["content"]
    assert out.metrics == {"tool_calls": 3.0, "tool_errors": 3.0} and not out.done
    out = env.step(f"So it is {a + b}.")
    assert (out.reward, out.done, out.messages) == (1.0, True, [])
    short = Calculator(list_tools=False, system="Use the calculator.").reset(
        [{"role": "user", "content": row["prompt"]}], row["label"], {}, None
    )
    assert short.tools == [] and short.messages[0] == {"role": "system", "content": "Use the calculator."}
    shaped = Calculator(tool_reward=0.25)
    shaped.reset([{"role": "user", "content": row["prompt"]}], row["label"], {}, None)
    assert shaped.step(call("1/0")).reward == 0.0  # a tool error earns nothing
    assert shaped.step(call(f"{a} + {b}")).reward == 0.25
    assert shaped.step(call(f"{a} + {b}")).reward == 0.0  # once per episode
    assert shaped.step(str(a + b)).reward == 1.0


def test_calculator_needs_a_label_and_a_known_parser():
    with pytest.raises(EnvironmentFailure, match="label"):
        Calculator().reset([{"role": "user", "content": "q"}], None, {}, None)
    with pytest.raises(ValueError, match="tool call parser"):
        Calculator(parser="nope")
    assert Calculator().step.__self__ is not None
    with pytest.raises(EnvironmentFailure, match="before reset"):
        Calculator().step("1")


class _Coin(Environment):
    def __init__(self, sides: int = 2):
        self.sides = sides

    def reset(self, prompt, label, info, seed):
        return Opening(messages=prompt)

    def step(self, action):
        return Outcome(messages=[], reward=float(self.sides), done=True)


def test_registry_names_python_specs_and_prefixes(monkeypatch):
    assert "builtin:calculator" in registry.names()
    assert isinstance(registry.make("builtin:calculator", {"max_expression_chars": 10}), Calculator)

    module = types.ModuleType("_coin_envs")
    module.Coin = _Coin
    module.not_callable = 3
    monkeypatch.setitem(sys.modules, "_coin_envs", module)
    env = registry.make("python:_coin_envs:Coin", {"sides": 6})
    assert env.step("x").reward == 6.0

    with pytest.raises(registry.UnknownEnvironment, match="known: builtin:calculator, python:<module>:<factory>"):
        registry.resolve("builtin:nope")
    with pytest.raises(registry.UnknownEnvironment, match="has no Missing"):
        registry.resolve("python:_coin_envs:Missing")
    with pytest.raises(registry.UnknownEnvironment, match="not callable"):
        registry.resolve("python:_coin_envs:not_callable")
    with pytest.raises(registry.UnknownEnvironment, match="cannot import"):
        registry.resolve("python:no_such_module_here:X")
    with pytest.raises(registry.UnknownEnvironment, match="write python:<module>:<factory>"):
        registry.check("python:only_a_module")
    registry.check("python:not_imported_by_check:X")  # a config check never imports user code
    with pytest.raises(registry.UnknownEnvironment, match="options \\['digits'\\]"):
        registry.check("builtin:calculator", {"digits": 3})
    with pytest.raises(TypeError, match="not an rlhf.environments.base.Environment"):
        registry.make("python:builtins:dict")

    # a name and a prefix of one's own (what library adapters do)
    monkeypatch.setattr(registry, "_FACTORIES", dict(registry._FACTORIES))
    monkeypatch.setattr(registry, "_PREFIXES", {})
    registry.register("test:coin", _Coin)
    registry.register("test:coin", _Coin)  # the same again is fine (a module imported twice)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("test:coin", Calculator)
    with pytest.raises(ValueError, match="reserved"):
        registry.register("python:x:y", _Coin)
    registry.register_prefix("dice", lambda rest: lambda: _Coin(int(rest)))
    assert registry.make("dice:20").step("x").reward == 20.0
    with pytest.raises(registry.UnknownEnvironment, match="dice:<...>"):
        registry.resolve("coins:3")


def test_a_plugin_that_fails_to_import_is_named_not_fatal(monkeypatch):
    monkeypatch.setattr(registry, "PLUGIN_MODULES", [*registry.PLUGIN_MODULES, "no_such_plugin_module"])
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_BROKEN", {})
    assert "builtin:calculator" in registry.names()  # the others still load
    with pytest.raises(registry.UnknownEnvironment, match="no_such_plugin_module failed to import: ModuleNotFound"):
        registry.resolve("plugin:env")


def test_messages_round_trip_the_wire():
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c", "name": "calculator"},
        {"role": "user", "content": [{"type": "text", "text": "parts"}]},
    ]
    for m in messages:
        p = message_to_proto(m)
        assert message_from_proto(p) == m
    assert json.loads(message_to_proto(messages[1]).extra_json)["content"] is None
    for bad in ({"content": "no role"}, "text", {"role": "user", "name": 3}):
        with pytest.raises(TypeError):
            message_to_proto(bad)


def test_the_environment_config_section():
    cfg = parse_config({"environment": {"name": "builtin:calculator", "options": {"max_expression_chars": 80}}})
    assert (cfg.environment.max_turns, cfg.environment.max_tokens, cfg.environment.replicas) == (4, None, 1)
    assert parse_config({}).environment.name is None  # single-turn, as before
    cases = [
        ({"name": "builtin:nope"}, "environment.name: unknown environment 'builtin:nope'"),
        ({"name": "python:mod"}, "environment.name: 'python:mod': write python:<module>:<factory>"),
        ({"name": "builtin:calculator", "options": {"digits": 1}}, "environment.options: options ['digits']"),
        ({"max_turns": 8}, "environment.max_turns is set but environment.name is null"),
        ({"name": "builtin:calculator", "max_turns": 0}, "environment.max_turns"),
        ({"name": "builtin:calculator", "nme": 1}, "environment.nme"),
    ]
    for section, message in cases:
        with pytest.raises(ConfigError, match=message.replace("[", "\\[").replace("]", "\\]")):
            parse_config({"environment": section})
    fits = {"max_model_len": 64, "max_prompt_length": 32}
    with pytest.raises(ConfigError, match="environment.max_tokens 40 does not fit"):
        parse_config(
            {
                "actor_rollout_ref": {"actor_rollout": {**fits, "max_new_tokens": 16}},
                "environment": {"name": "builtin:calculator", "max_tokens": 40},
            }
        )


def test_rlhf_up_plans_environment_services(tmp_path):
    base = plan.plan_services(redis_url="u", run_id="r", api_token="t", run_dir=tmp_path, rollout_replicas=3)
    assert not [s for s in base if s.service == "environment"]
    assert all("RLHF_ENVIRONMENT_ADDR" not in s.env for s in base)

    specs = plan.plan_services(
        redis_url="redis://h:1/0",
        run_id="r",
        api_token="t",
        run_dir=tmp_path,
        rollout_replicas=3,
        environment_replicas=2,
    )
    envs = [s for s in specs if s.service == "environment"]
    rollouts = [s for s in specs if s.service == "rollout"]
    assert [s.name for s in envs] == ["environment-0", "environment-1"]
    assert specs.index(envs[-1]) < specs.index(rollouts[0])  # started before the replicas that call them
    # each replica talks to one environment process (an episode lives in one), spread round-robin
    assert [r.env["RLHF_ENVIRONMENT_ADDR"] for r in rollouts] == [e.grpc_addr for e in (envs[0], envs[1], envs[0])]
    assert all(e.env["RLHF_API_TOKEN"] == "t" for e in envs)
    assert len({p for s in specs for p in (s.grpc_port, s.http_port)}) == 2 * len(specs)
    for spec in specs:
        env = plan.child_env(spec.env, base={})
        assert [k for k in env if k.startswith("RLHF_") and k not in KNOWN_ENV_VARS] == []
        ServiceSettings.from_env(env)
    one = plan.plan_services(redis_url="u", run_id="r", api_token="t", run_dir=tmp_path, environment_replicas=1)
    assert [s.name for s in one if s.service == "environment"] == ["environment"]
