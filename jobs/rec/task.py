"""The rec job as the generic trainer sees it: a model, its batches, its loss and its evaluation."""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gpujobs.rank import collectives
from gpujobs.rank.task import eval_share
from jobs.rec.config import CriteoConfig, RecModelConfig, SyntheticClicksConfig
from jobs.rec.data import RecBatch, pinned_staging
from jobs.rec.metrics import BINS, ScoreHistogram

log = logging.getLogger(__name__)

AUC_TOLERANCE = 1e-4
"""How far the eval's AUC may be from the exact one before a warning says it may be."""
CENTER_ROWS = 1024
"""Eval rows whose mean logit centres the eval's histogram bins."""


class RecTask:
    """Data and model of one rank, built from their configs.

    Construct it after seeding torch's global RNG: the model's initial parameters come from it.
    """

    def __init__(
        self,
        model_cfg: RecModelConfig,
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
        """Mean binary cross-entropy of `model` (the rec model, or a DDP wrapper of it) on `batch`."""
        logits = model(batch.dense, batch.sparse)
        return F.binary_cross_entropy_with_logits(logits, batch.label)

    def evaluate(self, model: nn.Module, device: torch.device, max_rows: Optional[int] = None) -> dict[str, float]:
        """AUC, log-loss and row count of `model` on the first `max_rows` eval rows (None: all of them), plus
        the oracle AUC when known. Collective: each rank counts its `eval_share` of the rows into a
        `ScoreHistogram` (bins centred by `_center`), and one all-reduce sums them, so every rank returns the
        same numbers, as one process would within 1e-4 (`auc_error_bound`; a warning where it may not).

        The model is put in eval mode under no_grad and handed back in the mode it came in.
        """
        rows = self.data.num_eval if max_rows is None else min(max_rows, self.data.num_eval)
        rank, world = collectives.rank_and_world()
        start, stop = eval_share(rows, rank, world)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                counted = ScoreHistogram(self._center(model, device, rows, rank))
                for batch in self.data.eval_batches(start=start, stop=stop):
                    counted.add(_logits(model, batch, device), batch.label)
        finally:
            model.train(was_training)
        whole = ScoreHistogram(counted.center, collectives.sum_across(counted.totals))
        metrics = {"auc": whole.auc(), "logloss": whole.logloss(), "eval_rows": float(whole.rows)}
        if (bound := whole.auc_error_bound()) > AUC_TOLERANCE and rank == 0:
            log.warning("eval AUC from %d logit bins may be off the exact figure by up to %.2g: %.2g of the "
                        "positive-negative pairs share a bin (scores this close, or tied)", BINS, bound, 2 * bound)
        if self.data.oracle_auc is not None:
            metrics["oracle_auc"] = self.data.oracle_auc
        return metrics

    def _center(self, model: nn.Module, device: torch.device, rows: int, rank: int) -> float:
        """The logit the eval's histogram bins are centred on (collective): the mean logit of the eval's first
        `CENTER_ROWS` rows, computed by rank 0 and summed with nothing by the others (one tiny all-reduce).

        The bins are finest there, where the scores crowd when they crowd at all. Every rank takes it from the
        same sum, so their histograms add up even where their GPUs' logits differ in the last bit; and it
        does not depend on the world size, so neither does the AUC.
        """
        mine = torch.zeros(2, dtype=torch.float64)
        if rank == 0:
            for batch in self.data.eval_batches(batch_size=CENTER_ROWS, stop=min(rows, CENTER_ROWS)):  # a single batch
                logits = _logits(model, batch, device)
                mine[0], mine[1] = logits.to(torch.float64).sum(), logits.numel()
        total, count = collectives.sum_across(mine).tolist()
        return total / count if count else 0.0


def _logits(model: nn.Module, batch: RecBatch, device: torch.device) -> torch.Tensor:
    on_device = batch.to(device)
    return model(on_device.dense, on_device.sparse).float().cpu()


def build_task(
    model_cfg: RecModelConfig,
    data_cfg: SyntheticClicksConfig | CriteoConfig,
    world_size: int,
    micro_batches: int,
) -> RecTask:
    """The rec task of a run configured for `world_size` ranks, accumulating `micro_batches` per step."""
    return RecTask(model_cfg, data_cfg, world_size, micro_batches)
