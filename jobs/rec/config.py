"""Config schemas of the rec job: the model and the two data sources.

The submit side imports this module to validate a config before anything is queued, so it must stay
torch-free: every `build` method imports its implementation lazily. Keys in the errors raised here are
field names ("embedding_dim"); the caller places them under "model." or "data.".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpujobs.errors import ConfigError

if TYPE_CHECKING:
    from jobs.rec.data import FeatureSpec, RecData
    from jobs.rec.model import DLRM

INTERACTIONS = ("dot", "cat")


def _int_at_least(key: str, value: object, minimum: int) -> int:
    # bool is an int subclass; `batch_size: true` in YAML is a typo, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"an integer >= {minimum}")
    return value


def _int_list(key: str, values: Iterable[object], minimum: int, *, min_len: int) -> list[int]:
    # Hydra hands lists over as ListConfig; keep a plain list so the dataclass is what it says.
    items = list(values)
    checked: list[int] = []
    for value in items:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            break
        checked.append(value)
    if len(checked) < len(items) or len(items) < min_len:
        allowed = f"a list of at least {min_len} integers, each >= {minimum}"
        raise ConfigError(key, items, allowed)
    return checked


def _float_in(key: str, value: object, low: float, high: float) -> float:
    """`value` as a float, strictly between `low` and `high`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
        raise ConfigError(key, value, f"a number strictly between {low} and {high}")
    return float(value)


def _path(key: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, value, "a non-empty file path")
    return value


@dataclass(kw_only=True)
class DLRMConfig:
    """A DLRM-style model: embeddings + bottom MLP, pairwise interaction, top MLP to one logit."""

    _target_: str = "jobs.rec.config.DLRMConfig"
    """Hydra instantiates this schema; the trainer then calls `build`."""
    embedding_dim: int = 16
    """Width of every embedding vector and of the bottom MLP's output (dot products need them equal)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64])
    """Hidden sizes of the dense-feature MLP; a last layer to `embedding_dim` is always added."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 32])
    """Hidden sizes of the MLP over the interaction output; a last layer to one logit is always added."""
    interaction: str = "dot"
    """"dot": pairwise dot products of all feature vectors (DLRM); "cat": plain concatenation."""
    embedding_lr_scale: float = 8.0
    """Multiplies the embeddings' effective learning rate under Adam (see `DLRM`); 1 disables it."""

    def __post_init__(self) -> None:
        self.embedding_dim = _int_at_least("embedding_dim", self.embedding_dim, 1)
        self.bottom_mlp = _int_list("bottom_mlp", self.bottom_mlp, 1, min_len=0)
        self.top_mlp = _int_list("top_mlp", self.top_mlp, 1, min_len=0)
        if self.interaction not in INTERACTIONS:
            raise ConfigError("interaction", self.interaction, f"one of {', '.join(INTERACTIONS)}")
        self.embedding_lr_scale = _float_in("embedding_lr_scale", self.embedding_lr_scale, 0.0, 1e3)

    def build(self, features: FeatureSpec) -> DLRM:
        """The model for `features`, initialised from torch's global RNG (the trainer seeds it)."""
        from jobs.rec.model import DLRM

        return DLRM(
            num_dense=features.num_dense,
            cardinalities=features.cardinalities,
            embedding_dim=self.embedding_dim,
            bottom_mlp=self.bottom_mlp,
            top_mlp=self.top_mlp,
            interaction=self.interaction,
            embedding_lr_scale=self.embedding_lr_scale,
        )


