"""Ranking and calibration metrics of a click model: ROC AUC and log-loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC of `scores` (any monotone score: logits or probabilities) against 0/1 `labels`.

    The Mann-Whitney statistic from ranks, O(n log n): the chance that a random positive scores above a
    random negative, a tie counting one half. Raises ValueError when either class is absent.
    """
    scores = scores.detach().flatten().to(torch.float64)
    positive = labels.detach().flatten() > 0.5
    if scores.shape != positive.shape:
        raise ValueError(f"{scores.numel()} scores but {positive.numel()} labels")
    num_pos = int(positive.sum())
    num_neg = positive.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError(f"AUC needs both classes; got {num_pos} positives and {num_neg} negatives")
    sorted_scores, order = torch.sort(scores)
    _, group, counts = torch.unique_consecutive(sorted_scores, return_inverse=True, return_counts=True)
    # Tied scores share the mean of the 1-based ranks they span, which is what makes a tie count 1/2.
    ends = counts.cumsum(0).to(torch.float64)
    mean_rank = ends - (counts.to(torch.float64) - 1.0) / 2.0
    positive_rank_sum = float(mean_rank[group][positive[order]].sum())
    return (positive_rank_sum - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg)


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy (natural log) of predicted click logits against 0/1 `labels`."""
    return float(
        F.binary_cross_entropy_with_logits(
            logits.detach().flatten().to(torch.float64), labels.detach().flatten().to(torch.float64)
        )
    )
