"""``tiny:tools``: the tiny policy after a short supervised warm start on calculator episodes (the tool-use demo).

Taught with whole episodes of ``builtin:calculator`` (``list_tools: false``, :data:`SYSTEM`), built exactly as a
rollout replica builds them (:mod:`rlhf.environments.tokens`), with the loss on the model's turns only, for
:data:`STEPS` steps. Built once per cache, under the same lock and stamp scheme as :func:`rlhf.tiny.build_tiny`.

Why so short a warm start, and what it gives: docs/environments.md#the-demo-configsdemo-toolsyaml.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from rlhf.environments.builtin import Calculator
from rlhf.environments.tokens import encode, environment_tokens, render
from rlhf.tiny import CHAT_TEMPLATE, TinySpec, build_tiny, cached_build, warm_start

SYSTEM = "Use the calculator: <tool_call>{json}</tool_call>, then answer."
STEPS = 250
BATCH = 16
LR = 3e-3
SEED = 1


def _digest(spec: TinySpec) -> str:
    what = json.dumps([spec.digest(), CHAT_TEMPLATE, SYSTEM, STEPS, BATCH, LR, SEED])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def episode_tokens(tokenizer, a: int, b: int) -> tuple[list[int], list[bool]]:
    """One taught episode of "what is a plus b?": (ids, loss mask) over the whole sequence, prompt included."""
    env = Calculator(system=SYSTEM, list_tools=False)
    opening = env.reset([{"role": "user", "content": f"what is {a} plus {b}?"}], str(a + b), {}, None)
    messages = opening.messages
    prompt = encode(tokenizer, render(tokenizer, messages, None, True))
    args = json.dumps({"expression": f"{a} + {b}"})
    call = f' <tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>'
    turn1 = encode(tokenizer, call) + [tokenizer.eos_token_id]
    outcome = env.step(call)
    between = environment_tokens(tokenizer, messages, None, turn1, outcome.messages)
    turn2 = encode(tokenizer, f" {a + b}") + [tokenizer.eos_token_id]
    ids = prompt + turn1 + between + turn2
    mask = [False] * len(prompt) + [True] * len(turn1) + [False] * len(between) + [True] * len(turn2)
    return ids, mask


def _train(policy: Path, out: Path) -> None:
    rng = random.Random(SEED)
    warm_start(
        policy,
        out,
        lambda tok: [episode_tokens(tok, rng.randint(0, 20), rng.randint(0, 20)) for _ in range(BATCH)],
        STEPS,
        LR,
        SEED,
    )


def build_tiny_tools(out_dir: str | Path, spec: TinySpec | None = None, force: bool = False) -> Path:
    """The warm-started policy under ``out_dir/tools`` (the tiny models of ``spec`` built first), reused when
    current."""
    spec = spec or TinySpec()
    paths = build_tiny(out_dir, spec)
    meta = {"digest": _digest(spec), "steps": STEPS, "system": SYSTEM}
    return cached_build(paths.root, "tools", meta, lambda out: _train(paths.policy, out), force=force)
