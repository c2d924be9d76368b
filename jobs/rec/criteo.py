"""Reader of Criteo-format click logs: one sample per line, tab-separated.

Columns: the label (0 or 1), 13 integer features, 26 categorical features (hex strings in the Criteo
release; any string works). Every field but the label may be empty, meaning missing. The rules for one
line live in `jobs.rec.criteo_store`, with the parser that prepares whole files into a sample store.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from jobs.rec.criteo_store import (
    NUM_CATEGORICAL,
    NUM_INTEGER,
    CriteoFormatError,
    category_index,
    integer_feature_value,
    label_value,
    split_fields,
)
from jobs.rec.data import RecBatch
from jobs.rec.features import column_buckets, criteo_features

__all__ = ["CriteoFormatError", "criteo_features", "read_criteo_tsv"]


def read_criteo_tsv(path: str | Path, hash_buckets: int | Sequence[int]) -> RecBatch:
    """All samples of the file at `path`, in file order.

    Integer feature x becomes log1p(max(x, 0)) (counts are heavy-tailed; Criteo has a few negatives),
    missing becomes 0. A value of categorical column c becomes 1 + crc32(value) % buckets[c] (`hash_buckets`:
    one count for every column, or one per column), missing becomes 0; crc32, unlike Python's salted
    `hash()`, gives every rank and every run the same index.
    """
    buckets = column_buckets(hash_buckets)
    labels = array("f")
    dense = array("f")
    sparse = array("q")
    with open(path, encoding="utf-8", newline="\n") as lines:
        for number, line in enumerate(lines, start=1):
            fields = split_fields(line, path, number)
            labels.append(label_value(fields[0], path, number))
            for column in range(1, 1 + NUM_INTEGER):
                dense.append(integer_feature_value(fields[column], path, number, column))
            for value, count in zip(fields[1 + NUM_INTEGER :], buckets, strict=True):
                sparse.append(category_index(value, count))
    if not labels:
        raise CriteoFormatError(f"{path}: no samples")
    # frombuffer reads the arrays without a per-element Python loop; clone() gives torch its own memory.
    return RecBatch(
        torch.frombuffer(dense, dtype=torch.float32).clone().reshape(-1, NUM_INTEGER),
        torch.frombuffer(sparse, dtype=torch.int64).clone().reshape(-1, NUM_CATEGORICAL),
        torch.frombuffer(labels, dtype=torch.float32).clone(),
    )
