"""The shape of the rec job's samples and what it sizes: features, tables, per-column hash buckets (torch-free).

The submit side reads these to describe a model before anything is queued (`ModelShape`, for memory plans);
the job side builds its data and models from the same numbers, so the two cannot disagree. Only the standard
library and `gpujobs.config` are imported here: no torch, no numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gpujobs.config.model_shape import Table

CRITEO_INTEGER = 13
"""Integer (dense) features of a Criteo-format line."""
CRITEO_CATEGORICAL = 26
"""Categorical features of a Criteo-format line, each hashed into its own table."""
MAX_HASH_BUCKETS = 2**31 - 2
"""The most hash buckets of a column: an index 1 + crc % buckets <= 2**31 - 2 fits the store's int32 column."""
HASH_BUCKETS_ALLOWED = (f"an integer in [1, {MAX_HASH_BUCKETS}] for every categorical column, or a list of "
                        f"{CRITEO_CATEGORICAL} such integers, one per column (int32 indices)")
"""What `data.hash_buckets` takes, in the words of its ConfigError."""


@dataclass(frozen=True)
class FeatureSpec:
    """The shape of a sample's features, which is all the model needs to know about the data.

    Categorical feature i is named `f_<i>` and its embedding table `t_<i>` (`feature_name`, `table_name`):
    the names a memory plan and a sharded model (TorchRec's tables and their features) share.
    """

    num_dense: int
    """Real-valued features per sample."""
    cardinalities: tuple[int, ...]
    """Number of distinct (index) values of each categorical feature."""

    @staticmethod
    def feature_name(index: int) -> str:
        """The name of categorical feature `index`."""
        return f"f_{index}"

    @staticmethod
    def table_name(index: int) -> str:
        """The name of the embedding table of categorical feature `index`."""
        return f"t_{index}"

    @property
    def num_vectors(self) -> int:
        """F: the vectors a model's interaction takes, one of the dense features and one per categorical feature."""
        return 1 + len(self.cardinalities)

    def tables(self, dim: int) -> tuple[Table, ...]:
        """One embedding table of `dim` values a row per categorical feature, as many rows as it has values."""
        return tuple(Table(self.table_name(i), self.feature_name(i), rows, dim)
                     for i, rows in enumerate(self.cardinalities))


def is_hash_buckets(value: Any) -> bool:
    """Whether `value` is what `data.hash_buckets` takes (`HASH_BUCKETS_ALLOWED`); a bool is no count."""
    if type(value) is int:
        return 1 <= value <= MAX_HASH_BUCKETS
    return (isinstance(value, (list, tuple)) and len(value) == CRITEO_CATEGORICAL
            and all(type(item) is int and 1 <= item <= MAX_HASH_BUCKETS for item in value))


def column_buckets(hash_buckets: int | Sequence[int]) -> tuple[int, ...]:
    """The hash buckets of each categorical column: one count for all of them, or one count per column.

    ValueError naming hash_buckets and what it takes otherwise (the parser's check; the config's names the key).
    """
    if not is_hash_buckets(hash_buckets):
        raise ValueError(f"hash_buckets={hash_buckets!r} is invalid: allowed {HASH_BUCKETS_ALLOWED}")
    if isinstance(hash_buckets, int):
        return (hash_buckets,) * CRITEO_CATEGORICAL
    return tuple(hash_buckets)


def criteo_features(hash_buckets: int | Sequence[int]) -> FeatureSpec:
    """The feature shape of Criteo data: index 0 of column c's table is "missing", 1..buckets[c] hashed."""
    return FeatureSpec(CRITEO_INTEGER, tuple(buckets + 1 for buckets in column_buckets(hash_buckets)))
