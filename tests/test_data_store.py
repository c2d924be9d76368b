"""A store's manifest, the checks that refuse a store, and the memory-mapped reader.

The stores here are written by hand (column files + manifest), so the reader is tested apart from
prepare (tests/test_data_prepare.py prepares real ones).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpujobs.base.atomic import write_json_atomic
from gpujobs.base.errors import ConfigError
from gpujobs.data.layout import StoreLayout, shard_name
from gpujobs.data.manifest import (
    FORMAT_VERSION,
    ColumnFile,
    ColumnSpec,
    Manifest,
    ShardRecord,
    SourceFile,
    StoreError,
    check_store,
    read_manifest,
)
from gpujobs.data.reader import SampleStore
from gpujobs.data.shuffle import IndexShuffle

PARSER = "tests.toy:Parser"
SETTINGS = {"hash_buckets": 10, "hash": "crc32"}
COLUMNS = (ColumnSpec("label", "|u1", 1), ColumnSpec("dense", "<f4", 3), ColumnSpec("sparse", "<i8", 2))


def _shard(layout: StoreLayout, name: str, split: str, values: dict[str, np.ndarray]) -> ShardRecord:
    """Write one shard's column files and record, as prepare would."""
    directory = layout.shard_dir(name)
    directory.mkdir(parents=True)
    files = []
    for spec in COLUMNS:
        path = directory / f"{spec.name}.bin"
        data = np.ascontiguousarray(values[spec.name], dtype=spec.dtype).tobytes()
        path.write_bytes(data)
        info = path.stat()
        files.append(ColumnFile(spec.name, info.st_size, info.st_mtime_ns, hashlib.sha256(data).hexdigest()))
    rows = len(values["label"])
    record = ShardRecord(name, split, rows, SourceFile(f"/in/{name}.tsv", 1, 1), 0, tuple(files))
    write_json_atomic(directory / "shard.json", record.to_json())
    return record


def _values(rows: int, start: int) -> dict[str, np.ndarray]:
    """Rows whose every value tells which global row it is."""
    number = np.arange(start, start + rows)
    return {"label": (number % 2).astype(np.uint8),
            "dense": np.stack([number, number + 0.5, -number], axis=1).astype(np.float32),
            "sparse": np.stack([number, 7 * number], axis=1).astype(np.int64)}


def write_store(root: Path, train_rows: list[int], eval_rows: list[int], **manifest: Any) -> Manifest:
    """A finished store of shards of the given sizes (global row r holds values made from r)."""
    layout = StoreLayout(root)
    shards = []
    for split, sizes in (("train", train_rows), ("eval", eval_rows)):
        start = 0
        for index, rows in enumerate(sizes):
            shards.append(_shard(layout, shard_name(split, index), split, _values(rows, start)))
            start += rows
    payload = {"format_version": FORMAT_VERSION, "parser": PARSER, "settings": SETTINGS,
               "columns": COLUMNS, "shards": tuple(shards), **manifest}
    result = Manifest(**payload)
    write_json_atomic(layout.manifest, result.to_json())
    return result


@pytest.fixture
def store(tmp_path: Path) -> Path:
    write_store(tmp_path / "store", [40, 0, 25, 35], [30, 12])
    return tmp_path / "store"


def test_the_manifest_reads_back_as_written(store: Path) -> None:
    manifest = read_manifest(store)
    assert Manifest.from_json(json.loads(json.dumps(manifest.to_json()))) == manifest
    assert manifest.rows("train") == 100 and manifest.rows("eval") == 42
    assert [s.name for s in manifest.shards] == ["train-00000", "train-00001", "train-00002", "train-00003",
                                                 "eval-00000", "eval-00001"]
    assert check_store(store, PARSER, dict(SETTINGS)) == manifest


def test_take_serves_any_rows_in_the_order_asked(store: Path) -> None:
    reader = SampleStore.open(store, PARSER, SETTINGS)
    assert reader.rows("train") == 100 and reader.rows("eval") == 42
    rows = np.array([99, 0, 40, 39, 64, 65, 40, 99, 12], dtype=np.int64)  # shard edges, repeats
    got = reader.take("train", rows)
    want = _values(100, 0)
    assert set(got) == {"label", "dense", "sparse"}
    for name, values in want.items():
        assert got[name].dtype == values.dtype
        assert np.array_equal(got[name], values[rows])
    assert got["label"].shape == (9,) and got["dense"].shape == (9, 3) and got["sparse"].shape == (9, 2)
    empty = reader.take("eval", np.array([], dtype=np.int64))
    assert empty["dense"].shape == (0, 3)


