"""Prompt data sets: jsonl, json and parquet files with a key map (the seeds' ``--map-keys``), Megatron indexed
data sets (MindSpeed-LLM's preprocessed ``.bin``/``.idx``), reasoning-gym generators, chat templates, a built-in
arithmetic set for the demo and the learning tasks' splits (``builtin:<task>[/heldout]``, rlhf.learning_tasks).

A record is a prompt text (or, from an indexed data set, prompt token ids used as they are), an optional label and an
optional per-row system prompt. The data set yields token ids ready for generation: chat-templated when the tokenizer
has a template (text prompts only), truncated from the left to ``max_prompt_length``.
"""

from __future__ import annotations

import difflib
import json
import random
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rlhf import tasks
from rlhf.config import ConfigError, DataConfig
from rlhf.learning_tasks import TASKS, builtin_rows
from rlhf.prompts import encode_prompt


@dataclass(frozen=True)
class PromptRecord:
    index: int
    prompt: str  # "" for an indexed data set's record (the rollout decodes prompt_ids for the reward's text)
    label: str | None
    system: str | None = None  # the row's system prompt, else data.system
    prompt_ids: tuple[int, ...] | None = None  # token ids as preprocessed (already templated): used as they are
    max_tokens: int | None = None  # the row's own cap on new tokens (data.map_keys.max_tokens), else the config's


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
        if name == "arithmetic":
            return builtin_arithmetic()
        rows = builtin_rows(name)
        if rows is None:
            known = ["builtin:arithmetic"] + [f"builtin:{t}[/heldout]" for t in TASKS]
            raise ConfigError(f"{key}: unknown built-in data set {name!r} (known: {', '.join(known)})")
        return rows
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
            return pq.read_table(p).to_pylist()
        except pa.ArrowException as err:
            raise ConfigError(f"{key}: {path} is not a readable parquet file: {err}") from None
    raise ConfigError(f"{key}: {path} must end in .jsonl, .json or .parquet")


# ------------------------------------------------------------------------------ Megatron indexed data sets
# The format of Megatron-LM's megatron/core/datasets/indexed_dataset.py (MindSpeed-LLM's preprocess_data.py writes it
# through that module): <prefix>.idx holds a 9-byte magic, a little-endian u64 version (1), a u8 dtype code, u64
# sequence and document counts, then int32 sequence lengths, int64 byte offsets of each sequence in <prefix>.bin, and
# int64 document indices (sequence numbers where documents start, beginning 0 and ending at the sequence count).
INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
# MindSpeed's PPO/R1 prompt handlers write <output-prefix>_packed_input_ids_document.{bin,idx}; the seeds' data_path
# names <output-prefix>.
MINDSPEED_PROMPT_SUFFIX = "_packed_input_ids_document"


class IndexedDataset:
    """A read-only Megatron indexed data set: ``documents()`` yields each document's token ids (its sequences
    joined). Raises ConfigError (naming ``key``) for a file that is not one or is cut short."""

    def __init__(self, prefix: str, key: str = "data.path"):
        self.prefix, idx_path, bin_path = prefix, Path(prefix + ".idx"), Path(prefix + ".bin")
        raw = idx_path.read_bytes()
        head = len(INDEX_MAGIC) + 8 + 1 + 8 + 8
        if len(raw) < head or raw[: len(INDEX_MAGIC)] != INDEX_MAGIC:
            raise ConfigError(f"{key}: {idx_path} is not a Megatron indexed data set (no MMIDIDX header)")
        off = len(INDEX_MAGIC)
        (version,) = struct.unpack_from("<Q", raw, off)
        (code,) = struct.unpack_from("<B", raw, off + 8)
        n_seq, n_doc = struct.unpack_from("<QQ", raw, off + 9)
        if version != 1:
            raise ConfigError(f"{key}: {idx_path} has index version {version}; only version 1 is read")
        if code not in INDEX_DTYPES:
            raise ConfigError(f"{key}: {idx_path} has an unknown dtype code {code}")
        self.dtype = np.dtype(INDEX_DTYPES[code])
        need = head + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if len(raw) < need:
            raise ConfigError(f"{key}: {idx_path} is cut short ({len(raw)} bytes, its counts need {need})")
        self.lengths = np.frombuffer(raw, np.int32, n_seq, head)
        self.pointers = np.frombuffer(raw, np.int64, n_seq, head + 4 * n_seq)
        self.doc_index = np.frombuffer(raw, np.int64, n_doc, head + 12 * n_seq)
        if n_doc == 0 or self.doc_index[0] != 0 or self.doc_index[-1] != n_seq or np.any(np.diff(self.doc_index) < 0):
            raise ConfigError(f"{key}: {idx_path} has a malformed document index")
        self.data = np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_path.stat().st_size else np.zeros(0, np.uint8)
        ends = self.pointers + self.lengths.astype(np.int64) * self.dtype.itemsize
        if n_seq and (np.any(self.lengths < 0) or int(ends.max()) > len(self.data)):
            raise ConfigError(f"{key}: {bin_path} is shorter than its index says ({len(self.data)} bytes)")

    def __len__(self) -> int:
        return len(self.doc_index) - 1

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.pointers[i])
        return self.data[start : start + int(self.lengths[i]) * self.dtype.itemsize].view(self.dtype)

    def document(self, d: int) -> list[int]:
        seqs = range(int(self.doc_index[d]), int(self.doc_index[d + 1]))
        return [int(t) for i in seqs for t in self.sequence(i)]


