"""A synthetic click log drawn from a hidden ground-truth model, so the best reachable AUC is known.

The hidden click logit is a sum of the effects a DLRM can represent:
  - a scalar effect per value of each categorical feature, values drawn with Zipf-like popularity (a few
    values are common, most are rare, as in real logs);
  - a linear effect of the dense features, plus one product of two of them (something for the MLP);
  - low-rank interactions between a few pairs of categorical features (something for the dot products).
Its bias is solved so the click rate matches `ctr`, and labels are Bernoulli draws of its probability. The
oracle AUC is the AUC of those true probabilities on the eval split: no model can expect to beat it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from jobs.rec.config import SyntheticClicksConfig
from jobs.rec.data import GENERATOR_STREAM, FeatureSpec, RecBatch, derive_seed
from jobs.rec.metrics import auc

# Relative sizes of the hidden logit's parts before `signal_scale`; chosen so that the default config
# has an oracle AUC of about 0.82-0.84 and a small DLRM reaches 90% of its lift over 0.5 in 400 steps
# of 512 samples.
_VALUE_EFFECT_STD = 0.27
_DENSE_WEIGHT_STD = 0.4
_DENSE_PRODUCT_WEIGHT = 0.3
_INTERACTION_WEIGHT = 0.4
_INTERACTION_RANK = 2


class ClickLog(NamedTuple):
    """A generated log: its feature shape, train and eval splits, and the oracle AUC on eval."""

    features: FeatureSpec
    train: RecBatch
    eval: RecBatch
    oracle_auc: float


class _HiddenModel(NamedTuple):
    """The ground truth: how values are drawn, and the click logit of a row up to its bias."""

    value_by_popularity: list[torch.Tensor]
    """Per categorical feature, int64 [cardinality]: the value of each popularity rank."""
    dense_weights: torch.Tensor
    """float64 [num_dense], linear effects of the dense features."""
    value_effects: list[torch.Tensor]
    """Per categorical feature, float64 [cardinality]: a scalar effect of each value."""
    latent: list[torch.Tensor]
    """Per categorical feature, float64 [cardinality, rank]: the values' interaction vectors."""
    pairs: list[tuple[int, int]]
    """The categorical features whose latent vectors interact."""

    @staticmethod
    def draw(cfg: SyntheticClicksConfig, generator: torch.Generator) -> _HiddenModel:
        """A random ground truth for the feature shape of `cfg`."""
        dense_weights = torch.randn(cfg.num_dense, dtype=torch.float64, generator=generator)
        value_by_popularity, value_effects, latent = [], [], []
        for cardinality in cfg.cardinalities:
            # Without this, value ids would sort by popularity, which real (hashed) ids never do.
            value_by_popularity.append(torch.randperm(cardinality, generator=generator))
            effects = torch.randn(cardinality, dtype=torch.float64, generator=generator)
            value_effects.append(effects * _VALUE_EFFECT_STD)
            # Entries of std rank**-1/4 give dot products of two latent vectors unit variance.
            shape = (cardinality, _INTERACTION_RANK)
            factors = torch.randn(shape, dtype=torch.float64, generator=generator)
            latent.append(factors * _INTERACTION_RANK**-0.25)
        all_pairs = torch.combinations(torch.arange(len(cfg.cardinalities)), r=2)
        chosen = all_pairs[torch.randperm(len(all_pairs), generator=generator)[: cfg.num_interactions]]
        pairs = [(int(i), int(j)) for i, j in chosen.tolist()]
        # Rescaled to the norm expected of N(0, std^2) weights: with only a handful of dense features,
        # the raw draw would swing the oracle AUC from seed to seed.
        dense_weights *= _DENSE_WEIGHT_STD * cfg.num_dense**0.5 / dense_weights.norm()
        return _HiddenModel(value_by_popularity, dense_weights, value_effects, latent, pairs)

    def score(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        """The logit (bias excluded) of every row, float64 [rows]."""
        dense64 = dense.to(torch.float64)
        score = dense64 @ self.dense_weights
        if dense.shape[1] >= 2:
            score += _DENSE_PRODUCT_WEIGHT * dense64[:, 0] * dense64[:, 1]
        for i, effects in enumerate(self.value_effects):
            score += effects[sparse[:, i]]
        for i, j in self.pairs:
            u, v = self.latent[i][sparse[:, i]], self.latent[j][sparse[:, j]]
            score += _INTERACTION_WEIGHT * (u * v).sum(dim=1)
        return score


def generate_clicks(cfg: SyntheticClicksConfig) -> ClickLog:
    """Draw the hidden model and then the samples, all from `cfg.seed`: equal configs, equal logs.

    The hidden model is drawn first so that it depends only on the seed and the feature shape, not on
    `num_train` or `num_eval`.
    """
    generator = torch.Generator().manual_seed(derive_seed(cfg.seed, GENERATOR_STREAM))
    hidden = _HiddenModel.draw(cfg, generator)
    num_rows = cfg.num_train + cfg.num_eval
    dense = torch.randn(num_rows, cfg.num_dense, generator=generator)
    sparse = torch.stack(
        [_zipf_values(values, num_rows, cfg.zipf_exponent, generator) for values in hidden.value_by_popularity],
        dim=1,
    )
    score = cfg.signal_scale * hidden.score(dense, sparse)
    probability = torch.sigmoid(score + _bias_for_rate(score, cfg.ctr))
    label = torch.bernoulli(probability, generator=generator).to(torch.float32)

    split = cfg.num_train
    train = RecBatch(dense[:split], sparse[:split], label[:split])
    eval = RecBatch(dense[split:], sparse[split:], label[split:])
    return ClickLog(cfg.features(), train, eval, auc(probability[split:], label[split:]))


def _zipf_values(
    value_by_popularity: torch.Tensor, size: int, exponent: float, generator: torch.Generator
) -> torch.Tensor:
    """`size` draws of `value_by_popularity`'s entries, the one at (1-based) rank k with weight k**-exponent."""
    cardinality = len(value_by_popularity)
    cdf = torch.arange(1, cardinality + 1, dtype=torch.float64).pow(-exponent).cumsum(0)
    ranks = torch.searchsorted(cdf, torch.rand(size, dtype=torch.float64, generator=generator) * cdf[-1])
    # Rounding can put a draw just past the last cumulative weight.
    return value_by_popularity[ranks.clamp_(max=cardinality - 1)]


def _bias_for_rate(score: torch.Tensor, rate: float) -> float:
    """The bias b with mean(sigmoid(score + b)) == rate, by bisection (the mean is increasing in b)."""
    low, high = -50.0, 50.0
    for _ in range(40):  # 100 / 2**40: far below what the click rate needs
        middle = (low + high) / 2.0
        if float(torch.sigmoid(score + middle).mean()) < rate:
            low = middle
        else:
            high = middle
    return (low + high) / 2.0
