"""Config schemas of the rec job: the model and the two data sources (synthetic, a prepared Criteo store).

The submit side imports this module to validate a config before anything is queued, so it must stay
torch-free: every `build` method imports its implementation lazily. Each field declares its bounds
(`metadata=bounds(...)`), which gpujobs' one validator enforces as it does for gpujobs' own schemas
(`gpujobs.config.validate.Checked`). Keys in the errors raised here are field names ("embedding_dim"); the
caller places them under "model." or "data.". The data schemas' `check_job` relates them to the rest of
the job (the ranks, `trainer.grad_accum`) and names full keys ("data.batch_size"): gpujobs' `JobConfig`
calls it, so the global batch is checked at submit, not first inside the ranks.
"""

from __future__ import annotations

import abc
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from gpujobs.base.errors import ConfigError
from gpujobs.config.model_shape import ModelShape
from gpujobs.config.validate import Checked, bounds, check_slurm_path, check_text
from jobs.rec.features import HASH_BUCKETS_ALLOWED, FeatureSpec, criteo_features, is_hash_buckets
from jobs.rec.sizes import cross_parameters, mlp_parameters

if TYPE_CHECKING:
    from torch import nn

    from gpujobs.config.schema import JobConfig
    from gpujobs.data.prepare import PreparePlan
    from jobs.rec.criteo_store import CriteoParser
    from jobs.rec.data import RecData
    from jobs.rec.dcnv2 import DCNv2
    from jobs.rec.model import DLRM, RecModel

INTERACTIONS = ("dot", "cat")
#: gpujobs.data.prepare.BAD_LINES (a test holds them equal), spelled here: importing the data layer (numpy)
#: would cost every submit a tenth of a second for two words
BAD_LINES = ("fail", "skip")
_STORE = bounds(valid=lambda value: bool(value.strip()), allowed="a non-empty directory path")
_FILES = bounds(valid=lambda value: _is_patterns(value), allowed="a path or glob of input files, or a list of them")


def check_global_batch(
    data: SyntheticClicksConfig | CriteoConfig, world_size: int, grad_accum: int, rows: Optional[int], source: str
) -> None:
    """Refuse a global batch that `RecData` could not serve, naming the key the user set ("data.*").

    `world_size` is the configured one (resources' nodes x ranks per node), which is also the most an
    elastic job runs on: a micro-batch must give each rank at least one row (the split plans' floor), and
    a micro-batch of `world_size` x batch_size rows then serves any smaller allocation too. `rows` is the
    training split's size where it is known (`source` says where it comes from); None skips that bound.
    """
    if data.global_batch_size is None:  # derived: batch_size x world x grad_accum, a whole number of micro-batches
        if rows is not None and data.batch_size * world_size > rows:
            allowed = (f"at most {rows // world_size} (a micro-batch, {world_size} ranks x data.batch_size, "
                       f"must fit in {source})")
            raise ConfigError("data.batch_size", data.batch_size, allowed)
        return
    total, least = data.global_batch_size, world_size * grad_accum
    most = None if rows is None else rows * grad_accum
    if total % grad_accum or total < least or (most is not None and total > most):
        allowed = (f"a multiple of trainer.grad_accum={grad_accum} from {least} (a row per rank per micro-batch, "
                   f"{world_size} ranks)") + ("" if most is None else f" to {most} ({source} per micro-batch)")
        raise ConfigError("data.global_batch_size", total, allowed)


