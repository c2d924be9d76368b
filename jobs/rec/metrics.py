"""Ranking and calibration metrics of a click model: ROC AUC and log-loss.

`auc` and `logloss` are exact over scores held in memory. `ScoreHistogram` gives the same figures from
sums that fit in a fixed-size tensor whatever the number of rows, so each rank can count its share of
the eval split and one all-reduce combines them: counts of positives and negatives per bin of the
logit (log-spaced around a center the ranks agree on), plus the summed log-loss and the row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MANTISSA_BITS = 12
"""Bins per octave of |logit - center| are 2**MANTISSA_BITS: a bin spans 2**-12 of its distance from the center."""
SMALLEST_EXPONENT = -24
"""Logits within 2**-24 (6e-8, half a float32 step at 1.0) of the center share its bin."""
LARGEST_EXPONENT = 8
"""Logits 2**8 (256) and more from the center share the outermost bin of their side."""
LEVELS = (LARGEST_EXPONENT - SMALLEST_EXPONENT) * 2**MANTISSA_BITS + 1
"""Bins of one side of the center, the center's own included."""
BINS = 2 * LEVELS - 1
"""Bins of the logit: below the center (farthest first), the center's, above it."""
_FLOAT32_MANTISSA = 23
_FLOAT32_BIAS = 127


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
    _need_both_classes(num_pos, num_neg)
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


def logit_bins(logits: torch.Tensor, center: float = 0.0) -> torch.Tensor:
    """The bin (int64 in [0, BINS)) of each logit, in the logits' order: a monotone map, so a higher logit
    never falls in a lower bin, and equal logits share one.

    The bin is the exponent and top `MANTISSA_BITS` mantissa bits of the float32 `logit - center`: bins are
    log-spaced around `center`, each as wide as 2**-12 of its distance from it, so logits that crowd
    together near the center (an untrained model's, a collapsed one's) are told apart as well as
    spread-out ones, with no range to guess.
    """
    offsets = (logits.detach().flatten().to(torch.float64) - center).to(torch.float32)  # both steps monotone
    bits = offsets.view(torch.int32).to(torch.int64)
    # |x|'s bit pattern orders like |x|; shifted down it counts (exponent, top mantissa bits) from 2**SMALLEST
    magnitude = (bits & 0x7FFFFFFF) >> (_FLOAT32_MANTISSA - MANTISSA_BITS)
    level = magnitude - ((_FLOAT32_BIAS + SMALLEST_EXPONENT) << MANTISSA_BITS) + 1
    level = level.clamp(0, LEVELS - 1)  # 0: below 2**SMALLEST (either sign); LEVELS-1: the outermost tail
    signed = torch.where(bits < 0, -level, level)
    return signed + (LEVELS - 1)


class ScoreHistogram:
    """Counts of positives and negatives per logit bin, the summed log-loss and the row count, in one flat
    float64 tensor (`totals`) whose size does not depend on the rows (2 * BINS + 2 values, 4 MB): add rows
    with `add`, sum the tensors of several parts (ranks) with the same `center` elementwise, and read the
    whole's `auc` and `logloss` from the sum.

    AUC counts pairs in different bins exactly and pairs within a bin as ties (one half), so it may be off
    the exact figure by at most `auc_error_bound` (half the share of positive-negative pairs that share a
    bin); tied scores fall in one bin and count one half, as in `auc`. Log-loss is exact up to float64 rounding.
    Counts are exact in float64 up to 2**53 rows.
    """

    def __init__(self, center: float = 0.0, totals: torch.Tensor | None = None) -> None:
        self.center = center
        """The logit the bins are centred on (see `logit_bins`): parts summed must share it."""
        if totals is None:
            totals = torch.zeros(2 * BINS + 2, dtype=torch.float64)
        if totals.shape != (2 * BINS + 2,) or totals.dtype != torch.float64:
            expected = f"float64[{2 * BINS + 2}]"
            raise ValueError(f"histogram totals must be {expected}, got {totals.dtype}{list(totals.shape)}")
        self.totals = totals

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Count rows: their click `logits` and 0/1 `labels` (on the CPU)."""
        logits, labels = logits.detach().flatten(), labels.detach().flatten()
        if logits.shape != labels.shape:
            raise ValueError(f"{logits.numel()} logits but {labels.numel()} labels")
        positive = (labels > 0.5).to(torch.int64)
        # positives' counts first, then negatives': index = bin + BINS * (1 - positive)
        where = logit_bins(logits, self.center) + BINS * (1 - positive)
        self.totals[: 2 * BINS].index_add_(0, where, torch.ones(where.shape, dtype=torch.float64))
        loss = F.binary_cross_entropy_with_logits(
            logits.to(torch.float64), labels.to(torch.float64), reduction="sum"
        )
        self.totals[2 * BINS] += loss
        self.totals[2 * BINS + 1] += logits.numel()

    @property
    def rows(self) -> int:
        """Rows counted."""
        return int(self.totals[2 * BINS + 1])

    def _classes(self) -> tuple[torch.Tensor, torch.Tensor]:
        positive, negative = self.totals[:BINS], self.totals[BINS : 2 * BINS]
        _need_both_classes(int(positive.sum()), int(negative.sum()))
        return positive, negative

    def auc(self) -> float:
        """ROC AUC of the rows counted: pairs in different bins by their order, pairs within a bin one half."""
        positive, negative = self._classes()
        negatives_below = torch.cumsum(negative, 0) - negative
        wins = float((positive * (negatives_below + negative / 2.0)).sum())
        return wins / (float(positive.sum()) * float(negative.sum()))

    def auc_error_bound(self) -> float:
        """The most `auc` can differ from the exact AUC of the same scores: half the share of
        positive-negative pairs that fall in one bin (counted one half, each could be a whole win or none)."""
        positive, negative = self._classes()
        return float((positive * negative).sum()) / (2.0 * float(positive.sum()) * float(negative.sum()))

    def logloss(self) -> float:
        """Mean binary cross-entropy (natural log) of the rows counted."""
        if self.rows == 0:
            raise ValueError("log-loss of no rows")
        return float(self.totals[2 * BINS]) / self.rows


def _need_both_classes(num_pos: int, num_neg: int) -> None:
    if num_pos == 0 or num_neg == 0:
        raise ValueError(f"AUC needs both classes; got {num_pos} positives and {num_neg} negatives")
