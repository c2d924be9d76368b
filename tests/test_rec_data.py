"""The rec job's data side: config schemas, synthetic log, batch schedule, Criteo reader, metrics."""

from __future__ import annotations

import dataclasses
import itertools
import math
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import compose_job
from omegaconf import DictConfig, OmegaConf
from rec_store import store_from_arrays

from gpujobs.base.errors import ConfigError
from gpujobs.data import prepare
from gpujobs.data.manifest import ColumnSpec
from gpujobs.data.reader import SampleStore
from jobs.rec.config import BAD_LINES, CriteoConfig, DCNv2Config, DLRMConfig, SyntheticClicksConfig
from jobs.rec.data import FeatureSpec, RecBatch, RecData, StoreRows
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
        (CriteoConfig, {"store": " "}, "store"),
        (CriteoConfig, {"store": "/s", "hash_buckets": 0}, "hash_buckets"),
        (CriteoConfig, {"store": "/s", "hash_buckets": 2**31 - 1}, "hash_buckets"),  # an index must fit int32
        (CriteoConfig, {"store": "/s", "hash_buckets": [10] * 25}, "hash_buckets"),  # one per categorical column
        (CriteoConfig, {"store": "/s", "hash_buckets": [10] * 25 + [0]}, "hash_buckets"),
        (CriteoConfig, {"store": "/s", "hash_buckets": [10] * 25 + [2**31 - 1]}, "hash_buckets"),
        (CriteoConfig, {"store": "/s", "hash_buckets": [10] * 25 + [True]}, "hash_buckets"),
        (CriteoConfig, {"store": "/s", "hash_buckets": "1000"}, "hash_buckets"),
        (CriteoConfig, {"store": "/s", "bad_lines": "ignore"}, "bad_lines"),
        (CriteoConfig, {"store": "/s", "prepare_workers": 0}, "prepare_workers"),
        (CriteoConfig, {"store": "/s", "train_files": ["/d/a.gz", " "]}, "train_files"),
        (CriteoConfig, {"store": "/s", "eval_files": 3}, "eval_files"),
        (CriteoConfig, {"store": "/s", "eval_files": "/d/a\n.gz"}, "eval_files"),
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
        ("model/dcnv2.yaml", DCNv2Config, {}),
        ("data/synthetic.yaml", SyntheticClicksConfig, {}),
        ("data/criteo.yaml", CriteoConfig, {"store": "/data/store"}),
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
    data.train_rows(40, 0, 8)  # another epoch first: nothing is kept from one call to the next
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


# --- from a sample store -------------------------------------------------------------------------

STORE_COLUMNS = (ColumnSpec("label", "|u1", 1), ColumnSpec("dense", "<f4", 1), ColumnSpec("sparse", "<i4", 1))


def _columns(first: int, rows: int) -> dict[str, np.ndarray]:
    """Rows `first..first + rows` of a log whose dense feature is the row number (as `_numbered`'s)."""
    numbers = np.arange(first, first + rows)
    return {"label": (numbers % 3 == 0).astype(np.uint8), "dense": numbers.astype(np.float32),
            "sparse": (numbers % 5).astype(np.int32)}


def _batch(columns: dict[str, np.ndarray]) -> RecBatch:
    return RecBatch(torch.from_numpy(columns["dense"]).unsqueeze(1),
                    torch.from_numpy(columns["sparse"].astype(np.int64)).unsqueeze(1),
                    torch.from_numpy(columns["label"].astype(np.float32)))