@dataclass(kw_only=True)
class RecModelConfig(Checked, abc.ABC):
    """What the rec models' schemas share: embedding tables and a bottom MLP making F = 1 + num_categorical
    vectors of `embedding_dim`, an interaction of them, a top MLP to one logit (`jobs.rec.model.RecModel`)."""

    _target_: str
    """Hydra instantiates this schema; the trainer then calls `build`."""
    embedding_dim: int = field(default=16, metadata=bounds(ge=1))
    """Width of every embedding vector and of the bottom MLP's output (the interaction takes F such vectors)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64], metadata=bounds(ge=1))
    """Hidden sizes of the dense-feature MLP; a last layer to `embedding_dim` is always added."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 32], metadata=bounds(ge=1))
    """Hidden sizes of the MLP over the interaction output; a last layer to one logit is always added."""
    embedding_lr_scale: float = field(default=8.0, metadata=bounds(gt=0.0, lt=1e3))
    """Multiplies the embeddings' effective learning rate under Adam (a row of a rare value is in few batches
    and must learn fast: rows are stored divided by it and scaled back up in the forward); 1 disables it."""

    @abc.abstractmethod
    def build(self, features: FeatureSpec, tables: Optional[nn.Module] = None) -> RecModel:
        """The model for `features`, initialised from torch's global RNG (the trainer seeds it); `tables`: a
        sparse arch to use instead of the model's own tables (TorchRec's, under parallel=torchrec)."""

    @abc.abstractmethod
    def top_width(self, features: FeatureSpec) -> int:
        """The width of the interaction's output, the top MLP's input."""

    @abc.abstractmethod
    def interaction_parameters(self, features: FeatureSpec) -> int:
        """The parameters of the interaction (none for a fixed one, such as dot products)."""

    def shape(self, features: FeatureSpec) -> ModelShape:
        """The model `build(features)` makes, from the config alone (torch-free, for memory plans): one table
        per categorical feature (`FeatureSpec.tables`), and the count of every other parameter."""
        bottom = mlp_parameters(features.num_dense, self.bottom_mlp, self.embedding_dim)
        top = mlp_parameters(self.top_width(features), self.top_mlp, 1)
        dense = bottom + self.interaction_parameters(features) + top
        return ModelShape(tables=features.tables(self.embedding_dim), dense_parameters=dense)


@dataclass(kw_only=True)
class DLRMConfig(RecModelConfig):
    """A DLRM-style model: embeddings + bottom MLP, pairwise interaction, top MLP to one logit."""

    _target_: str = "jobs.rec.config.DLRMConfig"
    """Hydra instantiates this schema; the trainer then calls `build`."""
    interaction: str = field(default="dot", metadata=bounds(one_of=INTERACTIONS))
    """"dot": pairwise dot products of all feature vectors (DLRM); "cat": plain concatenation."""

    def build(self, features: FeatureSpec, tables: Optional[nn.Module] = None) -> DLRM:
        """The model for `features`, initialised from torch's global RNG (the trainer seeds it)."""
        from jobs.rec.model import DLRM

        return DLRM(features, self, tables)

    def top_width(self, features: FeatureSpec) -> int:
        """The dense vector and the pairwise dot products ("dot"), or all F vectors ("cat")."""
        if self.interaction == "dot":
            return self.embedding_dim + features.num_vectors * (features.num_vectors - 1) // 2
        return self.embedding_dim * features.num_vectors

    def interaction_parameters(self, features: FeatureSpec) -> int:
        """None: dot products and concatenation learn nothing."""
        return 0


@dataclass(kw_only=True)
class DCNv2Config(RecModelConfig):
    """DLRM-DCNv2, MLPerf Training's recommendation model: the F vectors concatenated go through low-rank
    DCN-v2 cross layers, then the top MLP (`jobs.rec.dcnv2.DCNv2`). `+experiment=dlrm_dcnv2` sets the
    reference's sizes."""

    _target_: str = "jobs.rec.config.DCNv2Config"
    """Hydra instantiates this schema; the trainer then calls `build`."""
    cross_layers: int = field(default=2, metadata=bounds(ge=1))
    """Cross layers x_next = x0 * (U (V x) + b) + x over the F x embedding_dim concatenated values."""
    low_rank: int = field(default=16, metadata=bounds(ge=1))
    """Rank of each cross layer's U V (V: F x embedding_dim -> low_rank, U: back): 2 x F x embedding_dim x
    low_rank weights a layer, which full rank would square."""

    def build(self, features: FeatureSpec, tables: Optional[nn.Module] = None) -> DCNv2:
        """The model for `features`, initialised from torch's global RNG (the trainer seeds it)."""
        from jobs.rec.dcnv2 import DCNv2

        return DCNv2(features, self, tables)

    def top_width(self, features: FeatureSpec) -> int:
        """The F vectors concatenated, as the cross layers leave them."""
        return features.num_vectors * self.embedding_dim

    def interaction_parameters(self, features: FeatureSpec) -> int:
        """The cross layers' V, U and b."""
        return cross_parameters(self.top_width(features), self.low_rank, self.cross_layers)


