"""In-memory click data and its deterministic, rank-sharded batch schedule.

Where the samples come from (synthetic generator, Criteo files) lives in sibling modules; this one only
holds them and decides which rows each rank reads at each step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gpujobs.errors import ConfigError

_MASK64 = (1 << 64) - 1

GENERATOR_STREAM = 0
"""`derive_seed` stream of the synthetic click log."""
SHUFFLE_STREAM = 1
"""`derive_seed` stream of the epoch permutations."""


def derive_seed(seed: int, *stream: int) -> int:
    """A 63-bit seed for the random stream named by `stream`, derived from the user's `seed`.

    Seeding generators with `seed + epoch` would make (seed=1, epoch=0) and (seed=0, epoch=1) share a
    stream; mixing with splitmix64 keeps the streams unrelated and is stable across Python runs.
    """
    state = seed & _MASK64
    for word in (*stream, len(stream)):
        state = (state + 0x9E3779B97F4A7C15 + (word & _MASK64)) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1  # torch.Generator.manual_seed takes a signed 64-bit value


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
    """Train and eval splits in memory, and the batch of each (step, micro-step) for one rank.

    Batches follow a DistributedSampler-like schedule: epoch e visits the training rows in a permutation
    seeded by (seed, e); each global micro-batch is the next `batch_size * world_size` rows of it, of which
    rank r reads the r-th `batch_size`; the tail that does not fill a global micro-batch is dropped. So a
    batch is a pure function of (step, micro, rank, world_size, seed), which makes resume exact, and ranks
    never read the same row within an epoch.
    """

    def __init__(
        self,
        features: FeatureSpec,
        train: RecBatch,
        eval: RecBatch,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        micro_batches: int,
        seed: int,
        oracle_auc: float | None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        _check_split("train", train, features)
        _check_split("eval", eval, features)
        num_train = train.num_rows
        global_batch = batch_size * world_size
        if not 1 <= global_batch <= num_train:
            allowed = f"1..{num_train // world_size} ({num_train} training rows over {world_size} ranks)"
            raise ConfigError("batch_size", batch_size, allowed)
        self.features = features
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.micro_batches = micro_batches
        self.seed = seed
        self.oracle_auc = oracle_auc
        self._train = train
        self._eval = eval
        self._global_batch = global_batch
        self._batches_per_epoch = num_train // global_batch
        self._cached_epoch = -1
        self._cached_order = torch.empty(0, dtype=torch.int64)

    @property
    def samples_per_epoch(self) -> int:
        """Training rows all ranks together read in one epoch (the dropped tail excluded)."""
        return self._batches_per_epoch * self._global_batch

    @property
    def num_eval(self) -> int:
        """Rows of the eval split."""
        return self._eval.num_rows

    def epoch_of(self, step: int) -> int:
        """The epoch that the first micro-batch of optimizer step `step` belongs to."""
        return (step * self.micro_batches) // self._batches_per_epoch

    def train_batch(self, step: int, micro: int) -> RecBatch:
        """This rank's micro-batch `micro` (0..micro_batches-1) of optimizer step `step` (from 0)."""
        if step < 0 or not 0 <= micro < self.micro_batches:
            raise ValueError(f"no batch for step {step}, micro {micro} of {self.micro_batches}")
        epoch, position = divmod(step * self.micro_batches + micro, self._batches_per_epoch)
        start = position * self._global_batch + self.rank * self.batch_size
        rows = self._order(epoch)[start : start + self.batch_size]
        return RecBatch(
            self._train.dense.index_select(0, rows),
            self._train.sparse.index_select(0, rows),
            self._train.label.index_select(0, rows),
        )

    def eval_batches(self, batch_size: int = 4096) -> Iterator[RecBatch]:
        """The whole eval split (not sharded) in order, as views of at most `batch_size` rows."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        for start in range(0, self._eval.num_rows, batch_size):
            yield RecBatch(*(t[start : start + batch_size] for t in self._eval))

    def _order(self, epoch: int) -> torch.Tensor:
        # One permutation per epoch, shared by all ranks; recomputed only when the epoch changes.
        if epoch != self._cached_epoch:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, SHUFFLE_STREAM, epoch))
            self._cached_order = torch.randperm(self._train.num_rows, generator=generator)
            self._cached_epoch = epoch
        return self._cached_order


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
