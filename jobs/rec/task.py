"""The rec job as the generic trainer sees it: a model, its batches, its loss and its evaluation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jobs.rec.config import CriteoConfig, DLRMConfig, SyntheticClicksConfig
from jobs.rec.data import RecBatch, pinned_staging
from jobs.rec.metrics import auc, logloss


class RecTask:
    """Data and model of one rank, built from their configs.

    Construct it after seeding torch's global RNG: the model's initial parameters come from it.
    """

    def __init__(
        self,
        model_cfg: DLRMConfig,
        data_cfg: SyntheticClicksConfig | CriteoConfig,
        world_size: int,
        micro_batches: int,
    ) -> None:
        self.data = data_cfg.build(world_size, micro_batches)
        self.model: nn.Module = model_cfg.build(self.data.features)
        self.global_batch_size: int = self.data.global_batch_size
        """Samples per optimizer step, all ranks together."""

    def train_batch(self, step: int, start: int, stop: int, device: torch.device) -> RecBatch:
        """Rows `start..stop` of optimizer step `step`'s global batch, on `device` (copied from pinned memory
        without blocking the host on CUDA)."""
        pinned = pinned_staging(device)
        return self.data.train_rows(step, start, stop, pinned).to(device, non_blocking=pinned)

    def loss(self, model: nn.Module, batch: RecBatch) -> torch.Tensor:
        """Mean binary cross-entropy of `model` (the DLRM, or a DDP wrapper of it) on `batch`."""
        logits = model(batch.dense, batch.sparse)
        return F.binary_cross_entropy_with_logits(logits, batch.label)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """AUC and log-loss of `model` on the whole eval split (plus the oracle AUC when known).

        Every rank computes the same numbers. The model is put in eval mode under no_grad and handed
        back in the mode it came in.
        """
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                logit_parts = []
                label_parts = []
                for batch in self.data.eval_batches():
                    on_device = batch.to(device)
                    logit_parts.append(model(on_device.dense, on_device.sparse).float().cpu())
                    label_parts.append(batch.label)
        finally:
            model.train(was_training)
        logits, labels = torch.cat(logit_parts), torch.cat(label_parts)
        metrics = {"auc": auc(logits, labels), "logloss": logloss(logits, labels)}
        if self.data.oracle_auc is not None:
            metrics["oracle_auc"] = self.data.oracle_auc
        return metrics


def build_task(
    model_cfg: DLRMConfig,
    data_cfg: SyntheticClicksConfig | CriteoConfig,
    world_size: int,
    micro_batches: int,
) -> RecTask:
    """The rec task of a run configured for `world_size` ranks, accumulating `micro_batches` per step."""
    return RecTask(model_cfg, data_cfg, world_size, micro_batches)