def _store_and_memory(tmp_path: Path, global_batch: int, micro_batches: int) -> tuple[RecData, RecData]:
    """The same 100 training and 30 eval rows as a store of uneven shards (one empty) and in memory."""
    train = [_columns(0, 40), _columns(40, 0), _columns(40, 35), _columns(75, 25)]
    eval = [_columns(0, 10), _columns(10, 20)]
    store_from_arrays(tmp_path / "store", "toy", {}, STORE_COLUMNS, {"train": train, "eval": eval})
    store = SampleStore.open(tmp_path / "store", "toy", {})
    features = FeatureSpec(1, (5,))
    kwargs = {"global_batch_size": global_batch, "micro_batches": micro_batches, "seed": 7, "oracle_auc": None}
    in_memory = RecData(features, _batch(_columns(0, 100)), _batch(_columns(0, 30)), **kwargs)  # type: ignore[arg-type]
    from_store = RecData(features, StoreRows(store, "train", features, "toy"),  # type: ignore[arg-type]
                         StoreRows(store, "eval", features, "toy"), **kwargs)
    return from_store, in_memory


def test_a_store_serves_the_rows_memory_serves(tmp_path: Path) -> None:
    from_store, in_memory = _store_and_memory(tmp_path, global_batch=24, micro_batches=2)  # 4 steps an epoch
    for step in (0, 3, 4, 9, 1000):
        for start, stop in ((0, 24), (0, 7), (7, 24), (11, 13), (5, 5)):
            stored, held = from_store.train_rows(step, start, stop), in_memory.train_rows(step, start, stop)
            for a, b in zip(stored, held, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), (step, start, stop)
    for first, last in ((0, None), (5, 27), (10, 10)):
        stored_eval = list(from_store.eval_batches(batch_size=7, start=first, stop=last))
        held_eval = list(in_memory.eval_batches(batch_size=7, start=first, stop=last))
        assert [b.num_rows for b in stored_eval] == [b.num_rows for b in held_eval]
        assert all(torch.equal(a, b) for x, y in zip(stored_eval, held_eval, strict=True)
                   for a, b in zip(x, y, strict=True))


def test_a_store_with_indices_outside_the_tables_fails_naming_the_store(tmp_path: Path) -> None:
    """The store's check is sizes and times, not content: a bad index is caught per batch, not in an embedding."""
    bad = _columns(0, 50)
    bad["sparse"][17] = 5  # the table has 5 rows
    store_from_arrays(tmp_path / "store", "toy", {}, STORE_COLUMNS, {"train": [bad], "eval": [_columns(0, 5)]})
    store, features = SampleStore.open(tmp_path / "store", "toy", {}), FeatureSpec(1, (5,))
    data = RecData(features, StoreRows(store, "train", features, "/the/store"), StoreRows(store, "eval", features, "x"),
                   global_batch_size=50, micro_batches=1, seed=0, oracle_auc=None)
    with pytest.raises(ValueError, match=r"data\.store=/the/store: train rows hold categorical indices outside"):
        data.train_rows(0, 0, 50)


def test_a_billion_row_store_serves_any_step_without_per_row_memory(tmp_path: Path) -> None:
    """4.4 billion rows (sparse files: no disk): opening and step 10**7 allocate nothing per row."""
    rows = [1_100_000_000] * 4
    store_from_arrays(tmp_path / "store", "toy", {}, STORE_COLUMNS, {"train": rows, "eval": [_columns(0, 5)]})
    features = FeatureSpec(1, (5,))
    tracemalloc.start()
    try:
        store = SampleStore.open(tmp_path / "store", "toy", {})
        data = RecData(features, StoreRows(store, "train", features, "x"), StoreRows(store, "eval", features, "x"),
                       global_batch_size=4096, micro_batches=1, seed=3, oracle_auc=None)
        batch = data.train_rows(10**7, 1024, 2048)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert data.samples_per_epoch == 4_399_996_928 and data.epoch_of(10**7) == 9
    assert batch.num_rows == 1024
    assert peak < 2 << 20, f"{peak} bytes allocated"


def test_criteo_files_are_a_list_or_one_string_on_the_command_line() -> None:
    one = compose_job("+experiment=rec", "data=criteo", "data.train_files=/d/day_*.gz", "data.eval_files='/d/e.gz'",
                      "data.store=/d/store")
    assert one.data.train_files == ["/d/day_*.gz"] and one.data.eval_files == ["/d/e.gz"]
    many = compose_job("+experiment=rec", "data=criteo", "data.train_files=[/d/day_0.gz,/d/day_?.gz]",
                       "data.store=rel/store")
    assert many.data.train_files == ["/d/day_0.gz", "/d/day_?.gz"] and many.data.eval_files == []
    assert many.data.store == str(Path("rel/store").absolute())  # the ranks may start elsewhere


