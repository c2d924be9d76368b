"""The rec job's data side: config schemas, synthetic log, batch schedule, Criteo reader, metrics."""

from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from gpujobs.base.errors import ConfigError
from jobs.rec.config import CriteoTSVConfig, DLRMConfig, SyntheticClicksConfig
from jobs.rec.data import FeatureSpec, RecBatch, RecData
from jobs.rec.metrics import auc, logloss
from jobs.rec.synthetic import generate_clicks

REPO = Path(__file__).resolve().parent.parent
SMALL = SyntheticClicksConfig(num_train=3000, num_eval=1000, num_dense=3, cardinalities=[50, 20, 10], batch_size=32)


# --- config -------------------------------------------------------------------------------------


def test_config_import_leaves_torch_unimported() -> None:
    code = "import jobs.rec.config, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.parametrize(
    ("schema", "kwargs", "key"),
    [
        (DLRMConfig, {"embedding_dim": 0}, "embedding_dim"),
        (DLRMConfig, {"top_mlp": [32, 0]}, "top_mlp"),
        (DLRMConfig, {"interaction": "cross"}, "interaction"),
        (DLRMConfig, {"embedding_lr_scale": -1.0}, "embedding_lr_scale"),
        (SyntheticClicksConfig, {"cardinalities": []}, "cardinalities"),
        (SyntheticClicksConfig, {"cardinalities": [10, 1]}, "cardinalities"),
        (SyntheticClicksConfig, {"batch_size": True}, "batch_size"),
        (SyntheticClicksConfig, {"num_train": 0}, "num_train"),
        (SyntheticClicksConfig, {"ctr": 1.5}, "ctr"),
        (SyntheticClicksConfig, {"seed": -1}, "seed"),
        (SyntheticClicksConfig, {"cardinalities": [10, 10], "num_interactions": 2}, "num_interactions"),
        (CriteoTSVConfig, {"train_path": "", "eval_path": "e.tsv"}, "train_path"),
        (CriteoTSVConfig, {"train_path": "t.tsv", "eval_path": "e.tsv", "hash_buckets": 0}, "hash_buckets"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(schema: type, kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        schema(**kwargs)
    assert caught.value.key == key
    assert str(caught.value).startswith(f"{key}=")


@pytest.mark.parametrize(
    ("yaml_name", "schema", "required"),
    [
        ("model/dlrm.yaml", DLRMConfig, {}),
        ("data/synthetic.yaml", SyntheticClicksConfig, {}),
        ("data/criteo.yaml", CriteoTSVConfig, {"train_path": "t.tsv", "eval_path": "e.tsv"}),
    ],
)
def test_yaml_sets_every_field_to_the_schema_default(yaml_name: str, schema: type, required: dict[str, str]) -> None:
    values = OmegaConf.load(REPO / "conf" / yaml_name)
    assert isinstance(values, DictConfig)
    assert set(values) == {f.name for f in dataclasses.fields(schema)}
    merged = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values, required))
    assert merged == schema(**required)
    assert values["_target_"] == f"{schema.__module__}.{schema.__qualname__}"


# --- synthetic log ------------------------------------------------------------------------------


def test_synthetic_log_is_a_function_of_its_config() -> None:
    first, again, other = (
        generate_clicks(SMALL),
        generate_clicks(SMALL),
        generate_clicks(dataclasses.replace(SMALL, seed=1)),
    )
    for split in ("train", "eval"):
        for a, b in zip(getattr(first, split), getattr(again, split), strict=True):
            assert torch.equal(a, b)
    assert first.oracle_auc == again.oracle_auc
    assert not torch.equal(first.train.sparse, other.train.sparse)


def test_default_synthetic_log_is_realistic() -> None:
    log = generate_clicks(SyntheticClicksConfig())
    assert 0.70 <= log.oracle_auc <= 0.90
    assert 0.10 <= float(log.train.label.mean()) <= 0.30
    assert log.train.num_rows == 200_000 and log.eval.num_rows == 50_000
    counts = torch.bincount(log.train.sparse[:, 0], minlength=2000).sort(descending=True).values
    assert counts[:20].sum() > counts[200:].sum()  # a few values are common, most are rare


# --- batch schedule -----------------------------------------------------------------------------


def _numbered(rows: int, num_eval: int = 10) -> tuple[FeatureSpec, RecBatch, RecBatch]:
    """Splits whose dense feature 0 is the row number, so a batch shows which rows it holds."""
    features = FeatureSpec(1, (5,))

    def split(n: int) -> RecBatch:
        return RecBatch(
            torch.arange(n, dtype=torch.float32).unsqueeze(1),
            torch.arange(n).remainder(5).unsqueeze(1),
            torch.zeros(n),
        )

    return features, split(rows), split(num_eval)


def _data(global_batch: int, micro_batches: int = 1, seed: int = 0) -> RecData:
    features, train, eval = _numbered(100)
    return RecData(
        features, train, eval, global_batch_size=global_batch, micro_batches=micro_batches, seed=seed, oracle_auc=None
    )


def _rows(batch: RecBatch) -> list[int]:
    return [int(v) for v in batch.dense[:, 0]]


def test_steps_read_disjoint_rows_that_cover_an_epoch() -> None:
    data = _data(42, micro_batches=2)  # 100 rows: 4 micro-batches of 21 per epoch, a tail of 16 dropped
    assert data.samples_per_epoch == 84
    epoch_rows: list[list[int]] = [[], []]
    for step in range(4):  # steps 0-1: epoch 0, 2-3: epoch 1
        epoch_rows[data.epoch_of(step)] += _rows(data.train_rows(step, 0, 42))
    for rows in epoch_rows:
        assert len(rows) == len(set(rows)) == 84
    assert epoch_rows[0] != epoch_rows[1]  # a new permutation each epoch


def test_train_rows_are_a_pure_function_of_seed_and_step() -> None:
    data = _data(16, micro_batches=2)
    expected = _rows(data.train_rows(3, 5, 13))
    data.train_rows(40, 0, 8)  # another epoch's permutation now sits in the cache
    assert _rows(data.train_rows(3, 5, 13)) == expected
    assert _rows(_data(16, micro_batches=2).train_rows(3, 5, 13)) == expected  # as after a restart
    assert _rows(_data(16, micro_batches=2, seed=1).train_rows(3, 5, 13)) != expected


@pytest.mark.parametrize("cuts", [[8], [13], [1, 2, 15], [3, 8, 11]])
def test_global_batch_does_not_depend_on_how_it_is_split(cuts: list[int]) -> None:
    data = _data(16)
    whole = _rows(data.train_rows(9, 0, 16))
    edges = [0, *cuts, 16]
    pieces = [row for a, b in itertools.pairwise(edges) for row in _rows(data.train_rows(9, a, b))]
    assert pieces == whole


def test_a_slice_across_micro_batches_is_their_rows_in_order() -> None:
    data = _data(16, micro_batches=2)
    assert _rows(data.train_rows(5, 4, 12)) == _rows(data.train_rows(5, 4, 8)) + _rows(data.train_rows(5, 8, 12))


def test_global_batch_larger_than_the_data_or_not_a_multiple_of_accum_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="global_batch_size=101"):
        _data(101)
    with pytest.raises(ConfigError, match=r"global_batch_size=15.*grad_accum=2"):
        _data(15, micro_batches=2)


