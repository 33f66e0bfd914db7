"""A gsm8k-shaped task and a warm-started tiny policy for tinker-cookbook's ``rl_loop``, whose reward must be able to
rise within ~20 small steps.

The task asks what the recipe's own example asks: "How many r's are in carrot?", over :data:`WORDS` (half of them
have two r's, a quarter one, a quarter three). The warm start (:func:`build_boxed_policy`) teaches the recipe's answer
form on the recipe's exact prompt (the ``role_colon`` rendering of its strawberry example, its question suffix, then
the question), with the boxed number drawn uniformly from :data:`GUESSES`: the form, not the count. The warm-started
policy ends ~90% of its answers with ``\\boxed{n}`` and is right ~20% of the time, so the recipe's groups differ in
reward, and what the counts are is left to RL. Why: docs/tinker.md#the-cookbook-recipes.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from rlhf.tiny import TinyPaths, cached_build, warm_start

# rl_loop's own strings (tinker_cookbook 0.6.1, recipes/rl_loop.py), rendered by its role_colon renderer
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."
EXAMPLE = [
    ("User", "How many r's are in strawberry?" + SUFFIX),
    (
        "Assistant",
        "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r 9) r 10) y. "
        "We have r's at positions 3, 8, and 9. \\boxed{3}",
    ),
]
# "How many r's are in <word>?", as the recipe's own example asks: half the words have two, a quarter one or three
WORDS = {
    "carrot": 2,
    "river": 2,
    "corner": 2,
    "arrow": 2,
    "rower": 2,
    "error": 3,
    "mirror": 3,
    "barrier": 3,
    "horse": 1,
    "bird": 1,
    "paper": 1,
    "tree": 1,
    "parrot": 2,
    "rare": 2,
    "order": 2,
    "terror": 3,
}
GUESSES = range(1, 6)  # the warm start's boxed numbers, drawn uniformly: the form, not the count

STEPS = 100  # about 1 minute on 2 busy cores
BATCH = 8
LR = 3e-3
SEED = 2


def question(rng: random.Random) -> tuple[str, int]:
    """One question and its answer."""
    word = rng.choice(sorted(WORDS))
    return f"How many r's are in {word}?", WORDS[word]


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    """Rows shaped like openai/gsm8k ``main``: ``question``, and ``answer`` ending ``#### <number>``."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        q, count = question(rng)
        rows.append({"question": q, "answer": f"Count the r's: {count}.\n#### {count}"})
    return rows


def prompt_tokens(tokenizer, q: str) -> list[int]:
    """rl_loop's generation prompt for question ``q``, token for token as the role_colon renderer builds it: BOS, then
    per message ``Role:`` and `` content\\n\\n`` encoded apart, then ``Assistant:``."""
    ids = [tokenizer.bos_token_id]
    for role, content in [*EXAMPLE, ("User", q + SUFFIX)]:
        ids += tokenizer.encode(f"{role}:", add_special_tokens=False)
        ids += tokenizer.encode(f" {content}\n\n", add_special_tokens=False)
    return ids + tokenizer.encode("Assistant:", add_special_tokens=False)


def answer_tokens(tokenizer, n: int) -> list[int]:
    """`` \\boxed{n}\\n\\n`` then ``User:``: the answer and the renderer's stop sequence ``\\n\\nUser:``."""
    return tokenizer.encode(f" \\boxed{{{n}}}\n\n", add_special_tokens=False) + tokenizer.encode(
        "User:", add_special_tokens=False
    )


def _example(tokenizer, rng: random.Random) -> tuple[list[int], list[bool]]:
    q, _ = question(rng)
    prompt, answer = prompt_tokens(tokenizer, q), answer_tokens(tokenizer, rng.choice(GUESSES))
    return prompt + answer, [False] * len(prompt) + [True] * len(answer)


def _digest(tiny: TinyPaths) -> str:
    base = json.loads((tiny.root / "tiny.json").read_text())
    what = json.dumps([base, EXAMPLE, SUFFIX, WORDS, list(GUESSES), STEPS, BATCH, LR, SEED])
    return hashlib.sha256(what.encode()).hexdigest()[:16]


def build_boxed_policy(tiny: TinyPaths, force: bool = False) -> Path:
    """The tiny policy warm-started on the answer form, under ``tiny.root/cookbook-gsm8k``; built once per cache."""

    def train(out: Path) -> None:
        rng = random.Random(SEED)
        warm_start(tiny.policy, out, lambda tok: [_example(tok, rng) for _ in range(BATCH)], STEPS, LR, SEED)

    meta = {"digest": _digest(tiny), "steps": STEPS, "batch": BATCH, "lr": LR}
    return cached_build(tiny.root, "cookbook-gsm8k", meta, train, force=force)