@dataclass(kw_only=True)
class SyntheticClicksConfig:
    """A click log sampled from a hidden ground-truth model, so the best reachable AUC is known.

    The defaults are sized so that 2 CPU ranks learn most of the reachable AUC in about a minute.
    """

    _target_: str = "jobs.rec.config.SyntheticClicksConfig"
    """Hydra instantiates this schema; the trainer then calls `build`."""
    num_train: int = 200_000
    """Training samples; every rank generates all of them and reads its own shard."""
    num_eval: int = 50_000
    """Held-out samples for AUC and log-loss."""
    num_dense: int = 8
    """Dense (real-valued) features per sample."""
    cardinalities: list[int] = field(default_factory=lambda: [2000, 1000, 1000, 500, 200, 100, 100, 50])
    """Number of distinct values of each categorical feature."""
    batch_size: int = 256
    """Samples per rank per micro-step."""
    seed: int = 0
    """Seed of the generated data and of its shuffling; independent of the training seed."""
    ctr: float = 0.2
    """Share of clicks (positive labels) the hidden model is calibrated to."""
    zipf_exponent: float = 1.3
    """Skew of categorical value frequencies: value of popularity rank k is drawn with weight k**-s."""
    signal_scale: float = 1.0
    """Multiplies the hidden model's logit around its bias; larger means a higher oracle AUC."""
    num_interactions: int = 3
    """Pairs of categorical features whose values interact (low-rank) in the hidden model."""

    def __post_init__(self) -> None:
        self.num_train = _int_at_least("num_train", self.num_train, 1)
        self.num_eval = _int_at_least("num_eval", self.num_eval, 2)
        self.num_dense = _int_at_least("num_dense", self.num_dense, 1)
        self.cardinalities = _int_list("cardinalities", self.cardinalities, 2, min_len=1)
        self.batch_size = _int_at_least("batch_size", self.batch_size, 1)
        self.seed = _int_at_least("seed", self.seed, 0)
        self.ctr = _float_in("ctr", self.ctr, 0.0, 1.0)
        self.zipf_exponent = _float_in("zipf_exponent", self.zipf_exponent, 0.0, 10.0)
        self.signal_scale = _float_in("signal_scale", self.signal_scale, 0.0, 100.0)
        num_pairs = len(self.cardinalities) * (len(self.cardinalities) - 1) // 2
        self.num_interactions = _int_at_least("num_interactions", self.num_interactions, 0)
        if self.num_interactions > num_pairs:
            allowed = f"at most {num_pairs}, the number of pairs of {len(self.cardinalities)} features"
            raise ConfigError("num_interactions", self.num_interactions, allowed)

    def build(self, rank: int, world_size: int, micro_batches: int) -> RecData:
        """Generate the log (identically on every rank) and serve `rank`'s shard of it."""
        from jobs.rec.data import RecData
        from jobs.rec.synthetic import generate_clicks

        log = generate_clicks(self)
        return RecData(
            log.features,
            log.train,
            log.eval,
            batch_size=self.batch_size,
            rank=rank,
            world_size=world_size,
            micro_batches=micro_batches,
            seed=self.seed,
            oracle_auc=log.oracle_auc,
        )


@dataclass(kw_only=True)
class CriteoTSVConfig:
    """Criteo-format TSV files: `label, I1..I13, C1..C26` per line, tab-separated, empty = missing."""

    _target_: str = "jobs.rec.config.CriteoTSVConfig"
    """Hydra instantiates this schema; the trainer then calls `build`."""
    train_path: str
    """Training file; every rank reads all of it and trains on its own shard."""
    eval_path: str
    """Held-out file for AUC and log-loss."""
    hash_buckets: int = 100_000
    """Categorical values are hashed into this many buckets per feature (plus one for "missing")."""
    batch_size: int = 256
    """Samples per rank per micro-step."""
    seed: int = 0
    """Seed of the shuffling; independent of the training seed."""

    def __post_init__(self) -> None:
        self.train_path = _path("train_path", self.train_path)
        self.eval_path = _path("eval_path", self.eval_path)
        self.hash_buckets = _int_at_least("hash_buckets", self.hash_buckets, 1)
        self.batch_size = _int_at_least("batch_size", self.batch_size, 1)
        self.seed = _int_at_least("seed", self.seed, 0)

    def build(self, rank: int, world_size: int, micro_batches: int) -> RecData:
        """Read both files (on every rank) and serve `rank`'s shard of the training file."""
        from jobs.rec.criteo import criteo_features, read_criteo_tsv
        from jobs.rec.data import RecData

        return RecData(
            criteo_features(self.hash_buckets),
            read_criteo_tsv(self.train_path, self.hash_buckets),
            read_criteo_tsv(self.eval_path, self.hash_buckets),
            batch_size=self.batch_size,
            rank=rank,
            world_size=world_size,
            micro_batches=micro_batches,
            seed=self.seed,
            oracle_auc=None,
        )
