"""Rule (verifiable) reward functions, by name, plus user functions given as ``module:function``.

A rule is ``fn(prompt: str, response: str, label: str | None, **kwargs) -> float``; the ``kwargs`` come from the
scorer's ``kwargs`` in the config. A built-in rule may also take ``sample=`` (a :class:`RuleSample` with the token ids
and a token counter). A rule that raises, returns a non-number or NaN gives the item an error status, never 0.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from rlhf import tasks
from rlhf.answers import answers_match, boxed, normalize

RuleFn = Callable[..., float]


class RuleInputError(ValueError):
    """The item cannot be scored by this rule (a missing label): the item gets ITEM_STATUS_INVALID_INPUT."""


@dataclass
class RuleSample:
    prompt: str
    response: str
    label: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    finished: bool = True
    count_tokens: Callable[[str], int] | None = None

    def response_tokens(self) -> int:
        """Response length in tokens: the ids when given, else the policy tokenizer's count of the text."""
        if self.response_ids:
            return len(self.response_ids)
        if self.count_tokens is None:
            raise RuleInputError("no tokenizer to count response tokens: send response_ids or use unit: chars")
        return self.count_tokens(self.response)


def _need_label(label: str | None, rule: str) -> str:
    if label is None or label == "":
        raise RuleInputError(f"label is missing: rule {rule!r} needs the reference answer in the item's label")
    return label


def math_answer(prompt: str, response: str, label: str | None, *, tolerance: float = 1e-6) -> float:
    """1.0 when the response's final answer (last ``\\boxed{}`` or last number) equals the label's, else 0.0."""
    return 1.0 if answers_match(response, _need_label(label, "math_answer"), tolerance) else 0.0


def exact_match(prompt: str, response: str, label: str | None, *, extract: bool = True) -> float:
    """1.0 when the response (its extracted final answer, with ``extract``) matches the label after normalisation."""
    label = _need_label(label, "exact_match")
    if normalize(response) == normalize(label):
        return 1.0
    if extract:
        return math_answer(prompt, response, label)
    return 0.0


REGEX_MODES = ("search", "match", "fullmatch")
REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL}


def compile_regex(pattern: str, flags: str = "", mode: str = "search") -> re.Pattern[str]:
    """The ``regex`` rule's pattern, compiled once when the scorer is built (a bad pattern fails at start-up)."""
    if mode not in REGEX_MODES:
        raise ValueError(f"regex: mode must be search, match or fullmatch, got {mode!r}")
    unknown = sorted(set(flags) - set(REGEX_FLAGS))
    if unknown:
        raise ValueError(f"regex: unknown flags {unknown}; use any of i, m, s")
    if not isinstance(pattern, str) or not pattern:
        raise ValueError("regex: pattern must be a non-empty string")
    fl = 0
    for ch in flags:
        fl |= REGEX_FLAGS[ch]
    try:
        return re.compile(pattern, fl)
    except re.error as err:
        raise ValueError(f"regex: pattern {pattern!r} does not compile: {err}") from None


def regex(
    prompt: str,
    response: str,
    label: str | None,
    *,
    pattern: str | re.Pattern[str],
    mode: str = "search",
    flags: str = "",
) -> float:
    """1.0 when ``pattern`` matches the response (``search``, ``match`` or ``fullmatch``), else 0.0.

    The pattern comes from the scorer's config only and is required; the item's label is never used as a pattern.
    A pattern sent by a client can backtrack for seconds (``^(a+)+$`` on 28 characters: 6 s) and ``re`` holds the
    GIL meanwhile, so even a worker thread would stall the service's event loop. To compare with a label, use
    ``exact_match`` (the label as literal text).
    """
    rx = pattern if isinstance(pattern, re.Pattern) else compile_regex(pattern, flags, mode)
    return 1.0 if getattr(rx, mode)(response) else 0.0


