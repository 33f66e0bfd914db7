"""Data as the seeds give it: ``map_keys`` as MindSpeed-LLM reads an Alpaca-style file (prompt + query joined by a
newline, a per-row system prompt, label / response), and MindSpeed's preprocessed prompt data (a Megatron indexed
``.bin``/``.idx`` prefix, written here by an independent writer of that format)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from rlhf.config import ConfigError, DataConfig, parse_config
from rlhf.data import PromptRecord, load_prompts, record_prompt_ids

ROWS = [
    {
        "instruction": "Translate to French",
        "input": "good morning",
        "sys": "You are a translator.",
        "output": "bonjour",
    },
    {"instruction": "Say hello", "input": "", "sys": "", "output": "hello"},
]


def _jsonl(tmp_path, rows):
    path = tmp_path / "alpaca.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_alpaca_map_keys_join_prompt_and_query_and_take_the_rows_system_prompt(tmp_path):
    cfg = DataConfig(
        path=_jsonl(tmp_path, ROWS),
        map_keys={"prompt": "instruction", "query": "input", "system": "sys", "response": "output"},
        system="default system",
    )
    got = load_prompts(cfg)
    # MindSpeed-LLM convert_alpaca_to_intermediate: "\n".join of the prompt and query cells that are non-empty
    assert [r.prompt for r in got] == ["Translate to French\ngood morning", "Say hello"]
    assert [r.system for r in got] == ["You are a translator.", "default system"]  # empty cell: data.system
    assert [r.label for r in got] == ["bonjour", "hello"]  # no label column: the response is the label


def test_seed_000_map_keys_with_empty_columns_mean_not_used(tmp_path):
    # seed 000: --map-keys '{"prompt":"prompt", "query":"", "response": "prompt", "system":""}'
    rows = [{"prompt": "describe a cat", "label": "x"}]
    cfg = DataConfig(
        path=_jsonl(tmp_path, rows), map_keys={"prompt": "prompt", "query": "", "response": "prompt", "system": ""}
    )
    (r,) = load_prompts(cfg)
    assert (r.prompt, r.system, r.label) == ("describe a cat", None, "x")  # a label column wins over response


def test_map_keys_errors_name_the_key(tmp_path):
    path = _jsonl(tmp_path, ROWS)
    with pytest.raises(ConfigError, match="data.map_keys.query: row 0 .* no column 'question'"):
        load_prompts(DataConfig(path=path, map_keys={"prompt": "instruction", "query": "question"}))
    with pytest.raises(ConfigError, match="data.map_keys.system: row 0 .* no column 'sys_prompt'"):
        load_prompts(DataConfig(path=path, map_keys={"prompt": "instruction", "system": "sys_prompt"}))
    with pytest.raises(ConfigError, match="data.map_keys.tools: unknown key; use any of prompt, query, system"):
        parse_config({"data": {"map_keys": {"prompt": "p", "tools": "t"}}})
    with pytest.raises(ConfigError, match="data.map_keys.history: multi-turn history rows are not supported"):
        parse_config({"data": {"map_keys": {"prompt": "p", "history": "h"}}})


def test_the_record_system_prompt_goes_through_the_chat_template():
    class Tok:
        chat_template = "yes"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            self.seen = messages
            return [1, 2, 3]

    tok = Tok()
    record_prompt_ids(tok, PromptRecord(0, "hi", None, system="be brief"), 16)
    assert tok.seen == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


# ---------------------------------------------------------------- Megatron indexed data (MindSpeed preprocess_data)
DTYPE_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}


def write_indexed(prefix: str, documents: list[list[list[int]]], dtype=np.int32) -> None:
    """Megatron's IndexedDatasetBuilder output, written from the format's description: each document a list of
    sequences; .bin the tokens back to back, .idx the header, lengths, byte pointers and document indices."""
    lengths, pointers, doc_index, offset = [], [], [0], 0
    with open(prefix + ".bin", "wb") as out:
        for doc in documents:
            for seq in doc:
                raw = np.asarray(seq, dtype=dtype).tobytes()
                out.write(raw)
                lengths.append(len(seq))
                pointers.append(offset)
                offset += len(raw)
            doc_index.append(len(lengths))
    with open(prefix + ".idx", "wb") as out:
        out.write(b"MMIDIDX\x00\x00")
        out.write(struct.pack("<Q", 1))
        out.write(struct.pack("<B", DTYPE_CODES[dtype]))
        out.write(struct.pack("<Q", len(lengths)))
        out.write(struct.pack("<Q", len(doc_index)))
        out.write(np.asarray(lengths, np.int32).tobytes())
        out.write(np.asarray(pointers, np.int64).tobytes())
        out.write(np.asarray(doc_index, np.int64).tobytes())


def test_mindspeed_preprocessed_prefix_is_read_as_prompt_ids(tmp_path):
    prefix = str(tmp_path / "alpaca")  # seed 004's data_path names the prefix; the files carry MindSpeed's suffix
    docs = [[[128000, 882, 271, 9906]], [[128000, 15339]], [[1, 2, 3]]]
    write_indexed(prefix + "_packed_input_ids_document", docs)
    write_indexed(prefix + "_packed_attention_mask_document", [[[1] * len(d[0])] for d in docs])
    cfg = parse_config(
        {"actor_rollout_ref": {"actor_rollout": {"data_path": prefix}}, "data": {"path": prefix, "shuffle": False}}
    )
    records = load_prompts(cfg.data)
    assert [r.prompt_ids for r in records] == [(128000, 882, 271, 9906), (128000, 15339), (1, 2, 3)]
    assert all(r.prompt == "" and r.label is None for r in records)
    # used as they are (MindSpeed templated them already), only left-truncated; no tokenizer is needed
    assert record_prompt_ids(None, records[0], max_prompt_length=3) == [882, 271, 9906]
    assert len(load_prompts(DataConfig(path=prefix, max_samples=2))) == 2
    with pytest.raises(ConfigError, match="data.map_keys.query: .* is a Megatron indexed data set"):
        load_prompts(DataConfig(path=prefix, map_keys={"prompt": "prompt", "query": "input"}))


def test_an_indexed_file_named_directly_with_uint16_and_multi_sequence_documents(tmp_path):
    prefix = str(tmp_path / "plain_text_document")
    write_indexed(prefix, [[[5, 6], [7]], [[8]]], dtype=np.uint16)
    for path in (prefix, prefix + ".bin", prefix + ".idx"):
        assert [r.prompt_ids for r in load_prompts(DataConfig(path=path))] == [(5, 6, 7), (8,)]


def test_broken_indexed_files_are_config_errors(tmp_path):
    prefix = str(tmp_path / "d")
    write_indexed(prefix, [[[1, 2, 3]]])
    idx = tmp_path / "d.idx"
    good = idx.read_bytes()
    idx.write_bytes(b"NOTMAGIC!" + good[9:])
    with pytest.raises(ConfigError, match="data.path: .*d.idx is not a Megatron indexed data set"):
        load_prompts(DataConfig(path=prefix))
    idx.write_bytes(good[:-8])
    with pytest.raises(ConfigError, match="cut short"):
        load_prompts(DataConfig(path=prefix))
    idx.write_bytes(good)
    (tmp_path / "d.bin").write_bytes(b"\x00" * 4)
    with pytest.raises(ConfigError, match="shorter than its index says"):
        load_prompts(DataConfig(path=prefix))
    with pytest.raises(ConfigError, match="looked for .*nothing_packed_input_ids_document.bin/.idx"):
        load_prompts(DataConfig(path=str(tmp_path / "nothing")))
    (tmp_path / "prompts.csv").write_text("prompt\nhi\n")
    with pytest.raises(ConfigError, match="prompts.csv must end in .jsonl, .json or .parquet"):
        load_prompts(DataConfig(path=str(tmp_path / "prompts.csv")))


def test_parquet_still_loads_with_the_key_map(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    got = load_prompts(DataConfig(path=str(path), map_keys={"prompt": "instruction", "query": "input"}))
    assert [r.prompt for r in got] == ["Translate to French\ngood morning", "Say hello"]