@dataclass(kw_only=True)
class SyntheticClicksConfig(Checked):
    """A click log sampled from a hidden ground-truth model, so the best reachable AUC is known.

    The defaults are sized so that 2 CPU ranks learn most of the reachable AUC in about a minute.
    """

    _target_: str = "jobs.rec.config.SyntheticClicksConfig"
    """Hydra instantiates this schema; the trainer then calls `build`."""
    num_train: int = field(default=200_000, metadata=bounds(ge=1))
    """Training samples; every rank generates all of them and reads its slice of each step."""
    num_eval: int = field(default=50_000, metadata=bounds(ge=2))
    """Held-out samples for AUC and log-loss."""
    num_dense: int = field(default=8, metadata=bounds(ge=1))
    """Dense (real-valued) features per sample."""
    cardinalities: list[int] = field(
        default_factory=lambda: [2000, 1000, 1000, 500, 200, 100, 100, 50], metadata=bounds(ge=2, min_len=1)
    )
    """Number of distinct values of each categorical feature."""
    batch_size: int = field(default=256, metadata=bounds(ge=1))
    """Samples per rank per micro-step at the configured world size: the global batch is
    batch_size * resources' world size * trainer.grad_accum unless global_batch_size says otherwise."""
    global_batch_size: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Samples per optimizer step, all ranks together (default: from batch_size). Set it to resume or
    rerun a run at another world size with the same global sample stream."""
    seed: int = field(default=0, metadata=bounds(ge=0))
    """Seed of the generated data and of its shuffling; independent of the training seed."""
    ctr: float = field(default=0.2, metadata=bounds(gt=0.0, lt=1.0))
    """Share of clicks (positive labels) the hidden model is calibrated to."""
    zipf_exponent: float = field(default=1.3, metadata=bounds(gt=0.0, lt=10.0))
    """Skew of categorical value frequencies: value of popularity rank k is drawn with weight k**-s."""
    signal_scale: float = field(default=1.0, metadata=bounds(gt=0.0, lt=100.0))
    """Multiplies the hidden model's logit around its bias; larger means a higher oracle AUC."""
    num_interactions: int = field(default=3, metadata=bounds(ge=0))
    """Pairs of categorical features whose values interact (low-rank) in the hidden model."""

    def __post_init__(self) -> None:
        super().__post_init__()
        num_pairs = len(self.cardinalities) * (len(self.cardinalities) - 1) // 2
        if self.num_interactions > num_pairs:
            allowed = f"at most {num_pairs}, the number of pairs of {len(self.cardinalities)} features"
            raise ConfigError("num_interactions", self.num_interactions, allowed)

    def check_job(self, job: JobConfig) -> None:
        """Refuse a global batch this log cannot serve at the job's ranks and `trainer.grad_accum`
        (ConfigError naming the full key: the rules span sections)."""
        world = job.resources.world_size
        if self.num_train < world:
            raise ConfigError("data.num_train", self.num_train, f"at least {world} (a row per rank, {world} ranks)")
        check_global_batch(self, world, job.trainer.grad_accum, self.num_train, f"data.num_train={self.num_train} rows")

    def global_batch(self, world_size: int, micro_batches: int) -> int:
        """Samples per optimizer step: global_batch_size, else batch_size per rank of `world_size`."""
        return self.global_batch_size or self.batch_size * world_size * micro_batches

    def features(self) -> FeatureSpec:
        """The log's feature shape: `num_dense` dense features, a categorical one per `cardinalities` entry."""
        return FeatureSpec(self.num_dense, tuple(self.cardinalities))

    def build(self, world_size: int, micro_batches: int) -> RecData:
        """Generate the log (identically on every rank) and its global sample stream; `world_size` is the
        configured one, which only sizes the default global batch."""
        from jobs.rec.data import RecData
        from jobs.rec.synthetic import generate_clicks

        log = generate_clicks(self)
        return RecData(
            log.features,
            log.train,
            log.eval,
            global_batch_size=self.global_batch(world_size, micro_batches),
            micro_batches=micro_batches,
            seed=self.seed,
            oracle_auc=log.oracle_auc,
        )


