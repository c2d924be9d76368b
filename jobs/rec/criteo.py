"""Reader of Criteo-format click logs: one sample per line, tab-separated.

Columns: the label (0 or 1), 13 integer features, 26 categorical features (hex strings in the Criteo
release; any string works). Every field but the label may be empty, meaning missing. The rules for one
line live in `jobs.rec.criteo_store`, with the parser that prepares whole files into a sample store.
"""

from __future__ import annotations

import zlib
from array import array
from pathlib import Path

import torch

from jobs.rec.criteo_store import (
    NUM_CATEGORICAL,
    NUM_INTEGER,
    CriteoFormatError,
    integer_feature_value,
    label_value,
    split_fields,
)
from jobs.rec.data import FeatureSpec, RecBatch

__all__ = ["CriteoFormatError", "criteo_features", "read_criteo_tsv"]


def criteo_features(hash_buckets: int) -> FeatureSpec:
    """The feature shape of Criteo data: index 0 of each table is "missing", 1..hash_buckets hashed."""
    return FeatureSpec(NUM_INTEGER, (hash_buckets + 1,) * NUM_CATEGORICAL)


def read_criteo_tsv(path: str | Path, hash_buckets: int) -> RecBatch:
    """All samples of the file at `path`, in file order.

    Integer feature x becomes log1p(max(x, 0)) (counts are heavy-tailed; Criteo has a few negatives),
    missing becomes 0. A categorical value becomes 1 + crc32(value) % hash_buckets, missing becomes 0;
    crc32, unlike Python's salted `hash()`, gives every rank and every run the same index.
    """
    if hash_buckets < 1:
        raise ValueError(f"hash_buckets must be >= 1, got {hash_buckets}")
    labels = array("f")
    dense = array("f")
    sparse = array("q")
    with open(path, encoding="utf-8", newline="\n") as lines:
        for number, line in enumerate(lines, start=1):
            fields = split_fields(line, path, number)
            labels.append(label_value(fields[0], path, number))
            for column in range(1, 1 + NUM_INTEGER):
                dense.append(integer_feature_value(fields[column], path, number, column))
            for value in fields[1 + NUM_INTEGER :]:
                sparse.append(1 + zlib.crc32(value.encode()) % hash_buckets if value else 0)
    if not labels:
        raise CriteoFormatError(f"{path}: no samples")
    # frombuffer reads the arrays without a per-element Python loop; clone() gives torch its own memory.
    return RecBatch(
        torch.frombuffer(dense, dtype=torch.float32).clone().reshape(-1, NUM_INTEGER),
        torch.frombuffer(sparse, dtype=torch.int64).clone().reshape(-1, NUM_CATEGORICAL),
        torch.frombuffer(labels, dtype=torch.float32).clone(),
    )