def test_take_follows_a_shuffle_over_the_whole_split(store: Path) -> None:
    reader = SampleStore.open(store, PARSER, SETTINGS)
    order = IndexShuffle(100, 3)(np.arange(100))
    assert np.array_equal(reader.take("train", order)["sparse"][:, 0], order)


def test_span_reads_contiguous_rows_across_shards(store: Path) -> None:
    reader = SampleStore.open(store, PARSER, SETTINGS)
    want = _values(42, 0)
    for start, stop in ((0, 42), (25, 35), (29, 31), (30, 30), (41, 42)):
        got = reader.span("eval", start, stop)
        for name, values in want.items():
            assert np.array_equal(got[name], values[start:stop]), (name, start, stop)
    whole = reader.span("train", 0, 100)  # across the empty shard train-00001
    assert np.array_equal(whole["sparse"], _values(100, 0)["sparse"])


@pytest.mark.parametrize("rows", [[-1], [100], [0, 250]])
def test_rows_outside_the_split_are_refused(store: Path, rows: list[int]) -> None:
    reader = SampleStore.open(store, PARSER, SETTINGS)
    with pytest.raises(IndexError, match=r"\[0, 100\)"):
        reader.take("train", np.array(rows))
    with pytest.raises(IndexError):
        reader.span("train", 90, 101)
    with pytest.raises(ValueError, match="split 'test'"):
        reader.take("test", np.array([0]))


def test_a_store_sent_to_another_process_opens_its_files_there(store: Path) -> None:
    reader = SampleStore.open(store, PARSER, SETTINGS)
    before = reader.take("train", np.array([5, 70]))
    sent = pickle.dumps(reader)
    assert len(sent) == len(pickle.dumps(SampleStore.open(store, PARSER, SETTINGS)))  # no descriptors, no rows
    copy = pickle.loads(sent)
    assert all(np.array_equal(copy.take("train", np.array([5, 70]))[k], v) for k, v in before.items())


def test_a_shard_is_opened_only_when_its_rows_are_read(store: Path) -> None:
    reader = SampleStore.open(store, PARSER, SETTINGS)
    # gone after open: only a read of that shard's rows would notice
    os.unlink(StoreLayout(store).column_file("train-00003", "dense"))
    assert np.array_equal(reader.take("train", np.array([0, 64]))["dense"][:, 0], [0, 64])
    with pytest.raises(FileNotFoundError):
        reader.take("train", np.array([65]))


