"""In-memory click data and its global sample stream: the rows of every step, whatever the world size.

Where the samples come from (synthetic generator, Criteo files) lives in sibling modules; this one only
holds them and decides which rows make up each step's global batch (the trainer decides who reads which).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gpujobs.base.errors import ConfigError
from gpujobs.rank.rng import derive_seed

__all__ = [
    "GENERATOR_STREAM", "SHUFFLE_STREAM", "FeatureSpec", "RecBatch", "RecData", "derive_seed", "pinned_staging",
]

GENERATOR_STREAM = 0
"""`derive_seed` stream of the synthetic click log."""
SHUFFLE_STREAM = 1
"""`derive_seed` stream of the epoch permutations."""


@dataclass(frozen=True)
class FeatureSpec:
    """The shape of a sample's features, which is all the model needs to know about the data."""

    num_dense: int
    """Real-valued features per sample."""
    cardinalities: tuple[int, ...]
    """Number of distinct (index) values of each categorical feature."""


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


class RecData:
    """Train and eval splits in memory, and the global sample stream: the rows of every optimizer step.

    Step s's global batch is `global_batch_size` rows, made of `micro_batches` global micro-batches of
    `micro_batch` rows each; global micro-batch k = s * micro_batches + m is the k-th run of `micro_batch`
    rows through the epochs' permutations (epoch e visits the training rows in a permutation seeded by
    (seed, e); the tail that does not fill a micro-batch is dropped). So the rows of a step are a pure
    function of (seed, step) and the global batch size, whatever the number of ranks or how they share
    it: ranks read contiguous slices by the trainer's split plan, which makes resume exact at any world size.
    """

    def __init__(
        self,
        features: FeatureSpec,
        train: RecBatch,
        eval: RecBatch,
        *,
        global_batch_size: int,
        micro_batches: int,
        seed: int,
        oracle_auc: float | None,
    ) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        _check_split("train", train, features)
        _check_split("eval", eval, features)
        num_train = train.num_rows
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
        self._train = train
        self._eval = eval
        self._batches_per_epoch = num_train // micro_batch
        self._cached_epoch = -1
        self._cached_order = torch.empty(0, dtype=torch.int64)

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
        gathered straight into page-locked memory if `pinned` (needs CUDA: see `pinned_staging`)."""
        if step < 0 or not 0 <= start <= stop <= self.global_batch_size:
            raise ValueError(f"no rows {start}..{stop} of step {step} (global batch {self.global_batch_size})")
        parts = []
        row = start
        while row < stop:  # one piece per global micro-batch the slice touches (one, for the trainer)
            micro, inside = divmod(row, self.micro_batch)
            end = min(stop, (micro + 1) * self.micro_batch)
            epoch, position = divmod(step * self.micro_batches + micro, self._batches_per_epoch)
            first = position * self.micro_batch + inside
            parts.append(self._order(epoch)[first : first + end - row])
            row = end
        rows = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return RecBatch(*(_gather(column, rows, pinned) for column in self._train))

    def eval_batches(self, batch_size: int = 4096, start: int = 0, stop: int | None = None) -> Iterator[RecBatch]:
        """Rows `start..stop` of the eval split (stop None: its end) in order, as views of at most `batch_size` rows."""
        stop = self._eval.num_rows if stop is None else stop
        if batch_size < 1 or not 0 <= start <= stop <= self._eval.num_rows:
            raise ValueError(f"no eval rows {start}..{stop} in batches of {batch_size} ({self._eval.num_rows} rows)")
        for first in range(start, stop, batch_size):
            yield RecBatch(*(t[first : min(first + batch_size, stop)] for t in self._eval))

    def _order(self, epoch: int) -> torch.Tensor:
        # One permutation per epoch, the same on every rank; recomputed only when the epoch changes.
        if epoch != self._cached_epoch:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, SHUFFLE_STREAM, epoch))
            self._cached_order = torch.randperm(self._train.num_rows, generator=generator)
            self._cached_epoch = epoch
        return self._cached_order


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