def indexed_prefix(path: str) -> str | None:
    """The indexed data set ``path`` names: ``<p>.bin``/``<p>.idx``/``<p>`` itself, or MindSpeed's
    ``<p>_packed_input_ids_document`` (the seeds' ``data_path``); None when there is none."""
    p = path[:-4] if path.endswith((".bin", ".idx")) else path
    for cand in (p + MINDSPEED_PROMPT_SUFFIX, p):
        if Path(cand + ".idx").is_file() and Path(cand + ".bin").is_file():
            return cand
    return None


def _indexed_records(cfg: DataConfig, prefix: str) -> list[PromptRecord]:
    ds = IndexedDataset(prefix)
    n = min(len(ds), cfg.max_samples) if cfg.max_samples else len(ds)
    records = []
    for d in range(n):
        ids = ds.document(d)
        if not ids:
            raise ConfigError(f"data.path: document {d} of {prefix}.bin is empty")
        records.append(PromptRecord(index=d, prompt="", label=None, system=cfg.system, prompt_ids=tuple(ids)))
    return records


# ------------------------------------------------------------------------------ reasoning-gym generators
def _generator_records(cfg: DataConfig) -> list[PromptRecord]:
    task = cfg.path.split(":", 1)[1]
    try:
        known = tasks.task_names()
    except ImportError as err:
        raise ConfigError(f"data.path: {cfg.path}: {err}") from None
    if task not in known:
        close = difflib.get_close_matches(task, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else f" ({len(known)} tasks, e.g. {', '.join(known[:8])})"
        raise ConfigError(f"data.path: unknown reasoning-gym task {task!r}{hint}")
    opts = dict(cfg.generator_options)
    try:
        ds = tasks.generator(task, cfg.generator_seed, cfg.generator_size, opts)
    except Exception as err:  # noqa: BLE001 - a task's config raises TypeError, ValueError or AssertionError
        raise ConfigError(f"data.generator_options: reasoning-gym task {task!r} refuses {opts}: {err}") from None
    n = min(cfg.generator_size, cfg.max_samples) if cfg.max_samples else cfg.generator_size
    records = []
    for i in range(n):
        entry = ds[i]
        label = tasks.make_label(task, cfg.generator_seed, cfg.generator_size, opts, i, entry["answer"])
        records.append(PromptRecord(index=i, prompt=str(entry["question"]), label=label, system=cfg.system))
    return records


# ------------------------------------------------------------------------------ rows with a key map
def _column(row: dict, key: str, column: str, i: int, path: str):
    if column not in row:
        raise ConfigError(f"data.map_keys.{key}: row {i} of {path} has no column {column!r}")
    return row[column]


def _row_record(cfg: DataConfig, row: dict, i: int) -> PromptRecord:
    """One row through ``data.map_keys``, as MindSpeed-LLM's Alpaca conversion does it: the user message is the
    prompt and the query (each when non-empty) joined by a newline; the system column, when mapped, is the row's
    system prompt; an empty column name in the map means the key is not used."""
    keys = cfg.map_keys
    parts = [_column(row, "prompt", keys.get("prompt", "prompt"), i, cfg.path)]
    if keys.get("query"):
        parts.append(_column(row, "query", keys["query"], i, cfg.path))
    prompt = "\n".join(str(p) for p in parts if p not in (None, ""))
    if not prompt:
        raise ConfigError(f"data.map_keys.prompt: row {i} of {cfg.path} has an empty prompt")
    system = cfg.system
    if keys.get("system"):
        value = _column(row, "system", keys["system"], i, cfg.path)
        system = str(value) if value not in (None, "") else cfg.system
    label_col = keys.get("label", "label")
    label = row.get(label_col) if label_col else None
    if label is None and keys.get("response"):
        label = _column(row, "response", keys["response"], i, cfg.path)
    if label is not None and not isinstance(label, str):
        label = json.dumps(label) if isinstance(label, dict | list) else str(label)
    max_tokens = None
    if keys.get("max_tokens"):
        max_tokens = _column(row, "max_tokens", keys["max_tokens"], i, cfg.path)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(
                f"data.map_keys.max_tokens: row {i} of {cfg.path} has {keys['max_tokens']}={max_tokens!r}; "
                "it must be a whole number of tokens >= 1"
            )
    return PromptRecord(index=i, prompt=prompt, label=label, system=system, max_tokens=max_tokens)


def _no_row_keys(cfg: DataConfig, what: str) -> None:
    """A source without columns (generated prompts, token ids) cannot honour a column map: refuse one, never ignore."""
    set_ = {
        k: v
        for k, v in cfg.map_keys.items()
        if k != "text" and v and (k, v) not in (("prompt", "prompt"), ("label", "label"))
    }
    if set_:
        key = next(iter(set_))
        raise ConfigError(f"data.map_keys.{key}: {cfg.path} is {what}, it has no columns to map")


def load_prompts(cfg: DataConfig) -> list[PromptRecord]:
    """Read the data set and apply the key map; raises ConfigError naming a missing column or a bad source."""
    if cfg.path.startswith("reasoning_gym:"):
        _no_row_keys(cfg, "a reasoning-gym generator (prompt: its question, label: its entry)")
        records = _generator_records(cfg)
    elif not cfg.path.startswith("builtin:") and Path(cfg.path).suffix not in (".jsonl", ".json", ".parquet"):
        prefix = indexed_prefix(cfg.path)
        if prefix is None and Path(cfg.path).is_file() and not cfg.path.endswith((".bin", ".idx")):
            raise ConfigError(f"data.path: {cfg.path} must end in .jsonl, .json or .parquet (or be a .bin/.idx prefix)")
        if prefix is None:
            p = cfg.path[:-4] if cfg.path.endswith((".bin", ".idx")) else cfg.path
            raise ConfigError(
                f"data.path: {cfg.path} does not exist: give a .jsonl, .json or .parquet file, reasoning_gym:<task>, "
                f"or a Megatron indexed data set prefix (looked for {p}{MINDSPEED_PROMPT_SUFFIX}.bin/.idx and "
                f"{p}.bin/.idx)"
            )
        _no_row_keys(cfg, "a Megatron indexed data set (preprocessed prompt token ids)")
        records = _indexed_records(cfg, prefix)
    else:
        rows = _read_rows(cfg.path)
        records = [
            _row_record(cfg, row, i) for i, row in enumerate(rows[: cfg.max_samples] if cfg.max_samples else rows)
        ]
    if not records:
        raise ConfigError(f"data.path: {cfg.path} holds no prompts")
    return records


def record_prompt_ids(tokenizer, record: PromptRecord, max_prompt_length: int, chat: bool = True) -> list[int]:
    """The generation prompt of a record: preprocessed ids as they are (MindSpeed applied its template already), else
    the text through :func:`encode_prompt` with the record's system prompt; left-truncated to ``max_prompt_length``."""
    if record.prompt_ids is not None:
        return list(record.prompt_ids)[-max_prompt_length:]
    return encode_prompt(tokenizer, record.prompt, max_prompt_length, chat, record.system)


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


def load_eval_prompts(cfg) -> list[PromptRecord]:
    """The ``eval`` section's held-out prompts, read by :func:`load_prompts` as ``data.path`` is; errors name the
    ``eval.`` field."""
    try:
        return load_prompts(cfg.eval.data_config(cfg.data))
    except ConfigError as err:
        raise ConfigError(re.sub(r"\bdata\.", "eval.", str(err))) from None
    except OSError as err:
        raise ConfigError(f"eval.path: {cfg.eval.path}: {err}") from None