@dataclass(kw_only=True)
class CriteoConfig(Checked):
    """Criteo-format click logs (`label, I1..I13, C1..C26` per line, tab-separated, plain or gzip), read from a
    sample store prepared once by `gpujobs prepare` with this same config.

    Training opens `store` and reads only each step's rows: opening it costs the same at any
    size and memory per rank does not grow with the rows. The input files matter to `gpujobs prepare` only.
    """

    _target_: str = "jobs.rec.config.CriteoConfig"
    """Hydra instantiates this schema; the trainer then calls `build`."""
    train_files: Any = field(default_factory=list, metadata=_FILES)
    """Training logs to prepare: a list of paths or globs (`'/data/day_*.gz'`), or one as a string."""
    eval_files: Any = field(default_factory=list, metadata=_FILES)
    """Held-out logs to prepare, for AUC and log-loss: a list of paths or globs, or one as a string."""
    store: str = field(metadata=_STORE)
    """The prepared store's directory (made absolute where the config is composed: the ranks may start
    elsewhere): `gpujobs prepare` writes it, training reads it."""
    bad_lines: str = field(default="fail", metadata=bounds(one_of=BAD_LINES))
    """A damaged input line: "fail" names its file and line; "skip" skips it and counts it in the manifest."""
    hash_buckets: Any = field(default=100_000, metadata=bounds(valid=is_hash_buckets, allowed=HASH_BUCKETS_ALLOWED))
    """Categorical values are hashed into this many buckets per column (plus one for "missing"): one count for
    all 26 columns, or a list of 26 counts, one per column (`+experiment=dlrm_dcnv2` sets MLPerf's)."""
    batch_size: int = field(default=256, metadata=bounds(ge=1))
    """Samples per rank per micro-step at the configured world size: the global batch is
    batch_size * resources' world size * trainer.grad_accum unless global_batch_size says otherwise."""
    global_batch_size: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Samples per optimizer step, all ranks together (default: from batch_size)."""
    seed: int = field(default=0, metadata=bounds(ge=0))
    """Seed of the shuffling; independent of the training seed."""
    prepare_workers: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Processes of `gpujobs prepare` on one machine (null: one per input file, at most one per CPU)."""
    verify: bool = False
    """Open the store checking every column file's sha256 against the manifest, at submit and in each rank
    (O(bytes): the whole store is read). Without it opening checks each shard's shard.json against the
    manifest and each column file's size and mtime, which miss a change that keeps both."""

    SAME_RUN_IGNORES: ClassVar[tuple[str, ...]] = ("prepare_workers", "verify")
    """Keys a run may change and still resume its checkpoints: they change no training step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.train_files = _patterns("train_files", self.train_files)
        self.eval_files = _patterns("eval_files", self.eval_files)
        self.store = str(Path(self.store).expanduser().absolute())
        if not isinstance(self.hash_buckets, int):  # a list, as a command line or YAML gives it
            self.hash_buckets = list(self.hash_buckets)

    def global_batch(self, world_size: int, micro_batches: int) -> int:
        """Samples per optimizer step: global_batch_size, else batch_size per rank of `world_size`."""
        return self.global_batch_size or self.batch_size * world_size * micro_batches

    def features(self) -> FeatureSpec:
        """The stores' feature shape: 13 dense features, and categorical column c's index 0 ("missing") and
        1..hash_buckets[c] (`jobs.rec.features.criteo_features`)."""
        return criteo_features(self.hash_buckets)

    def parser(self) -> CriteoParser:
        """The parser that prepares this config's store (its name and settings are recorded in the manifest)."""
        from jobs.rec.criteo_store import CriteoParser

        return CriteoParser(self.hash_buckets)

    def check_job(self, job: JobConfig) -> None:
        """Refuse what the config alone tells: a global batch the ranks cannot share, a store path Slurm would
        misread. The store itself is checked by `check_here` at submit (a prepare composes this config too,
        before the store exists)."""
        check_slurm_path("data.store", self.store, slurm=job.cluster.name in ("auto", "slurm"))
        check_global_batch(self, job.resources.world_size, job.trainer.grad_accum, None, "")

    def check_here(self, job: JobConfig) -> None:
        """At submit (`gpujobs.launch.preflight`): the store must be prepared, finished, of this config's
        hash_buckets and unchanged since (`check_store`, O(shards) small reads and stats; O(bytes) with
        `verify`), prepared from the files that train_files and eval_files name, as they are now (where they
        name any), and its training rows must serve the global batch (read from the manifest, no data read).
        StoreError/ConfigError naming data.store.

        A Slurm job's store may live on storage only the nodes mount: where not even its parent directory
        is visible here, a line says so and the ranks check it as they open it."""
        from gpujobs.data.manifest import StoreError, check_sources, check_store
        from gpujobs.data.prepare import expand_inputs

        store = Path(self.store)
        if job.cluster.name == "slurm" and not store.parent.is_dir():
            print(f"gpujobs: data.store={store} is not visible here: the ranks check it as they open it",
                  file=sys.stderr)
            return
        parser = self.parser()
        manifest = check_store(store, parser.name, parser.settings(), self.verify)
        for split, key, patterns in self._inputs():
            if patterns:  # none named: the config trains on the store as it was prepared
                check_sources(store, manifest, split, key, expand_inputs(key, patterns))
        if manifest.rows("eval") < 1:
            raise StoreError(store, "it holds no eval rows: prepare it with data.eval_files")
        rows = manifest.rows("train")
        source = f"the {rows} training rows of data.store"
        check_global_batch(self, job.resources.world_size, job.trainer.grad_accum, rows, source)

    def prepare_plan(self) -> PreparePlan:
        """What `gpujobs prepare` does: each split's files (globs expanded, sorted) into `store` with the
        Criteo parser. ConfigError naming data.train_files/eval_files when one lists nothing or matches nothing."""
        from gpujobs.data.prepare import PreparePlan, expand_inputs

        splits = {}
        for split, key, patterns in self._inputs():
            if not patterns:
                raise ConfigError(key, patterns, "one or more paths or globs of Criteo-format files to prepare")
            splits[split] = expand_inputs(key, patterns)
        return PreparePlan(store=Path(self.store), splits=splits, parser=self.parser(), bad_lines=self.bad_lines)

    def _inputs(self) -> tuple[tuple[str, str, list[str]], ...]:
        """(split, its key, its patterns) of the store's two splits."""
        return (("train", "data.train_files", self.train_files), ("eval", "data.eval_files", self.eval_files))

    def build(self, world_size: int, micro_batches: int) -> RecData:
        """Open the store (checked as at submit) and its global sample stream (see SyntheticClicksConfig.build):
        no row is read here, and nothing per row is allocated."""
        from gpujobs.data.reader import SampleStore
        from jobs.rec.data import RecData, StoreRows

        parser = self.parser()
        store = SampleStore.open(Path(self.store), parser.name, parser.settings(), self.verify)
        rows = store.rows("train")  # the batch rule again: a Slurm job's store may not have been visible at submit
        check_global_batch(self, world_size, micro_batches, rows, f"the {rows} training rows of data.store")
        features = self.features()
        return RecData(
            features,
            StoreRows(store, "train", features, self.store),
            StoreRows(store, "eval", features, self.store),
            global_batch_size=self.global_batch(world_size, micro_batches),
            micro_batches=micro_batches,
            seed=self.seed,
            oracle_auc=None,
        )


def _is_patterns(value: Any) -> bool:
    """A path or glob (non-empty text), or a list of them: what `train_files`/`eval_files` take."""
    items = [value] if isinstance(value, str) else value
    return isinstance(items, (list, tuple)) and all(isinstance(item, str) and item.strip() for item in items)


def _patterns(key: str, value: str | list[str]) -> list[str]:
    """`train_files`/`eval_files` (checked by `_is_patterns`) as a list: one string (as a command line gives
    it) is a list of one."""
    items = [value] if isinstance(value, str) else list(value)
    for item in items:  # a field typed Any is not scanned for control characters by the validator
        check_text(key, item)
    return items