def test_the_store_path_is_one_slurm_reads_as_written() -> None:
    with pytest.raises(ConfigError, match=r"^data\.store='/d/a%j' is invalid: allowed a path without control"):
        compose_job("+experiment=rec", "cluster=slurm", "data=criteo", "data.store=/d/a%j")
    assert compose_job("+experiment=rec", "cluster=local", "data=criteo", "data.store=/d/a%j").data.store == "/d/a%j"


def test_a_slurm_jobs_store_on_storage_only_its_nodes_mount_is_left_to_the_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unseen = compose_job("+experiment=rec", "cluster=slurm", "data=criteo", f"data.store={tmp_path}/scratch/store")
    unseen.data.check_here(unseen)  # not even its parent is here: the ranks check it as they open it
    assert capsys.readouterr().err == f"gpujobs: data.store={tmp_path}/scratch/store is not visible here: the ranks " \
                                      "check it as they open it\n"
    missing = compose_job("+experiment=rec", "cluster=slurm", "data=criteo", f"data.store={tmp_path}/store")
    with pytest.raises(ConfigError, match=r"^data\.store=.*: no such directory"):
        missing.data.check_here(missing)  # its parent is here: the store is missing, not out of sight


def test_a_store_without_eval_rows_is_refused_at_submit(tmp_path: Path) -> None:
    job = compose_job("+experiment=rec", "cluster=local", "data=criteo", f"data.store={tmp_path}", "data.batch_size=2")
    parser = job.data.parser()
    day = {"label": np.zeros(8, np.uint8), "dense": np.zeros((8, 13), np.float32), "sparse": np.ones((8, 26), np.int32)}
    store_from_arrays(tmp_path, parser.name, parser.settings(), parser.columns(), {"train": [day], "eval": [0]})
    with pytest.raises(ConfigError, match=r"^data\.store=.*: it holds no eval rows: prepare it with data\.eval_files$"):
        job.data.check_here(job)


def test_criteo_prepare_plan_expands_the_globs(tmp_path: Path) -> None:
    assert BAD_LINES == prepare.BAD_LINES
    for name in ("day_1.gz", "day_0.gz", "eval.tsv"):
        (tmp_path / name).write_text("")
    cfg = CriteoConfig(train_files=str(tmp_path / "day_*.gz"), eval_files=[str(tmp_path / "eval.tsv")],
                       store=str(tmp_path / "store"), hash_buckets=16, bad_lines="skip")
    plan = cfg.prepare_plan()
    assert plan.splits == {"train": (tmp_path / "day_0.gz", tmp_path / "day_1.gz"), "eval": (tmp_path / "eval.tsv",)}
    assert plan.store == tmp_path / "store" and plan.bad_lines == "skip"
    assert plan.parser.settings() == CriteoConfig(store="/s", hash_buckets=16).parser().settings()
    with pytest.raises(ConfigError, match=r"^data\.eval_files=\[\] is invalid"):
        dataclasses.replace(cfg, eval_files=[]).prepare_plan()
    with pytest.raises(ConfigError) as caught:
        dataclasses.replace(cfg, train_files=[str(tmp_path / "none_*.gz")]).prepare_plan()
    assert caught.value.key == "data.train_files"