def prepare_kwargs(name: str, kwargs: dict) -> dict:
    """A built-in rule's config kwargs made ready once, at start-up (``regex``: the pattern compiled)."""
    if name == "regex":
        kwargs = dict(kwargs)
        kwargs["pattern"] = compile_regex(kwargs.get("pattern"), kwargs.get("flags", ""), kwargs.get("mode", "search"))
    elif name == "math_verify":
        _math_verify_module()  # a missing package fails at start-up, not on every item
    elif name == "reasoning_gym":
        if kwargs.get("extract", "answer") not in EXTRACT_MODES:
            raise ValueError(f"reasoning_gym: extract must be answer, boxed or none, got {kwargs.get('extract')!r}")

        try:
            tasks.task_names()
        except ImportError as err:
            raise ValueError(f"rule 'reasoning_gym': {err}") from None
    return kwargs


def length(
    prompt: str,
    response: str,
    label: str | None,
    *,
    target: float,
    scale: float | None = None,
    unit: str = "tokens",
    sample: RuleSample | None = None,
) -> float:
    """Closeness of the response length to ``target``: ``1 / (1 + ((n - target) / scale)^2)`` in (0, 1].

    Smooth and heavy-tailed (a response far from the target still sees a slope), 1.0 exactly at the target.
    ``scale`` defaults to ``target / 2``; ``unit`` is tokens (the response ids, else the policy tokenizer), chars or
    words.
    """
    if target <= 0:
        raise ValueError("length: target must be > 0")
    scale = float(scale) if scale else max(1.0, target / 2)
    if unit == "tokens":
        n = sample.response_tokens() if sample is not None else len(response.split())
    elif unit == "chars":
        n = len(response)
    elif unit == "words":
        n = len(response.split())
    else:
        raise ValueError(f"length: unit must be tokens, chars or words, got {unit!r}")
    return 1.0 / (1.0 + ((n - target) / scale) ** 2)


def format_check(prompt: str, response: str, label: str | None, *, kind: str = "boxed") -> float:
    """1.0 when the response has the asked format: ``boxed`` (a ``\\boxed{}`` answer), ``number`` (ends with a
    number), ``think`` (``<think>...</think>`` then an answer) or ``json`` (a JSON value), else 0.0."""
    text = response.strip()
    if kind == "boxed":
        return 1.0 if boxed(text) is not None else 0.0
    if kind == "number":
        return 1.0 if re.search(r"-?\d+(?:\.\d+)?\s*\.?$", text) else 0.0
    if kind == "think":
        return 1.0 if re.fullmatch(r"(?s)<think>.+?</think>\s*\S.*", text) else 0.0
    if kind == "json":
        try:
            json.loads(text)
            return 1.0
        except ValueError:
            return 0.0
    raise ValueError(f"format: kind must be boxed, number, think or json, got {kind!r}")


def char_fraction(prompt: str, response: str, label: str | None, *, chars: str = "0123456789") -> float:
    """Fraction of the response's non-space characters that are in ``chars`` (digits by default), in [0, 1].

    A dense, smooth signal: the demo uses it so that a random tiny policy starts low and PPO visibly raises it."""
    text = "".join(response.split())
    if not text:
        return 0.0
    return sum(1 for c in text if c in chars) / len(text)


def lcs_ratio(prompt: str, response: str, label: str | None) -> float:
    """Partial credit for a string answer: ``2 * LCS / (len(response) + len(label))`` over characters, both stripped
    (1.0 only for an exact match; PRIME-RL scores its reverse-text task this way)."""
    a, b = response.strip(), _need_label(label, "lcs_ratio").strip()
    row = [0] * (len(b) + 1)
    for ca in a:
        diag = 0
        for j, cb in enumerate(b, 1):
            diag, row[j] = row[j], diag + 1 if ca == cb else max(row[j], row[j - 1])
    return 2.0 * row[-1] / (len(a) + len(b))


def _math_verify_module():
    try:
        import math_verify  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise ValueError(
            "rule 'math_verify' needs the math-verify package: pip install 'rlhf-pipeline[tasks]'"
        ) from None
    return math_verify


