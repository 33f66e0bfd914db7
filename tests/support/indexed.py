"""Megatron indexed data (the ``.bin``/``.idx`` pair MindSpeed-LLM's preprocess_data.py writes), written here by an
independent writer of that format: the data tests and the seed-config runs read what it writes."""

from __future__ import annotations

import struct

import numpy as np

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
