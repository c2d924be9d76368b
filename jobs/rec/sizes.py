"""The widths and parameter counts of the rec models' parts, torch-free.

The models (`jobs.rec.model`, `jobs.rec.dcnv2`) are built with these widths, and their configs' `shape()`
counts parameters with them, so a memory plan made on the submit side counts what the ranks build.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def mlp_sizes(in_features: int, hidden: Sequence[int], out_features: int) -> list[int]:
    """The widths an MLP goes through: its input, each hidden layer, its output."""
    return [in_features, *hidden, out_features]


def mlp_parameters(in_features: int, hidden: Sequence[int], out_features: int) -> int:
    """Weights and biases of the MLP of `mlp_sizes(in_features, hidden, out_features)`."""
    return sum(fan_in * fan_out + fan_out
               for fan_in, fan_out in itertools.pairwise(mlp_sizes(in_features, hidden, out_features)))


def cross_parameters(width: int, low_rank: int, layers: int) -> int:
    """Parameters of `layers` low-rank cross layers of DCN-v2 over `width` values: V (width -> low_rank, no
    bias), U (low_rank -> width) and its bias b, each layer."""
    return layers * (2 * width * low_rank + width)
