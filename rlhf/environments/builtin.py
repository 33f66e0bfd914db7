"""Built-in environments, registered as ``builtin:<name>`` (see :mod:`rlhf.environments.registry`).

``builtin:calculator``: an arithmetic question (``data.path: builtin:arithmetic`` gives prompt + label) with one tool,
``calculator(expression)``. A turn with tool calls (hermes format, :func:`rlhf.tool_calls.parse_tool_calls`) gets one
``tool`` message per call with the result (or the error) and no reward; a turn without a tool call is the final
answer: reward 1.0 when its number equals the label's, else 0.0, and the episode is done.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from typing import Any

from rlhf.answers import answers_match, extract_answer, normalize
from rlhf.environments.base import Environment, EnvironmentFailure, EpisodeInputInvalid, Message, Opening, Outcome
from rlhf.environments.registry import register
from rlhf.tool_calls import check_parser, parse_tool_calls

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
# Integer results are kept below this many bits: 9**9**9 would otherwise take the process's memory and minutes.
MAX_INT_BITS = 4096


class CalculatorError(ValueError):
    """An expression the calculator refuses (syntax, a name or call, division by zero, too large)."""


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # type(): True is not a number here
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        big_power = isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and right > 0
        if big_power and max(left.bit_length(), 1) * right > MAX_INT_BITS:  # the result's size, before computing it
            raise CalculatorError("the result is too large")
        try:
            out = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(out, complex):  # (-8) ** 0.5
            raise CalculatorError("the result is not a real number")
        if isinstance(out, int) and out.bit_length() > MAX_INT_BITS:
            raise CalculatorError("the result is too large")
        return out
    what = type(node).__name__ if not isinstance(node, ast.Constant) else repr(node.value)
    raise CalculatorError(f"unsupported element {what}: use numbers, parentheses and + - * / // % **")


def safe_eval(expression: str, max_chars: int = 200) -> int | float:
    """The value of an arithmetic expression (numbers, parentheses, + - * / // % ** and unary + -), by walking its
    syntax tree: nothing is executed. CalculatorError says what is wrong."""
    if len(expression) > max_chars:
        raise CalculatorError(f"the expression is {len(expression)} characters; at most {max_chars}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalculatorError("not an arithmetic expression") from None
    return _eval(tree)


def format_number(x: int | float) -> str:
    if isinstance(x, float):
        if not math.isfinite(x):
            raise CalculatorError("the result is not a finite number")
        return format(x, ".12g")
    return str(x)


def answer_matches(text: str, label: str, tolerance: float = 1e-6) -> bool:
    """The final turn's answer against the label, read as the reward service's ``math_answer`` reads it
    (:mod:`rlhf.answers`); a text without a number or ``\\boxed{}`` matches only the label's own text."""
    if extract_answer(text) is None:
        return normalize(text) == normalize(label)
    return answers_match(text, label, tolerance)


CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, parentheses, + - * / // % **).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}
CALCULATOR_SYSTEM = (
    "You can use a calculator. To call it, write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call> '
    "and wait for the result. When you know the answer, reply with the number only, without a tool call."
)


class Calculator(Environment):
    """An arithmetic question with a calculator tool; see the module docstring. Options: ``max_expression_chars``,
    ``parser`` (the tool-call format, ``hermes``), ``system`` (the instructions given before the prompt),
    ``list_tools`` (give the tool's JSON schema for the chat template to render; off, the system text alone says how
    to call it: a tiny model learns from a prompt of 60 tokens rather than 280), ``tool_reward`` (the reward of the
    first turn whose tool calls all ran without an error: a format reward, as tool-use RL recipes add to the answer's;
    0 by default)."""

    def __init__(
        self,
        max_expression_chars: int = 200,
        parser: str = "hermes",
        system: str = CALCULATOR_SYSTEM,
        list_tools: bool = True,
        tool_reward: float = 0.0,
    ):
        self.max_chars = int(max_expression_chars)
        self.parser = check_parser(parser)
        self.system = system
        self.list_tools = bool(list_tools)
        self.tool_reward = float(tool_reward)
        self._tool_rewarded = False
        self.label: str | None = None

    def reset(self, prompt: list[Message], label: str | None, info: dict[str, str], seed: int | None) -> Opening:
        if not label:
            raise EpisodeInputInvalid(
                "builtin:calculator needs the reference answer as the label (e.g. from data.path: builtin:arithmetic)",
                "label",
            )
        if not prompt:
            raise EpisodeInputInvalid("builtin:calculator needs the question as the prompt (chat messages)", "prompt")
        self.label = label
        messages = [dict(m) for m in prompt]
        if messages and messages[0].get("role") == "system":  # one system message: ours first, the task's after
            messages[0]["content"] = f"{self.system}\n\n{messages[0].get('content') or ''}".rstrip()
        else:
            messages.insert(0, {"role": "system", "content": self.system})
        return Opening(messages=messages, tools=[CALCULATOR_TOOL] if self.list_tools else [])

    def _call(self, call: dict[str, Any]) -> tuple[str, bool]:
        """(the tool message's content, whether it is an error)."""
        fn = call.get("function") or {}
        if fn.get("name") != "calculator":
            return f"error: unknown tool {fn.get('name')!r}; the only tool is calculator", True
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = None
        expr = args.get("expression") if isinstance(args, dict) else None
        if isinstance(expr, (int, float)) and not isinstance(expr, bool):
            expr = str(expr)
        if not isinstance(expr, str):
            return 'error: call calculator with {"expression": "<arithmetic>"}', True
        try:
            return format_number(safe_eval(expr, self.max_chars)), False
        except CalculatorError as err:
            return f"error: {err}", True

    def step(self, action: str) -> Outcome:
        if self.label is None:
            raise EnvironmentFailure("step before reset")
        content, calls = parse_tool_calls(action, parser=self.parser)
        if not calls:
            reward = 1.0 if answer_matches(content or "", self.label) else 0.0
            return Outcome(messages=[], reward=reward, done=True, metrics={"tool_calls": 0.0, "tool_errors": 0.0})
        messages, errors = [], 0
        for call in calls:
            result, failed = self._call(call)
            errors += failed
            name = call["function"]["name"]
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": result})
        reward = 0.0
        if not errors and not self._tool_rewarded:  # once per episode: calling the tool again earns nothing
            reward, self._tool_rewarded = self.tool_reward, True
        return Outcome(
            messages=messages,
            reward=reward,
            metrics={"tool_calls": float(len(calls)), "tool_errors": float(errors)},
        )


register("builtin:calculator", Calculator)
