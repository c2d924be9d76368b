"""The contract between the generic trainer and a job's model and data."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Task(Protocol):
    """What a job gives the trainer. `jobs.rec.task.RecTask` is the reference implementation.

    `train_batch` must be a pure function of (step, micro) for this rank: that is what makes a
    resumed run continue exactly where the interrupted one stopped.
    """

    model: torch.nn.Module
    samples_per_micro_batch: int

    def train_batch(self, step: int, micro: int, device: torch.device) -> Any:
        """This rank's micro-batch `micro` of optimizer step `step`, on `device`."""

    def loss(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """Mean loss of `batch`; `model` may be the DDP wrapper."""

    def evaluate(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """Held-out metrics of the unwrapped model."""
