"""The rec job's click models: a sparse arch (the embedding tables) and the dense rest; DLRM (Naumov et al.,
2019) here, DCN-v2 in `jobs.rec.dcnv2`.

A model is `embeddings` (categorical indices [B, S] -> vectors [B, S, d]) followed by `forward_embedded`
(dense features and those vectors -> logits): a sharded model swaps the sparse arch alone (TorchRec's
EmbeddingBagCollection, taking a KeyedJaggedTensor) and keeps the dense rest as it is.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from jobs.rec.config import DLRMConfig, RecModelConfig
from jobs.rec.features import FeatureSpec
from jobs.rec.sizes import mlp_sizes


def mlp(in_features: int, hidden: Sequence[int], out_features: int, relu_last: bool = False) -> nn.Sequential:
    """Linear layers through `hidden` sizes with ReLU between them; the last layer stays linear unless
    `relu_last` (a bottom MLP whose output is a feature vector, as in TorchRec's DenseArch)."""
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(mlp_sizes(in_features, hidden, out_features))):
        if i > 0:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    if relu_last:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class EmbeddingTables(nn.ModuleList):
    """The sparse arch: one `nn.Embedding` per categorical feature, indices int64 [B, S] -> vectors [B, S, d].

    Rows are stored divided by `lr_scale` and scaled back up in forward. Adam moves every parameter by about
    lr per step whatever its gradient, so this multiplies the embeddings' effective learning rate: a row of
    a rare value is only in a few batches and must learn fast. As a ModuleList, its tables' state-dict keys
    are `<name>.<i>.weight` (`embeddings.0.weight` in the models), as they were before it had a forward.
    """

    def __init__(self, cardinalities: Sequence[int], dim: int, lr_scale: float = 1.0) -> None:
        tables = [nn.Embedding(rows, dim) for rows in cardinalities]
        for table in tables:
            # N(0, 1) (torch's default) makes the initial dot products, and so the first logits, huge.
            nn.init.normal_(table.weight, std=dim**-0.5 / lr_scale)
        super().__init__(tables)
        self.lr_scale = lr_scale

    def forward(self, sparse: torch.Tensor) -> torch.Tensor:
        """The vectors float32 [B, S, d] of indices int64 [B, S] (column i looked up in table i)."""
        embedded = torch.stack([table(sparse[:, i]) for i, table in enumerate(self)], dim=1)
        return embedded * self.lr_scale


class RecModel(nn.Module, abc.ABC):
    """What the rec models share: the sparse arch `embeddings` and the bottom MLP that maps the dense features
    to one more vector of `embedding_dim`, F = 1 + num_categorical vectors in all; a subclass's
    `forward_embedded` makes them one click logit per sample. Every size comes from the config (`cfg.shape`
    counts the same parts)."""

    def __init__(self, features: FeatureSpec, cfg: RecModelConfig, bottom_relu: bool = False,
                 tables: Optional[nn.Module] = None) -> None:
        """`tables`: another sparse arch in place of `EmbeddingTables` (TorchRec's, under parallel=torchrec)."""
        super().__init__()
        self.embeddings = tables if tables is not None else EmbeddingTables(
            features.cardinalities, cfg.embedding_dim, cfg.embedding_lr_scale)
        self.bottom = mlp(features.num_dense, cfg.bottom_mlp, cfg.embedding_dim, relu_last=bottom_relu)

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        """Click logits [B] for dense features float32 [B, num_dense] and indices int64 [B, S] (or, for a sharded
        sparse arch, a KeyedJaggedTensor of them)."""
        return self.forward_embedded(dense, self.embeddings(sparse))

    @abc.abstractmethod
    def forward_embedded(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Click logits [B] for dense features float32 [B, num_dense] and their categorical features' vectors
        float32 [B, S, embedding_dim] (the sparse arch's output)."""

    def stacked(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The F vectors [B, F, d]: the bottom MLP's of the dense features first, then the embedded ones."""
        return torch.cat([self.bottom(dense).unsqueeze(1), embedded], dim=1)


class DLRM(RecModel):
    """Embeddings for categorical features, an MLP for dense ones, their interaction, an MLP on top.

    "dot" interaction feeds the top MLP the F*(F-1)/2 pairwise dot products of the F vectors (the dense
    vector appended, so first-order effects pass too); "cat" feeds it all F vectors concatenated. The top
    MLP ends in one click logit per sample.
    """

    def __init__(self, features: FeatureSpec, cfg: DLRMConfig, tables: Optional[nn.Module] = None) -> None:
        super().__init__(features, cfg, tables=tables)
        self.interaction = cfg.interaction
        self.top = mlp(cfg.top_width(features), cfg.top_mlp, 1)
        # Kept out of the state dict: it is derived from the shapes, and a buffer would make DDP
        # broadcast it on every forward.
        self._pairs = torch.triu_indices(features.num_vectors, features.num_vectors, offset=1)

    def forward_embedded(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Click logits [B] (see `RecModel.forward_embedded`)."""
        stacked = self.stacked(dense, embedded)  # [B, F, d]
        if self.interaction == "dot":
            gram = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, F, F]
            if self._pairs.device != gram.device:  # moved once, not copied on every step
                self._pairs = self._pairs.to(gram.device)
            rows, cols = self._pairs
            features = torch.cat([stacked[:, 0], gram[:, rows, cols]], dim=1)
        else:
            features = stacked.flatten(1)
        logits: torch.Tensor = self.top(features).squeeze(1)
        return logits