def test_eval_batches_cover_the_whole_eval_split_in_order() -> None:
    data = _data(16)
    batches = list(data.eval_batches(batch_size=4))
    assert [b.num_rows for b in batches] == [4, 4, 2]
    assert [r for b in batches for r in _rows(b)] == list(range(10))


def test_synthetic_config_builds_the_global_stream() -> None:
    data = SMALL.build(world_size=2, micro_batches=1)
    assert data.global_batch_size == 64  # batch_size 32 per rank of the configured 2
    batch = data.train_rows(0, 32, 64)
    assert batch.dense.shape == (32, 3) and batch.dense.dtype == torch.float32
    assert batch.sparse.shape == (32, 3) and batch.sparse.dtype == torch.int64
    assert batch.label.shape == (32,) and batch.label.dtype == torch.float32
    assert data.features == FeatureSpec(3, (50, 20, 10))
    assert data.oracle_auc is not None and 0.5 < data.oracle_auc < 1.0


# --- Criteo reader ------------------------------------------------------------------------------


def _criteo_line(label: str, ints: list[str], cats: list[str]) -> str:
    return "\t".join([label, *ints, *cats]) + "\n"


def test_criteo_config_builds_the_global_stream(tmp_path: Path) -> None:
    lines = [_criteo_line(str(i % 2), [str(i)] * 13, [f"{i:08x}"] * 26) for i in range(20)]
    (tmp_path / "train.tsv").write_text("".join(lines))
    (tmp_path / "eval.tsv").write_text("".join(lines[:5]))
    cfg = CriteoTSVConfig(
        train_path=str(tmp_path / "train.tsv"), eval_path=str(tmp_path / "eval.tsv"), hash_buckets=16, batch_size=4
    )
    data = cfg.build(world_size=2, micro_batches=1)
    assert data.oracle_auc is None
    assert data.features == FeatureSpec(13, (17,) * 26)
    assert data.samples_per_epoch == 16 and data.num_eval == 5
    assert data.train_rows(0, 0, 4).sparse.shape == (4, 26)
    assert dataclasses.replace(cfg, global_batch_size=6).build(world_size=2, micro_batches=2).micro_batch == 3


# --- metrics ------------------------------------------------------------------------------------


def _pairwise_auc(scores: list[float], labels: list[float]) -> float:
    """AUC by definition: over all (positive, negative) pairs, 1 if ordered right, 1/2 if tied."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y == 1]
    neg = [s for s, y in zip(scores, labels, strict=True) if y == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("trial", range(20))
def test_auc_matches_the_pairwise_definition_with_ties(trial: int) -> None:
    generator = torch.Generator().manual_seed(trial)
    n = 5 + trial * 3
    scores = torch.randint(0, 6, (n,), generator=generator).float()  # few distinct values: many ties
    labels = torch.randint(0, 2, (n,), generator=generator).float()
    labels[:2] = torch.tensor([0.0, 1.0])
    assert auc(scores, labels) == pytest.approx(_pairwise_auc(scores.tolist(), labels.tolist()), abs=1e-12)


def test_auc_edge_cases() -> None:
    labels = torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert auc(torch.tensor([0.1, 0.2, 0.3, 0.4]), labels) == 1.0
    assert auc(torch.tensor([0.4, 0.3, 0.2, 0.1]), labels) == 0.0
    assert auc(torch.zeros(4), labels) == 0.5
    with pytest.raises(ValueError, match="both classes"):
        auc(torch.rand(3), torch.ones(3))


def test_logloss_is_mean_binary_cross_entropy() -> None:
    logits = torch.tensor([0.0, 2.0, -1.0])
    labels = torch.tensor([1.0, 0.0, 0.0])
    probs = torch.sigmoid(logits).tolist()
    expected = -(math.log(probs[0]) + math.log(1 - probs[1]) + math.log(1 - probs[2])) / 3
    assert logloss(logits, labels) == pytest.approx(expected)
