"""A DLRM-style click model (Naumov et al., 2019), small enough to train on CPUs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import nn


def _mlp(in_features: int, hidden: Sequence[int], out_features: int) -> nn.Sequential:
    """Linear layers through `hidden` sizes with ReLU between them; the last layer stays linear."""
    sizes = [in_features, *hidden, out_features]
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        if i > 0:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(fan_in, fan_out))
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Embeddings for categorical features, an MLP for dense ones, their interaction, an MLP on top.

    The bottom MLP maps the dense features to one vector of `embedding_dim`; with the embedding of each
    categorical feature that makes F = 1 + num_categorical vectors. "dot" interaction feeds the top MLP
    their F*(F-1)/2 pairwise dot products (the dense vector appended, so first-order effects pass too);
    "cat" feeds it all F vectors concatenated. The top MLP ends in one click logit per sample.
    """

    def __init__(
        self,
        *,
        num_dense: int,
        cardinalities: Sequence[int],
        embedding_dim: int,
        bottom_mlp: Sequence[int],
        top_mlp: Sequence[int],
        interaction: str = "dot",
        embedding_lr_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if interaction not in ("dot", "cat"):
            raise ValueError(f"interaction must be 'dot' or 'cat', got {interaction!r}")
        self.interaction = interaction
        # Embeddings are stored divided by this and scaled back up in forward. Adam moves every
        # parameter by about lr per step whatever its gradient, so this multiplies the embeddings'
        # effective learning rate: a row of a rare value is only in a few batches and must learn fast.
        self.embedding_lr_scale = embedding_lr_scale
        tables = [nn.Embedding(n, embedding_dim) for n in cardinalities]
        for table in tables:
            # N(0, 1) (torch's default) makes the initial dot products, and so the first logits, huge.
            nn.init.normal_(table.weight, std=embedding_dim**-0.5 / embedding_lr_scale)
        self.embeddings = nn.ModuleList(tables)
        self.bottom = _mlp(num_dense, bottom_mlp, embedding_dim)
        num_vectors = 1 + len(cardinalities)
        if interaction == "dot":
            top_in = embedding_dim + num_vectors * (num_vectors - 1) // 2
        else:
            top_in = embedding_dim * num_vectors
        self.top = _mlp(top_in, top_mlp, 1)
        # Kept out of the state dict: it is derived from the shapes, and a buffer would make DDP
        # broadcast it on every forward.
        self._pairs = torch.triu_indices(num_vectors, num_vectors, offset=1)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """Click logits [B] for dense features float32 [B, num_dense] and indices int64 [B, S]."""
        x = self.bottom(dense)  # [B, d]
        embedded = torch.stack([table(sparse[:, i]) for i, table in enumerate(self.embeddings)], dim=1)
        stacked = torch.cat([x.unsqueeze(1), embedded * self.embedding_lr_scale], dim=1)  # [B, F, d]
        if self.interaction == "dot":
            gram = torch.bmm(stacked, stacked.transpose(1, 2))  # [B, F, F]
            if self._pairs.device != gram.device:  # moved once, not copied on every step
                self._pairs = self._pairs.to(gram.device)
            rows, cols = self._pairs
            features = torch.cat([x, gram[:, rows, cols]], dim=1)
        else:
            features = stacked.flatten(1)
        logits: torch.Tensor = self.top(features).squeeze(1)
        return logits
