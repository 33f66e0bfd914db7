"""``.json`` data files (seed 001 reads queries.json): a JSON array of records, or one record per line."""

from __future__ import annotations

import json

import pytest

from rlhf.config import ConfigError, DataConfig
from rlhf.data import PromptCursor, encode_prompt, load_prompts, load_texts


def test_a_json_array_and_json_lines_both_load_with_the_key_map(tmp_path):
    rows = [{"query": "what is 2 plus 2?", "answer": 4}, {"query": "say hello", "answer": None}]
    array, lines = tmp_path / "a.json", tmp_path / "queries.json"
    array.write_text(json.dumps(rows))
    lines.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    for path in (array, lines):
        got = load_prompts(DataConfig(path=str(path), map_keys={"prompt": "query", "label": "answer"}))
        assert [(r.prompt, r.label) for r in got] == [("what is 2 plus 2?", "4"), ("say hello", None)]


def test_bad_json_files_are_config_errors_naming_the_key(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match="data.path: .* neither a JSON array nor JSON lines \\(line 2"):
        load_prompts(DataConfig(path=str(bad)))
    scalars = tmp_path / "scalars.json"
    scalars.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON array of objects"):
        load_prompts(DataConfig(path=str(scalars)))
    texts = tmp_path / "t.json"
    texts.write_text(json.dumps([{"body": "x"}]))
    with pytest.raises(ConfigError, match="data.map_keys.text: row 0 .* no column 'text'"):
        load_texts(DataConfig(pretrain_data=str(texts)))
    assert load_texts(DataConfig(pretrain_data=str(texts), map_keys={"text": "body"})) == ["x"]


def test_max_samples_shuffle_and_system_message():
    records = load_prompts(DataConfig(max_samples=5))
    assert [r.index for r in records] == [0, 1, 2, 3, 4]
    plain = PromptCursor(records, seed=1, shuffle=False)
    assert [plain.next()[1].index for _ in range(5)] == [0, 1, 2, 3, 4]
    shuffled = PromptCursor(records, seed=1, shuffle=True)
    order = [shuffled.next()[1].index for _ in range(5)]
    assert sorted(order) == [0, 1, 2, 3, 4] and order != [0, 1, 2, 3, 4]

    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return [len(m["content"]) for m in messages]

    assert encode_prompt(Tok(), "four", 10, system="sys") == [3, 4]
    assert encode_prompt(Tok(), "four", 10) == [4]


def test_a_max_tokens_column_gives_each_row_its_length_cap(tmp_path):
    rows = [{"prompt": "a", "n": 16}, {"prompt": "b", "n": 200}]
    path = tmp_path / "lengths.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = load_prompts(DataConfig(path=str(path), map_keys={"prompt": "prompt", "max_tokens": "n"}))
    assert [r.max_tokens for r in got] == [16, 200]
    assert [r.max_tokens for r in load_prompts(DataConfig(path=str(path)))] == [None, None]  # not mapped: unused
    for bad in (0, 2.5, "16", True):
        path.write_text(json.dumps({"prompt": "a", "n": bad}) + "\n")
        with pytest.raises(ConfigError, match="data.map_keys.max_tokens: row 0 .* whole number of tokens >= 1"):
            load_prompts(DataConfig(path=str(path), map_keys={"prompt": "prompt", "max_tokens": "n"}))
    with pytest.raises(ConfigError, match="data.map_keys.max_tokens: row 0 of builtin:arithmetic has no column 'n'"):
        load_prompts(DataConfig(path="builtin:arithmetic", map_keys={"prompt": "prompt", "max_tokens": "n"}))
