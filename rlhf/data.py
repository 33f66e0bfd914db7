"""Prompt data sets: jsonl and parquet files with a key map (the seeds' ``--map-keys``), chat templates, and a
built-in arithmetic set for the demo.

A record is ``{"prompt": str, "label": str | None}`` after key mapping. The data set yields token ids ready for
generation: chat-templated when the tokenizer has a template, truncated from the left to ``max_prompt_length``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from rlhf.config import ConfigError, DataConfig


@dataclass(frozen=True)
class PromptRecord:
    index: int
    prompt: str
    label: str | None


def builtin_arithmetic(n: int = 512, seed: int = 0) -> list[dict[str, str]]:
    """Two-number additions with their answers; deterministic for a seed."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"prompt": f"what is {a} plus {b}?", "label": str(a + b)})
    return rows


def _read_rows(path: str, key: str = "data.path") -> list[dict]:
    if path.startswith("builtin:"):
        name = path.split(":", 1)[1]
        if name != "arithmetic":
            raise ConfigError(f"{key}: unknown built-in data set {name!r} (known: builtin:arithmetic)")
        return builtin_arithmetic()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}: {path} does not exist")
    if p.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise ConfigError(f"{key}: {path} line {n} is not JSON: {err.msg}") from None
        return rows
    if p.suffix == ".json":
        # a JSON array of records; a file of one record per line (seed 001's queries.json) is read as JSON lines
        text = p.read_text()
        try:
            rows = json.loads(text)
        except json.JSONDecodeError:
            rows = None
        if rows is None:
            rows = []
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ConfigError(
                            f"{key}: {path} is neither a JSON array nor JSON lines (line {n}: {err.msg})"
                        ) from None
        elif isinstance(rows, dict):
            rows = [rows]
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"{key}: {path} must hold a JSON array of objects (records)")
        return rows
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{key}: reading parquet needs pyarrow (pip install pyarrow)") from None
        return pq.read_table(p).to_pylist()
    raise ConfigError(f"{key}: {path} must end in .jsonl, .json or .parquet")


def load_prompts(cfg: DataConfig) -> list[PromptRecord]:
    """Read the data set and apply the key map; raises ConfigError naming a missing column."""
    rows = _read_rows(cfg.path)
    prompt_key = cfg.map_keys.get("prompt", "prompt")
    label_key = cfg.map_keys.get("label", "label")
    records = []
    for i, row in enumerate(rows[: cfg.max_samples] if cfg.max_samples else rows):
        if prompt_key not in row:
            raise ConfigError(f"data.map_keys.prompt: row {i} of {cfg.path} has no column {prompt_key!r}")
        label = row.get(label_key)
        records.append(PromptRecord(index=i, prompt=str(row[prompt_key]), label=None if label is None else str(label)))
    if not records:
        raise ConfigError(f"data.path: {cfg.path} holds no prompts")
    return records


def load_texts(cfg: DataConfig) -> list[str]:
    """The PPO-ptx SFT texts of ``data.pretrain_data`` (column ``map_keys.text``); ConfigError naming a bad row."""
    if cfg.pretrain_data is None:
        raise ConfigError("data.pretrain_data is not set")
    key = cfg.map_keys.get("text", "text")
    texts = []
    for i, row in enumerate(_read_rows(cfg.pretrain_data, "data.pretrain_data")):
        if key not in row:
            raise ConfigError(f"data.map_keys.text: row {i} of {cfg.pretrain_data} has no column {key!r}")
        texts.append(str(row[key]))
    if not texts:
        raise ConfigError(f"data.pretrain_data: {cfg.pretrain_data} holds no texts")
    return texts


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


class PromptCursor:
    """Walks the data set epoch by epoch in a seeded order; its position is part of a checkpoint."""

    def __init__(self, records: list[PromptRecord], seed: int, shuffle: bool, epoch: int = 0, offset: int = 0):
        self.records, self.seed, self.shuffle = records, seed, shuffle
        self.epoch, self.offset = epoch, offset
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(order)
        return order

    def next(self) -> tuple[int, PromptRecord]:
        """The next (epoch, record)."""
        if self.offset >= len(self._order):
            self.epoch, self.offset = self.epoch + 1, 0
            self._order = self._make_order()
        record = self.records[self._order[self.offset]]
        self.offset += 1
        return self.epoch, record

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}