@pytest.mark.parametrize("value", ["[10,10]", "[" + "10," * 25 + "0]", "[a,b]", "1.5", "0"])
def test_bad_hash_buckets_on_a_command_line_is_one_line_naming_the_key(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        compose_job("+experiment=rec", "data=criteo", "data.store=/d/store", f"data.hash_buckets={value}")
    assert caught.value.key == "data.hash_buckets"
    assert "\n" not in str(caught.value)
    assert str(caught.value).endswith("is invalid: allowed an integer in [1, 2147483646] for every categorical "
                                      "column, or a list of 26 such integers, one per column (int32 indices)")


def test_the_data_configs_give_their_feature_shape_torch_free() -> None:
    per_column = list(range(1, 27))
    assert SMALL.features() == FeatureSpec(3, (50, 20, 10)) == generate_clicks(SMALL).features
    assert CriteoConfig(store="/s", hash_buckets=16).features() == FeatureSpec(13, (17,) * 26)
    assert CriteoConfig(store="/s", hash_buckets=per_column).features() == FeatureSpec(13, tuple(range(2, 28)))
    job = compose_job("+experiment=rec", "data=criteo", "data.store=/d/store", f"data.hash_buckets={per_column}")
    assert job.data.hash_buckets == per_column and job.data.features().cardinalities[-1] == 27
    code = ("import sys; from jobs.rec.config import CriteoConfig, SyntheticClicksConfig;"
            "CriteoConfig(store='/s', hash_buckets=list(range(1, 27))).features(); SyntheticClicksConfig().features();"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_criteo_config_of_per_column_buckets_reads_its_store(tmp_path: Path) -> None:
    per_column = [3] * 13 + [1000] * 13
    cfg = CriteoConfig(store=str(tmp_path / "store"), hash_buckets=per_column, batch_size=4)
    parser = cfg.parser()
    assert parser.settings()["hash_buckets"] == per_column
    day = {"label": np.zeros(20, np.uint8), "dense": np.zeros((20, 13), np.float32),
           "sparse": np.full((20, 26), 3, np.int32)}
    splits = {"train": [day], "eval": [day]}
    store_from_arrays(tmp_path / "store", parser.name, parser.settings(), parser.columns(), splits)
    data = cfg.build(world_size=1, micro_batches=1)
    assert data.features == FeatureSpec(13, (4,) * 13 + (1001,) * 13)
    assert data.train_rows(0, 0, 4).sparse.tolist() == [[3] * 26] * 4  # the smallest tables' last rows are theirs
    with pytest.raises(ConfigError, match=r"^data\.store=.*prepared with hash_buckets=\[3, .*\], this job has "
                                          r"hash_buckets=1000"):
        dataclasses.replace(cfg, hash_buckets=1000).build(world_size=1, micro_batches=1)


def test_criteo_config_builds_the_global_stream_from_its_store(tmp_path: Path) -> None:
    cfg = CriteoConfig(store=str(tmp_path / "store"), hash_buckets=16, batch_size=4)
    parser = cfg.parser()
    day = {"label": np.arange(20, dtype=np.uint8) % 2, "dense": np.ones((20, 13), dtype=np.float32),
           "sparse": np.arange(20 * 26, dtype=np.int32).reshape(20, 26) % 17}
    eval_day = {name: values[:5] for name, values in day.items()}
    store_from_arrays(tmp_path / "store", parser.name, parser.settings(), parser.columns(),
                      {"train": [day], "eval": [eval_day]})
    data = cfg.build(world_size=2, micro_batches=1)
    assert data.oracle_auc is None
    assert data.features == FeatureSpec(13, (17,) * 26)
    assert data.samples_per_epoch == 16 and data.num_eval == 5
    batch = data.train_rows(0, 0, 4)
    assert batch.sparse.shape == (4, 26) and batch.sparse.dtype == torch.int64
    assert batch.label.dtype == torch.float32 and set(batch.label.tolist()) <= {0.0, 1.0}
    assert dataclasses.replace(cfg, global_batch_size=6).build(world_size=2, micro_batches=2).micro_batch == 3
    with pytest.raises(ConfigError, match=r"^data\.batch_size=11 is invalid: allowed at most 10 .*20 training rows"):
        dataclasses.replace(cfg, batch_size=11).build(world_size=2, micro_batches=1)
    with pytest.raises(ConfigError, match=r"^data\.store=.*prepared with .*hash_buckets=16, this job has .*=10"):
        dataclasses.replace(cfg, hash_buckets=10).build(world_size=2, micro_batches=1)


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
