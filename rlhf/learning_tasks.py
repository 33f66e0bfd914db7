"""Two small tasks that prove learning (``make converge``): problems, held-out split, warm starts.

``reverse_words`` ("reverse: cat dog sun" -> "sun dog cat", partial credit by ``lcs_ratio``) and ``addition`` ("what
is 7 plus 12?" -> "19", ``math_verify``). A problem is held out by a hash of its prompt: ``builtin:<task>`` is the
training split, ``builtin:<task>/heldout`` the held-out one. ``tiny:<task>`` is the tiny policy warm-started on a
demonstrator that is right only part of the time (built once per cache and stamped). Design and curves:
docs/learning.md.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlhf.prompts import encode_prompt
from rlhf.tiny import CHAT_TEMPLATE, WORDS, TinySpec, build_tiny, cached_build, warm_start

REVERSE_VOCAB = WORDS[:16]


def _reverse(rng: random.Random, longest: int = 5) -> tuple[str, str]:
    words = [rng.choice(REVERSE_VOCAB) for _ in range(rng.randint(2, longest))]
    return "reverse: " + " ".join(words), " ".join(reversed(words))


def _addition(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    return f"what is {a} plus {b}?", str(a + b)


def _copy_words(prompt: str, answer: str) -> str:
    return prompt.removeprefix("reverse: ")


def _negated(prompt: str, answer: str) -> str:
    return "-" + answer


@dataclass(frozen=True)
class Task:
    name: str
    draw: Callable[[random.Random], tuple[str, str]]  # one random problem: (prompt, answer)
    heldout_mod: int  # a prompt is held out when its hash is 0 modulo this
    heldout_size: int
    warm_steps: int  # supervised warm-start steps (batch WARM_BATCH, lr WARM_LR)
    # the warm start imitates a demonstrator right with probability warm_right, else giving slip(prompt, answer)
    warm_right: float
    slip: Callable[[str, str], str]
    size: tuple[tuple[str, int], ...] = ()  # TinySpec fields over the default (the model size that learns it)

    def is_heldout(self, prompt: str) -> bool:
        return int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % self.heldout_mod == 0

    def problem(self, rng: random.Random, heldout: bool) -> tuple[str, str]:
        while True:
            prompt, answer = self.draw(rng)
            if self.is_heldout(prompt) == heldout:
                return prompt, answer

    def rows(self, split: str, n: int = 512, seed: int = 0) -> list[dict[str, str]]:
        """``train``: ``n`` problems drawn with ``seed`` (repeats allowed); ``heldout``: the first ``heldout_size``
        distinct held-out problems of a fixed draw."""
        rng = random.Random(seed)
        if split == "train":
            return [dict(zip(("prompt", "label"), self.problem(rng, False), strict=True)) for _ in range(n)]
        rng, seen, rows = random.Random(12345), set(), []
        while len(rows) < self.heldout_size:
            prompt, answer = self.problem(rng, True)
            if prompt not in seen:
                seen.add(prompt)
                rows.append({"prompt": prompt, "label": answer})
        return rows


TASKS: dict[str, Task] = {
    # 16^2 + 16^3 + 16^4 prompts: a one-in-8 hash leaves thousands held out
    # the demonstrator copies the words instead of reversing them 60% of the time
    "reverse_words": Task(
        "reverse_words", lambda r: _reverse(r, 4), 8, 64, warm_steps=2000, warm_right=0.4, slip=_copy_words
    ),
    # 441 prompts, of which about 110 held out (one in 4); the demonstrator gets the sign wrong half of the time
    "addition": Task("addition", _addition, 4, 64, warm_steps=4000, warm_right=0.5, slip=_negated),
}

WARM_BATCH = 16
WARM_LR = 3e-3
WARM_SEED = 1
PROMPT_TOKENS = 64


def builtin_rows(name: str) -> list[dict[str, str]] | None:
    """``builtin:<task>`` / ``builtin:<task>/heldout`` rows, or None when ``name`` is no task of this module."""
    task, _, split = name.partition("/")
    if task not in TASKS or split not in ("", "heldout"):
        return None
    return TASKS[task].rows(split or "train")


def _digest(task: Task, spec: TinySpec) -> str:
    what = [
        spec.digest(),
        CHAT_TEMPLATE,
        task.name,
        task.warm_steps,
        task.warm_right,
        task.slip(*task.draw(random.Random(0))),
        task.size,
        WARM_BATCH,
        WARM_LR,
        WARM_SEED,
        REVERSE_VOCAB,
    ]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def demonstration(task: Task, rng: random.Random) -> tuple[str, str]:
    """One warm-start example: a training problem and the demonstrator's answer, right with probability
    ``task.warm_right`` (RL then has to learn to prefer the right behaviour the warm start already holds)."""
    prompt, answer = task.problem(rng, heldout=False)
    return prompt, answer if rng.random() < task.warm_right else task.slip(prompt, answer)


def _warm_start(task: Task, policy: Path, out: Path) -> None:
    rng = random.Random(WARM_SEED)

    def example(tok) -> tuple[list[int], list[bool]]:
        prompt, answer = demonstration(task, rng)
        ids = encode_prompt(tok, prompt, PROMPT_TOKENS)
        reply = tok(" " + answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return ids + reply, [False] * len(ids) + [True] * len(reply)

    warm_start(policy, out, lambda tok: [example(tok) for _ in range(WARM_BATCH)], task.warm_steps, WARM_LR, WARM_SEED)


def build_warm(cache: str | Path, task_name: str, force: bool = False) -> Path:
    """The policy warm-started on ``task_name``: ``cache/warm-<task>/policy`` (a tiny model of the task's size, built
    first beside it) after the warm start, reused when current."""
    task = TASKS[task_name]
    spec = TinySpec(**dict(task.size))
    paths = build_tiny(Path(cache) / f"warm-{task.name}", spec)
    meta = {"digest": _digest(task, spec), "task": task.name, "steps": task.warm_steps}
    return cached_build(paths.root, "warm", meta, lambda out: _warm_start(task, paths.policy, out), force=force)
