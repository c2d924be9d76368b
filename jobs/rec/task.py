"""The rec job as the generic trainer sees it: a model, its batches, its loss and its evaluation."""

from __future__ import annotations

import logging
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gpujobs.rank import collectives
from gpujobs.rank.parallel.sharded import TableBags, to_kjt
from gpujobs.rank.task import eval_share
from jobs.rec.config import CriteoConfig, RecModelConfig, SyntheticClicksConfig
from jobs.rec.data import RecBatch, pinned_staging
from jobs.rec.metrics import BINS, ScoreHistogram

log = logging.getLogger(__name__)

AUC_TOLERANCE = 1e-4
"""How far the eval's AUC may be from the exact one before a warning says it may be."""
CENTER_ROWS = 1024
"""Eval rows whose mean logit centres the eval's histogram bins."""
EVAL_BATCH = 4096
"""Eval rows a forward."""


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
        parallel: str = "ddp",
    ) -> None:
        self.data = data_cfg.build(world_size, micro_batches)
        features = self.data.features
        self.tables: Optional[TableBags] = None
        """parallel=torchrec: the model's tables, one TorchRec collection on the meta device (the trainer
        shards it); None under DDP, where the model holds its own."""
        if parallel == "torchrec":
            scale = model_cfg.embedding_lr_scale
            self.tables = TableBags(model_cfg.shape(features), torch.device("meta"), scale=scale,
                                    init_std=model_cfg.embedding_dim**-0.5 / scale)
        self.model: nn.Module = model_cfg.build(features, self.tables)
        self.global_batch_size: int = self.data.global_batch_size
        """Samples per optimizer step, all ranks together."""

    def train_batch(self, step: int, start: int, stop: int, device: torch.device) -> RecBatch:
        """Rows `start..stop` of optimizer step `step`'s global batch, on `device` (copied from pinned memory
        without blocking the host on CUDA); under parallel=torchrec its categorical features as a
        KeyedJaggedTensor."""
        pinned = pinned_staging(device)
        batch = self.data.train_rows(step, start, stop, pinned)
        if self.tables is not None:
            batch = batch._replace(sparse=to_kjt(batch.sparse, self.tables.keys))
        return batch.to(device, non_blocking=pinned)

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
                for batch in self.data.eval_batches(EVAL_BATCH, start=start, stop=stop):
                    counted.add(self._logits(model, batch, device), batch.label)
                if self.tables is not None:  # a sharded forward is a collective: as many on every rank
                    most = math.ceil(math.ceil(rows / world) / EVAL_BATCH)
                    for _ in range(most - math.ceil((stop - start) / EVAL_BATCH)):
                        self._logits(model, self._one_row(), device)  # its logits are no eval row's
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
        if rank == 0 or self.tables is not None:  # a sharded forward is a collective: every rank runs it
            for batch in self.data.eval_batches(batch_size=CENTER_ROWS, stop=min(rows, CENTER_ROWS)):  # a single batch
                logits = self._logits(model, batch, device)
                if rank == 0:
                    mine[0], mine[1] = logits.to(torch.float64).sum(), logits.numel()
        total, count = collectives.sum_across(mine).tolist()
        return total / count if count else 0.0

    def _logits(self, model: nn.Module, batch: RecBatch, device: torch.device) -> torch.Tensor:
        if self.tables is not None:
            batch = batch._replace(sparse=to_kjt(batch.sparse, self.tables.keys))
        on_device = batch.to(device)
        return model(on_device.dense, on_device.sparse).float().cpu()

    def _one_row(self) -> RecBatch:
        """The eval's first row: what a rank with fewer eval batches than another feeds the sharded forward."""
        return next(self.data.eval_batches(batch_size=1, stop=1))


def build_task(
    model_cfg: RecModelConfig,
    data_cfg: SyntheticClicksConfig | CriteoConfig,
    world_size: int,
    micro_batches: int,
    parallel: str = "ddp",
) -> RecTask:
    """The rec task of a run configured for `world_size` ranks, accumulating `micro_batches` per step (its
    tables TorchRec's, to be sharded, under `parallel="torchrec"`)."""
    return RecTask(model_cfg, data_cfg, world_size, micro_batches, parallel)