def test_a_four_billion_row_manifest_opens_and_serves_without_per_row_memory(tmp_path: Path) -> None:
    """Four shards of 1.1e9 rows in sparse files (no disk used): open, shuffle, and read the last rows."""
    store, rows = tmp_path / "big", 1_100_000_000
    layout = StoreLayout(store)
    shards = []
    for index in range(4):
        name = shard_name("train", index)
        layout.shard_dir(name).mkdir(parents=True)
        files = []
        for spec in COLUMNS:
            path = layout.column_file(name, spec.name)
            path.touch()
            os.truncate(path, rows * spec.row_bytes())
            info = path.stat()
            files.append(ColumnFile(spec.name, info.st_size, info.st_mtime_ns, "0" * 64))
        shards.append(ShardRecord(name, "train", rows, SourceFile(f"/in/{index}", 1, 1), 0, tuple(files)))
        write_json_atomic(layout.shard_record(name), shards[-1].to_json())
    write_json_atomic(layout.manifest, Manifest(FORMAT_VERSION, PARSER, SETTINGS, COLUMNS, tuple(shards)).to_json())
    tracemalloc.start()
    try:
        reader = SampleStore.open(store, PARSER, SETTINGS)
        shuffle = IndexShuffle(reader.rows("train"), 1)
        steps = [shuffle(np.arange(s, s + 512, dtype=np.int64)) for s in (0, 10**7)]
        got = [reader.take("train", rows_of_step) for rows_of_step in steps]
        last = reader.take("train", np.array([4 * rows - 1, 3 * rows, 3 * rows - 1]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reader.rows("train") == 4_400_000_000
    assert peak < 4 * 2**20
    assert got[1]["sparse"].shape == (512, 2) and not got[1]["sparse"].any()  # sparse files read as zeros
    assert last["dense"].shape == (3, 3)


def _refusal(store: Path, parser: str = PARSER, settings: dict[str, Any] = SETTINGS) -> str:
    with pytest.raises(StoreError) as caught:
        SampleStore.open(store, parser, settings)
    message = str(caught.value)
    assert isinstance(caught.value, ConfigError) and caught.value.key == "data.store"  # exit 2 at submit
    assert message.startswith(f"data.store='{store}': ") and "\n" not in message
    return message


def test_a_missing_store_is_refused(tmp_path: Path) -> None:
    assert _refusal(tmp_path / "nowhere").endswith("no such directory: run gpujobs prepare with the same config")
    (tmp_path / "file").write_text("")
    assert "is not a directory" in _refusal(tmp_path / "file")


def test_an_unfinished_store_is_refused(store: Path) -> None:
    StoreLayout(store).manifest.unlink()
    assert _refusal(store).endswith(
        "not prepared, or its prepare did not finish: run gpujobs prepare with the same config")


def test_another_format_version_is_refused(tmp_path: Path) -> None:
    write_store(tmp_path / "s", [3], [2], format_version=FORMAT_VERSION + 1)
    assert f"store format version {FORMAT_VERSION + 1}, this gpujobs reads version {FORMAT_VERSION}" \
        in _refusal(tmp_path / "s")


def test_a_damaged_manifest_is_refused(store: Path) -> None:
    manifest = StoreLayout(store).manifest
    manifest.write_text(manifest.read_text()[:-40])
    assert "manifest.json is damaged" in _refusal(store)


def test_a_manifest_whose_rows_do_not_match_its_files_is_refused(store: Path) -> None:
    manifest = StoreLayout(store).manifest
    payload = json.loads(manifest.read_text())
    payload["shards"][0]["rows"] += 1
    manifest.write_text(json.dumps(payload))
    assert "manifest.json is damaged (shard train-00000's label.bin does not hold 41 rows" in _refusal(store)
    del payload["shards"][0]["columns"][1]
    manifest.write_text(json.dumps(payload))
    assert "shard train-00000 does not hold the columns label, dense, sparse" in _refusal(store)


def test_another_parser_is_refused(store: Path) -> None:
    assert "prepared by parser tests.toy:Parser, this job's parser is jobs.rec.criteo:CriteoParser" \
        in _refusal(store, parser="jobs.rec.criteo:CriteoParser")


def test_other_settings_are_refused(store: Path) -> None:
    message = _refusal(store, settings={**SETTINGS, "hash_buckets": 100000})
    assert "prepared with hash_buckets=10, this job has hash_buckets=100000" in message
    assert "hash=" not in message  # only the keys that differ
    assert "prepared with no extra, this job has extra=1" in _refusal(store, settings={**SETTINGS, "extra": 1})


def test_a_column_file_grown_after_prepare_is_refused(store: Path) -> None:
    with open(StoreLayout(store).column_file("train-00002", "sparse"), "ab") as handle:
        handle.write(b"\0")
    assert _refusal(store).endswith("shard train-00002's sparse.bin changed after prepare: prepare it again")


def test_a_column_file_touched_after_prepare_is_refused(store: Path) -> None:
    path = StoreLayout(store).column_file("eval-00001", "label")
    info = path.stat()
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    assert _refusal(store).endswith("shard eval-00001's label.bin changed after prepare: prepare it again")


def test_a_missing_column_file_is_refused(store: Path) -> None:
    StoreLayout(store).column_file("train-00000", "dense").unlink()
    assert _refusal(store).endswith("shard train-00000's dense.bin is missing: prepare it again")


def _resident_bytes() -> int:
    """This process's resident set (VmRSS), file-backed pages it maps included."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) * 1024


def test_random_rows_of_a_store_do_not_grow_the_rank_with_the_store(tmp_path: Path) -> None:
    """4096 random rows of a 3.5M-row store (about 100 MB, all in the page cache after its writing): a rank's
    resident memory grows by its batch, not by the pages around each row (a memory map would map a whole
    page-cache folio per row: tens of MB here, the store's size at scale)."""
    write_store(tmp_path / "store", [3_500_000], [10])
    reader = SampleStore.open(tmp_path / "store", PARSER, SETTINGS)
    rows = IndexShuffle(reader.rows("train"), 7)(np.arange(4096, dtype=np.int64))
    reader.take("train", rows[:8])  # the descriptors and numpy's first allocations, before the measure
    before = _resident_bytes()
    got = reader.take("train", rows)
    grown = _resident_bytes() - before
    assert np.array_equal(got["sparse"][:, 0], rows)
    assert grown < 4 * 2**20, f"{grown / 2**20:.1f} MB more resident for a 4096-row batch"
