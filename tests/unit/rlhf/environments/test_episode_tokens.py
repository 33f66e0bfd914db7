"""How an episode grows token by token: the model's turn as generated, then the environment's answer as the chat
template renders it after an assistant message (rlhf.environments.tokens.environment_tokens)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rlhf.environments.base import EnvironmentFailure
from rlhf.environments.tokens import environment_tokens, render

# A template whose assistant turn ends "</s>\n" after the content and whose generation prompt is a role tag
TAGGED = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tok(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models.policy)


def test_a_tool_answer_follows_the_turn_as_the_template_renders_it(tok):
    messages = [{"role": "user", "content": "what is 6 times 7"}]
    prompt = render(tok, messages, None, True)
    turn_ids = tok(' <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')["input_ids"]
    turn_ids = list(turn_ids) + [tok.eos_token_id]
    env_ids = environment_tokens(tok, messages, None, turn_ids, [{"role": "tool", "content": "42"}])
    # the template writes "</s>\n" after an assistant message; the turn ended with "</s>" itself: "\n" is the glue
    assert tok.decode(env_ids) == "\nTool: 42\nAssistant:"
    whole = tok.decode(tok(prompt)["input_ids"] + turn_ids + env_ids, skip_special_tokens=False)
    assert whole.endswith("</tool_call></s>\nTool: 42\nAssistant:")


def test_a_turn_cut_by_a_stop_string_gets_the_end_of_turn_as_context(tok):
    tok = tok.__class__.from_pretrained(tok.name_or_path)
    tok.chat_template = TAGGED
    messages = [{"role": "user", "content": "guess"}]
    turn_ids = list(tok("5")["input_ids"])  # no EOS: a stop string ended the turn
    env_ids = environment_tokens(tok, messages, None, turn_ids, [{"role": "user", "content": "higher"}])
    assert tok.decode(env_ids, skip_special_tokens=False) == "</s>\n<|user|>higher</s>\n<|assistant|>"
    with_eos = environment_tokens(
        tok, messages, None, turn_ids + [tok.eos_token_id], [{"role": "user", "content": "x"}]
    )
    assert tok.decode(with_eos, skip_special_tokens=False) == "\n<|user|>x</s>\n<|assistant|>"


def test_a_template_that_cannot_grow_is_an_environment_failure(tok):
    tok = tok.__class__.from_pretrained(tok.name_or_path)
    # renders only the last message: adding the answer rewrites what came before
    tok.chat_template = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    with pytest.raises(EnvironmentFailure, match="prefix"):
        environment_tokens(tok, [{"role": "user", "content": "q"}], None, [5], [{"role": "user", "content": "a"}])
