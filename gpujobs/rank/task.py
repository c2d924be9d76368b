"""The contract between the generic trainer and a job's model and data."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch


class Task(Protocol):
    """What a job gives the trainer. `jobs.rec.task.RecTask` is the reference implementation.

    The task owns a global sample stream: step `s`'s global batch is `global_batch_size` rows, a pure
    function of (seed, s) that does not depend on the number of ranks. The trainer decides which rows
    each rank reads (its split plan: contiguous slices of each micro-batch, shares equal or balanced)
    and weights each rank's mean loss by its share, so the averaged gradient is the global batch's.
    That is what makes resume exact, at the same or at another world size.

    A task is built by its builder, `build(model_cfg, data_cfg, world_size, micro_batches)` (the
    config's `task` key names it), after the trainer seeded torch: `world_size` is the configured one,
    for a per-rank batch size's global equivalent; `micro_batches` is trainer.grad_accum.

    Under `parallel=torchrec` the builder is called with `parallel="torchrec"` too: the model's tables are then
    one `gpujobs.rank.parallel.sharded.TableBags` built on the meta device from the model config's
    `shape(features)` (the trainer shards it), its batches' categorical features reach it as a
    `KeyedJaggedTensor` (or indices [B, S] it turns into one), and `evaluate` calls the model the same number
    of times on every rank (a sharded model's forward is a collective).
    """

    model: torch.nn.Module
    global_batch_size: int
    """Samples of one optimizer step, all ranks and micro-batches together (a multiple of grad_accum)."""

    def train_batch(self, step: int, start: int, stop: int, device: torch.device) -> Any:
        """Rows `start..stop` of optimizer step `step`'s global batch, on `device`."""

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss of `batch`; `model` may be the DDP wrapper."""

    def evaluate(
        self, model: torch.nn.Module, device: torch.device, max_rows: Optional[int] = None
    ) -> dict[str, float]:
        """Held-out metrics of the unwrapped model on the first `max_rows` rows of the eval split (None:
        all of it). Collective: every rank calls it at once, evaluates its `eval_share` of those rows (its
        rank and the world size from `collectives.rank_and_world`) and combines what it counted with the
        others' through `gpujobs.rank.collectives`; every rank returns the same numbers."""


def eval_share(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s rows `start, stop` of `rows` eval rows split among `world` ranks: even (the shares
    differ by one row at most), contiguous and in rank order."""
    if not 0 <= rank < world or rows < 0:
        raise ValueError(f"no share of {rows} rows for rank {rank} of {world}")
    return rows * rank // world, rows * (rank + 1) // world
