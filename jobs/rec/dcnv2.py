"""DLRM-DCNv2, the MLPerf Training recommendation model (Wang et al., 2021; TorchRec's DLRM_DCN): the F vectors
of a sample, concatenated, go through low-rank cross layers, then the top MLP to one click logit."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from jobs.rec.config import DCNv2Config
from jobs.rec.features import FeatureSpec
from jobs.rec.model import RecModel, mlp


class CrossLayer(nn.Module):
    """One low-rank DCN-v2 cross layer over `width` values: x_next = x0 * (U(V x) + b) + x, with V: width ->
    low_rank (no bias) and U: low_rank -> width (its bias is b).

    Initialised as the reference's (TorchRec's LowRankCrossNet): V and U Xavier-normal, b zero.
    """

    def __init__(self, width: int, low_rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, low_rank, bias=False)  # V
        self.up = nn.Linear(low_rank, width)  # U, and b its bias
        nn.init.xavier_normal_(self.down.weight)
        nn.init.xavier_normal_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The next layer's input [B, width] from the first layer's `x0` and this one's `x`."""
        crossed: torch.Tensor = x0 * self.up(self.down(x)) + x
        return crossed


class DCNv2(RecModel):
    """The bottom MLP's vector of the dense features and the categorical features' embeddings, F vectors of
    `embedding_dim` concatenated into F x embedding_dim values, then `cross_layers` `CrossLayer`s, then the top
    MLP (its hidden sizes `top_mlp`, a last linear layer to one logit).

    As in TorchRec's DLRM_DCN, the bottom MLP's last layer is followed by a ReLU (its output is a feature
    vector among the embeddings); the top MLP's last layer is linear (a logit).
    """

    def __init__(self, features: FeatureSpec, cfg: DCNv2Config, tables: Optional[nn.Module] = None) -> None:
        super().__init__(features, cfg, bottom_relu=True, tables=tables)
        width = cfg.top_width(features)  # F x embedding_dim
        self.cross = nn.ModuleList(CrossLayer(width, cfg.low_rank) for _ in range(cfg.cross_layers))
        self.top = mlp(width, cfg.top_mlp, 1)

    def forward_embedded(self, dense: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """Click logits [B] (see `RecModel.forward_embedded`)."""
        x0 = self.stacked(dense, embedded).flatten(1)  # [B, F * d]
        x = x0
        for layer in self.cross:
            x = layer(x0, x)
        logits: torch.Tensor = self.top(x).squeeze(1)
        return logits
