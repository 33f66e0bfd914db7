"""A prompt text -> the token ids a policy generates from: chat-templated when the tokenizer has a template.

Apart from :mod:`rlhf.data` (which re-exports it) so that what builds prompts without a data set, the learning
tasks' warm start, imports no data loading."""

from __future__ import annotations


def encode_prompt(tokenizer, text: str, max_prompt_length: int, chat: bool = True, system: str | None = None):
    """Token ids of one prompt, chat-templated when asked and available, left-truncated to ``max_prompt_length``."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
    return list(ids)[-max_prompt_length:]
