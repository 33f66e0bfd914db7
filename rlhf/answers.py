"""Reading a final answer out of a response: the last ``\\boxed{}``, else the last number; compared with a reference
as numbers when both are one (``1,234``, ``3/4``, ``\\frac{3}{4}``), else as normalised text. One reading for the
reward service's ``math_answer`` rule and the environments that judge an answer (``builtin:calculator``)."""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")


def boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    out = []
    while i < len(text):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return "".join(out).strip()
        out.append(ch)
        i += 1
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: the last ``\\boxed{}``, else the last number, else None."""
    found = boxed(text)
    if found is not None:
        return found
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def as_number(text: str | None) -> float | None:
    """``"1,234"`` -> 1234.0; ``"3/4"`` and ``"\\frac{3}{4}"`` -> 0.75; anything else that is not one number -> None."""
    if text is None:
        return None
    t = text.strip().replace(",", "").replace("$", "").rstrip(".").strip()
    try:
        return float(t)
    except ValueError:
        pass
    m = re.fullmatch(r"\\d?frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", t) or re.fullmatch(
        r"(-?\d+(?:\.\d+)?)\s*/\s*(-?\d+(?:\.\d+)?)", t
    )
    if m:
        try:
            return float(m.group(1)) / float(m.group(2))
        except ZeroDivisionError:
            return None
    return None


def normalize(text: str) -> str:
    return " ".join(text.strip().lower().split()).rstrip(".")


def answers_match(response: str, label: str, tolerance: float = 1e-6) -> bool:
    """Whether the response's final answer equals the label's (the label's own final answer, else the whole label):
    as numbers within ``tolerance`` when both read as one, else as normalised text. No answer: False."""
    got = extract_answer(response)
    if got is None:
        return False
    want = extract_answer(label) or label
    a, b = as_number(got), as_number(want)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=tolerance, abs_tol=tolerance)
    return normalize(got) == normalize(want)
