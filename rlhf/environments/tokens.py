"""How an episode grows token by token (token in, token out): a model turn's ids are kept as generated; only the
environment's messages are tokenised, as the policy's chat template renders them after an assistant message.

What the template writes after an assistant's content that the model did not generate itself (a newline after the
end-of-turn token; the end-of-turn token itself when a stop string ended the turn) goes with the environment's tokens,
so the ids stay exactly what the model saw and produced. Used by the rollout replica's episodes and by anything that
builds episode token sequences offline (the tiny tool-use policy's warm start, tests).
"""

from __future__ import annotations

from typing import Any

from rlhf.environments.base import EnvironmentFailure, Message

# Replaces an assistant message's content while finding what the chat template writes around it; no template
# changes or strips this text, and no model output contains it.
_SENTINEL = "\u2063rlhf-assistant-turn\u2063"


def render(tokenizer: Any, messages: list[Message], tools: list[dict] | None, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids)


def environment_tokens(
    tokenizer: Any,
    messages: list[Message],
    tools: list[dict] | None,
    turn_ids: list[int],
    answer: list[Message],
) -> list[int]:
    """The ids that follow a model turn (``turn_ids``, as generated) when the environment answers ``answer``: what
    the template writes after an assistant message's content that the turn did not end with itself, then the
    answer's messages and the next generation prompt, as the template renders them."""
    turn = {"role": "assistant", "content": _SENTINEL}
    before = render(tokenizer, [*messages, turn], tools, False)
    after = render(tokenizer, [*messages, turn, *answer], tools, True)
    if not after.startswith(before) or _SENTINEL not in before:
        raise EnvironmentFailure(
            "the chat template does not render the conversation as a prefix of itself once the environment's "
            "messages are added, so the episode cannot grow token by token (is the environment's message role one "
            "the template knows?)"
        )
    template_tail = before[before.rindex(_SENTINEL) + len(_SENTINEL) :]  # e.g. "<eos>\n" after the content
    with_special = tokenizer.decode(turn_ids, skip_special_tokens=False)
    plain = tokenizer.decode(turn_ids, skip_special_tokens=True)
    generated_tail = with_special[len(plain) :] if with_special.startswith(plain) else ""  # e.g. "<eos>"
    glue = template_tail[len(generated_tail) :] if template_tail.startswith(generated_tail) else template_tail
    return encode(tokenizer, glue + after[len(before) :])