def math_verify(
    prompt: str,
    response: str,
    label: str | None,
    *,
    float_rounding: int = 6,
    strict: bool = True,
    timeout_s: int = 5,
) -> float:
    """1.0 when Hugging Face's math-verify finds the response's answer equal to the label, else 0.0.

    Both sides are parsed to sympy (LaTeX or plain expressions; the response's last ``\\boxed{}`` first) and compared
    symbolically: ``1+x`` equals ``x+1``, ``\\{2,1\\}`` equals ``\\{1,2\\}``, ``10\\%`` equals ``0.1``, where
    ``math_answer`` compares numbers or normalised text only. A label that is not already LaTeX-delimited is read as
    one LaTeX expression. ``timeout_s`` bounds parsing and comparison (a signal alarm, so only on the main thread;
    elsewhere unbounded)."""
    label = _need_label(label, "math_verify")
    mv = _math_verify_module()

    t = timeout_s if timeout_s and threading.current_thread() is threading.main_thread() else None
    gold_text = label if ("$" in label or "\\boxed" in label) else f"${label}$"
    gold = mv.parse(gold_text, parsing_timeout=t)
    if not gold:
        raise RuleInputError(f"math_verify cannot parse the label {label!r}")
    got = mv.parse(response, parsing_timeout=t)
    if not got:
        return 0.0
    return 1.0 if mv.verify(gold, got, float_rounding=float_rounding, strict=strict, timeout_seconds=t) else 0.0


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
EXTRACT_MODES = ("answer", "boxed", "none")


def reasoning_gym(prompt: str, response: str, label: str | None, *, extract: str = "answer") -> float:
    """The reasoning-gym task's own verifier (``score_answer``, in [0, 1]) for a prompt of ``data.path:
    reasoning_gym:<task>``: the label names the generator and entry (:mod:`rlhf.tasks`), rebuilt here.

    ``extract`` picks the answer out of the response: ``answer`` (the last ``<answer>...</answer>``, reasoning-gym's
    own prompt format; none gives 0.0), ``boxed`` (the last ``\\boxed{}``; none gives 0.0) or ``none`` (the whole
    response, stripped)."""
    label = _need_label(label, "reasoning_gym")
    if extract not in EXTRACT_MODES:
        raise ValueError(f"reasoning_gym: extract must be answer, boxed or none, got {extract!r}")
    try:
        ds, entry = tasks.entry_for_label(label)
    except ValueError as err:
        raise RuleInputError(str(err)) from None
    if extract == "answer":
        found = _ANSWER_TAG.findall(response)
        answer = found[-1].strip() if found else None
    elif extract == "boxed":
        answer = boxed(response)
    else:
        answer = response.strip()
    if answer is None:
        return 0.0
    return float(ds.score_answer(answer, entry))


RULES: dict[str, RuleFn] = {
    "char_fraction": char_fraction,
    "math_answer": math_answer,
    "exact_match": exact_match,
    "regex": regex,
    "length": length,
    "format": format_check,
    "math_verify": math_verify,
    "lcs_ratio": lcs_ratio,
    "reasoning_gym": reasoning_gym,
}


def resolve_rule(name: str) -> RuleFn:
    """A registered rule name, or ``package.module:function`` (imported now, so a typo fails at start-up).

    User modules are imported from the current working directory (plus ``PYTHONPATH`` and installed packages), under
    ``rlhf up`` and ``rlhf serve reward`` alike: ``rlhf up`` starts its services with ``python -m``, which puts the
    working directory first on ``sys.path``, but the ``rlhf`` console script does not, so it is added here.
    """
    if name in RULES:
        return RULES[name]
    if ":" not in name:
        raise ValueError(f"unknown rule {name!r}: use one of {sorted(RULES)} or module:function")
    mod_name, _, fn_name = name.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after installed packages: a stray file in the folder cannot shadow a library
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise ValueError(f"rule {name!r}: cannot import module {mod_name!r}: {err}") from None
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise ValueError(f"rule {name!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn


def accepts_sample(fn: RuleFn) -> bool:
    try:
        return "sample" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def check_kwargs(fn: RuleFn, kwargs: dict, name: str) -> None:
    """Fail at start-up when the config passes kwargs the rule does not take (or misses required ones)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    params = sig.parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kwargs) - set(params) - {"sample"})
    if unknown:
        takes = sorted(set(params) - {"prompt", "response", "label", "sample"})
        raise ValueError(f"rule {name!r} does not take kwargs {unknown}; it takes {takes}")
    missing = [
        p.name for p in params.values() if p.kind == p.KEYWORD_ONLY and p.default is p.empty and p.name not in kwargs
    ]
    if missing:
        raise ValueError(f"rule {name!r} needs kwargs {missing} (reward.scorers[].kwargs)")
