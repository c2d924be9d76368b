"""Click data and its global sample stream: the rows of every step, whatever the world size.

Where the samples come from (synthetic generator, a prepared Criteo store) lives in sibling modules; this
one serves a split's rows from memory (`MemoryRows`) or from a prepared sample store (`StoreRows`) and
decides which rows make up each step's global batch (the trainer decides who reads which).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

from gpujobs.base.errors import ConfigError
from gpujobs.data.shuffle import IndexShuffle
from gpujobs.rank.rng import derive_seed
from jobs.rec.features import FeatureSpec  # defined torch-free, for the submit side; served from here too

if TYPE_CHECKING:
    from gpujobs.data.reader import SampleStore

__all__ = [
    "GENERATOR_STREAM", "SHUFFLE_STREAM", "FeatureSpec", "MemoryRows", "RecBatch", "RecData", "Rows", "StoreRows",
    "derive_seed", "pinned_staging",
]

GENERATOR_STREAM = 0
"""`derive_seed` stream of the synthetic click log."""
SHUFFLE_STREAM = 1
"""`derive_seed` stream of the epoch permutations (the keys of `IndexShuffle`)."""


class RecBatch(NamedTuple):
    """A batch of samples (or a whole split): features and click labels, row-aligned."""

    dense: torch.Tensor
    """float32 [B, num_dense]."""
    sparse: torch.Tensor
    """int64 [B, num_categorical], each column in [0, cardinality)."""
    label: torch.Tensor
    """float32 [B], 1.0 for a click."""

    def to(self, device: torch.device, non_blocking: bool = False) -> RecBatch:
        """The same batch on `device`."""
        return RecBatch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.label.to(device, non_blocking=non_blocking),
        )

    @property
    def num_rows(self) -> int:
        """Samples in the batch (`len()` stays the tuple's three fields)."""
        return int(self.label.shape[0])


class Rows(Protocol):
    """A split's rows, wherever they live: gathered by row number (training) or in a run (eval)."""

    @property
    def num_rows(self) -> int:
        """Rows of the split."""
        ...

    def gather(self, rows: np.ndarray, pinned: bool) -> RecBatch:
        """Rows `rows` (int64 row numbers, any order) in that order; into page-locked memory if `pinned`."""
        ...

    def span(self, start: int, stop: int) -> RecBatch:
        """Rows `start..stop` in order."""
        ...


class RecData:
    """Train and eval splits, and the global sample stream: the rows of every optimizer step.

    Step s's global batch is `global_batch_size` rows, made of `micro_batches` global micro-batches of
    `micro_batch` rows each; global micro-batch k = s * micro_batches + m is the k-th run of `micro_batch`
    positions through the epochs (the tail that does not fill a micro-batch is dropped), and epoch e maps a
    position to a training row by the bijection `IndexShuffle(rows, derive_seed(seed, SHUFFLE_STREAM, e))`,
    computed per position: no permutation of all rows is ever held. So the rows of a step are a pure
    function of (seed, step) and the global batch size, whatever the number of ranks or how they share
    it: ranks read contiguous slices by the trainer's split plan, which makes resume exact at any world size.
    """

    def __init__(
        self,
        features: FeatureSpec,
        train: RecBatch | Rows,
        eval: RecBatch | Rows,
        *,
        global_batch_size: int,
        micro_batches: int,
        seed: int,
        oracle_auc: float | None,
    ) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self._train = _rows_of("train", train, features)
        self._eval = _rows_of("eval", eval, features)
        num_train = self._train.num_rows
        if global_batch_size % micro_batches:
            raise ConfigError(
                "global_batch_size", global_batch_size, f"a multiple of trainer.grad_accum={micro_batches}"
            )
        micro_batch = global_batch_size // micro_batches
        if not 1 <= micro_batch <= num_train:
            allowed = f"1..{num_train * micro_batches} samples per step ({num_train} training rows per micro-batch)"
            raise ConfigError("global_batch_size", global_batch_size, allowed)
        self.features = features
        self.global_batch_size = global_batch_size
        self.micro_batch = micro_batch
        self.micro_batches = micro_batches
        self.seed = seed
        self.oracle_auc = oracle_auc
        self._batches_per_epoch = num_train // micro_batch

    @property
    def samples_per_epoch(self) -> int:
        """Training rows one epoch reads (the dropped tail excluded)."""
        return self._batches_per_epoch * self.micro_batch

    @property
    def num_eval(self) -> int:
        """Rows of the eval split."""
        return self._eval.num_rows

    def epoch_of(self, step: int) -> int:
        """The epoch that the first micro-batch of optimizer step `step` belongs to."""
        return (step * self.micro_batches) // self._batches_per_epoch

    def train_rows(self, step: int, start: int, stop: int, pinned: bool = False) -> RecBatch:
        """Rows `start..stop` (0 <= start <= stop <= global_batch_size) of optimizer step `step`'s global batch;
        gathered straight into page-locked memory if `pinned` (needs CUDA: see `pinned_staging`). Only these
        rows are read."""
        if step < 0 or not 0 <= start <= stop <= self.global_batch_size:
            raise ValueError(f"no rows {start}..{stop} of step {step} (global batch {self.global_batch_size})")
        parts = [np.empty(0, dtype=np.int64)]
        row = start
        while row < stop:  # one piece per global micro-batch the slice touches (one, for the trainer)
            micro, inside = divmod(row, self.micro_batch)
            end = min(stop, (micro + 1) * self.micro_batch)
            epoch, position = divmod(step * self.micro_batches + micro, self._batches_per_epoch)
            first = position * self.micro_batch + inside
            order = IndexShuffle(self._train.num_rows, derive_seed(self.seed, SHUFFLE_STREAM, epoch))
            parts.append(order(np.arange(first, first + end - row, dtype=np.int64)))
            row = end
        return self._train.gather(np.concatenate(parts), pinned)

    def eval_batches(self, batch_size: int = 4096, start: int = 0, stop: int | None = None) -> Iterator[RecBatch]:
        """Rows `start..stop` of the eval split (default: all of it) in order, in batches of at most `batch_size`."""
        stop = self.num_eval if stop is None else stop
        if batch_size < 1 or not 0 <= start <= stop <= self.num_eval:
            raise ValueError(f"no eval rows {start}..{stop} in batches of {batch_size} ({self.num_eval} rows)")
        for first in range(start, stop, batch_size):
            yield self._eval.span(first, min(stop, first + batch_size))


class MemoryRows:
    """A split held in memory as one `RecBatch` (the synthetic log)."""

    def __init__(self, split: RecBatch) -> None:
        self._split = split

    @property
    def num_rows(self) -> int:
        """Rows of the split."""
        return self._split.num_rows

    def gather(self, rows: np.ndarray, pinned: bool) -> RecBatch:
        """Rows `rows` in that order, copied out of the split (into pinned memory if `pinned`)."""
        index = torch.from_numpy(rows)
        return RecBatch(*(_gather(column, index, pinned) for column in self._split))

    def span(self, start: int, stop: int) -> RecBatch:
        """Rows `start..stop`, as views of the split."""
        return RecBatch(*(column[start:stop] for column in self._split))


class StoreRows:
    """A split of a prepared sample store (`gpujobs.data.reader.SampleStore`) with the rec columns `label`
    (width 1), `dense` (width num_dense) and `sparse` (width one per categorical feature).

    Rows are read from the store's files as they are asked for: memory does not grow with the store.
    The categorical indices of every batch are checked against the tables (a few comparisons per row):
    the store is checked by size and time, not content, and a bad index would fail deep in an embedding.
    """

    def __init__(self, store: SampleStore, split: str, features: FeatureSpec, where: str) -> None:
        widths = {column.name: column.width for column in store.manifest.columns}
        expected = {"label": 1, "dense": features.num_dense, "sparse": len(features.cardinalities)}
        if any(widths.get(name) != width for name, width in expected.items()):
            raise ValueError(f"data.store={where} holds columns {widths}, the rec job reads {expected}")
        self._store = store
        self._split = split
        self._where = where
        self._num_dense = features.num_dense
        self._upper = np.asarray(features.cardinalities, dtype=np.int64)

    @property
    def num_rows(self) -> int:
        """Rows of the split."""
        return self._store.rows(self._split)

    def gather(self, rows: np.ndarray, pinned: bool) -> RecBatch:
        """Rows `rows` in that order, read from the store (into pinned memory if `pinned`)."""
        return self._batch(self._store.take(self._split, rows), pinned)

    def span(self, start: int, stop: int) -> RecBatch:
        """Rows `start..stop`, read from the store."""
        return self._batch(self._store.span(self._split, start, stop), pinned=False)

    def _batch(self, columns: dict[str, np.ndarray], pinned: bool) -> RecBatch:
        rows = len(columns["label"])  # a width-1 column comes as [rows]: the model takes [rows, width] features
        sparse = columns["sparse"].reshape(rows, len(self._upper))
        if sparse.size and (sparse.min() < 0 or bool((sparse >= self._upper).any())):
            raise ValueError(f"data.store={self._where}: {self._split} rows hold categorical indices outside "
                             "[0, cardinality): a shard was changed after prepare")
        return RecBatch(
            _tensor(columns["dense"].reshape(rows, self._num_dense), torch.float32, pinned),
            _tensor(sparse, torch.int64, pinned),
            _tensor(columns["label"], torch.float32, pinned),
        )


def pinned_staging(device: torch.device) -> bool:
    """Whether a batch bound for `device` is gathered into pinned host memory and copied without blocking.

    A copy to a CUDA GPU from pageable memory blocks the host while the driver stages it through a pinned
    buffer of its own; from pinned memory it is a DMA that runs while the host goes on queueing the step
    (torch keeps the block until the copy is done). Elsewhere there is no copy to take off the step.
    """
    return device.type == "cuda"


def _gather(column: torch.Tensor, rows: torch.Tensor, pinned: bool) -> torch.Tensor:
    if not pinned:
        return column.index_select(0, rows)
    out = torch.empty((rows.numel(), *column.shape[1:]), dtype=column.dtype, pin_memory=True)
    return torch.index_select(column, 0, rows, out=out)


_NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {torch.float32: np.dtype(np.float32), torch.int64: np.dtype(np.int64)}


def _tensor(array: np.ndarray, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """`array` (a store's column, or a caller's array) as a tensor of `dtype` that owns its memory."""
    if pinned:  # converted straight into page-locked memory: one pass, no pageable copy in between
        out = torch.empty(array.shape, dtype=dtype, pin_memory=True)
        np.copyto(out.numpy(), array)
        return out
    wanted = _NUMPY_DTYPES[dtype]
    if array.dtype != wanted or not array.flags.writeable:
        array = array.astype(wanted)  # a copy: torch must not share a read-only or a caller's array
    return torch.from_numpy(array)


def _rows_of(name: str, split: RecBatch | Rows, features: FeatureSpec) -> Rows:
    """`split` as `Rows`: a `RecBatch` is checked whole (it is in memory anyway) and served by `MemoryRows`."""
    if isinstance(split, RecBatch):
        _check_split(name, split, features)
        return MemoryRows(split)
    if split.num_rows < 1:
        raise ValueError(f"{name} split has no rows")
    return split


def _check_split(name: str, split: RecBatch, features: FeatureSpec) -> None:
    rows = split.label.shape[0]
    expected: Sequence[tuple[str, torch.Tensor, torch.dtype, tuple[int, ...]]] = (
        ("dense", split.dense, torch.float32, (rows, features.num_dense)),
        ("sparse", split.sparse, torch.int64, (rows, len(features.cardinalities))),
        ("label", split.label, torch.float32, (rows,)),
    )
    for field_name, tensor, dtype, shape in expected:
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} split: {field_name} is {tensor.dtype}{list(tensor.shape)}, expected {dtype}{list(shape)}"
            )
    if rows == 0:
        raise ValueError(f"{name} split has no rows")
    # An out-of-range index would only fail deep inside an embedding lookup, on some later step.
    sparse = split.sparse
    upper = torch.tensor(features.cardinalities, dtype=torch.int64)
    if bool((sparse < 0).any()) or bool((sparse >= upper).any()):
        raise ValueError(f"{name} split: categorical indices outside [0, cardinality)")
