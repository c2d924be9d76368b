"""Preparing a store: every row lands, only what is missing is redone, one prepare at a time, and a
prepare killed, or out of disk, leaves nothing half-published and is finished by the next one.

Inputs are tests/data_toy_parser.py's format (the generic store apart from any job). Kills, the lock and a
full disk are caused for real: subprocesses, SIGKILL, and RLIMIT_FSIZE (a write raises EFBIG, as ENOSPC).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from data_toy_parser import ToyParser, write_toy_file

from gpujobs.base.errors import ConfigError
from gpujobs.data.layout import TEMP_PREFIX, StoreLayout
from gpujobs.data.manifest import Manifest, StoreError, check_store
from gpujobs.data.prepare import BadLineError, PreparePlan, expand_inputs, prepare_shard, prepare_store
from gpujobs.data.reader import SampleStore

TESTS = Path(__file__).resolve().parent
PARSER = ToyParser()


def inputs(folder: Path, sizes: tuple[int, ...] = (230, 120, 301), eval_rows: int = 90) -> dict[str, tuple[Path, ...]]:
    """Toy train files of `sizes` rows (the second one gzip) and one eval file."""
    folder.mkdir(exist_ok=True)
    train = tuple(write_toy_file(folder / f"day_{i}.tsv{'.gz' if i == 1 else ''}", rows, seed=i)
                  for i, rows in enumerate(sizes))
    return {"train": train, "eval": (write_toy_file(folder / "eval.tsv", eval_rows, seed=99),)}


def plan_of(store: Path, splits: dict[str, tuple[Path, ...]], parser: ToyParser = PARSER,
            bad_lines: str = "fail") -> PreparePlan:
    return PreparePlan(store, splits, parser, bad_lines)


def parsed(path: Path, parser: ToyParser = PARSER, bad_lines: str = "fail") -> dict[str, np.ndarray]:
    """The parser's rows of `path`, read directly: what the store must hold."""
    chunks = list(parser.parse(path, bad_lines))
    return {spec.name: np.concatenate([c.columns[spec.name] for c in chunks]) for spec in parser.columns()}


def fingerprint(store: Path) -> dict[str, Any]:
    """The store's manifest with the column files' mtimes left out (they differ between two prepares),
    and the sha256 of every file under shards/, read from disk."""
    manifest = json.loads(StoreLayout(store).manifest.read_text())
    for shard in manifest["shards"]:
        for column in shard["columns"]:
            del column["mtime_ns"]
    files = {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted((store / "shards").rglob("*.bin"))}
    return {"manifest": manifest, "files": files}


def leftovers(store: Path) -> list[str]:
    return sorted(p.name for p in StoreLayout(store).shards.glob(f"{TEMP_PREFIX}*"))


def published(store: Path) -> list[str]:
    return sorted(p.name for p in StoreLayout(store).shards.iterdir() if not p.name.startswith(TEMP_PREFIX))


def driver(store: Path, splits: dict[str, tuple[Path, ...]], env: dict[str, str] | None = None,
           **spec: Any) -> list[str]:
    """The command of a prepare in its own process (tests/data_toy_parser.py's `main`)."""
    payload = {"store": str(store), **{k: [str(p) for p in v] for k, v in splits.items()}, **spec}
    return [sys.executable, "-c", "import sys, data_toy_parser; sys.exit(data_toy_parser.main(sys.argv[1]))",
            json.dumps(payload)]


def driver_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def test_a_prepared_store_holds_every_row_of_every_file(tmp_path: Path) -> None:
    splits = inputs(tmp_path / "in")
    lines: list[str] = []
    manifest = prepare_store(plan_of(tmp_path / "store", splits), log=lines.append)
    assert manifest == check_store(tmp_path / "store", PARSER.name, PARSER.settings())
    assert [s.name for s in manifest.shards] == ["train-00000", "train-00001", "train-00002", "eval-00000"]
    assert manifest.rows("train") == 651 and manifest.rows("eval") == 90
    assert all(s.bad_lines == 0 for s in manifest.shards)
    assert any("prepared shard train-00001: 120 rows from" in line for line in lines)
    reader = SampleStore.open(tmp_path / "store", PARSER.name, PARSER.settings())
    for split, files in splits.items():
        want = [parsed(path) for path in files]
        got = reader.span(split, 0, reader.rows(split))
        for spec in PARSER.columns():
            assert np.array_equal(got[spec.name], np.concatenate([w[spec.name] for w in want]))
    for shard in manifest.shards:  # checksums computed while writing are those of the files
        layout = StoreLayout(tmp_path / "store")
        for column in shard.columns:
            assert hashlib.sha256(layout.column_file(shard.name, column.name).read_bytes()).hexdigest() == column.sha256
        assert json.loads(layout.shard_record(shard.name).read_text()) == shard.to_json()


def test_worker_processes_give_the_same_store_as_one_process(tmp_path: Path) -> None:
    splits = inputs(tmp_path / "in")
    prepare_store(plan_of(tmp_path / "one", splits), workers=1, log=lambda _: None)
    prepare_store(plan_of(tmp_path / "three", splits), workers=3, log=lambda _: None)
    assert fingerprint(tmp_path / "one") == fingerprint(tmp_path / "three")


def test_a_rerun_redoes_only_missing_or_changed_shards(tmp_path: Path) -> None:
    splits = inputs(tmp_path / "in")
    store = tmp_path / "store"
    plan = plan_of(store, splits)
    prepare_store(plan, log=lambda _: None)
    layout = StoreLayout(store)
    kept = layout.column_file("train-00000", "word").stat()
    before = fingerprint(store)
    lines: list[str] = []
    prepare_store(plan, log=lines.append)
    assert not any("prepared shard" in line for line in lines)  # nothing to do
    (layout.shards / "train-00001" / "word.bin").unlink()
    write_toy_file(splits["train"][2], 50, seed=7)  # the input changed: its shard is outdated
    (layout.shards / f"{TEMP_PREFIX}eval-00000-4242").mkdir()  # a dead prepare's work in progress
    lines.clear()
    manifest = prepare_store(plan, log=lines.append)
    done = sorted(line.split(":")[1].split()[-1] for line in lines if "prepared shard" in line)
    assert done == ["train-00001", "train-00002"]
    assert any(f"removing {TEMP_PREFIX}eval-00000-4242" in line for line in lines)
    assert leftovers(store) == []
    assert layout.column_file("train-00000", "word").stat().st_mtime_ns == kept.st_mtime_ns  # not rewritten
    assert manifest.rows("train") == 230 + 120 + 50
    after = fingerprint(store)
    assert after["files"]["shards/train-00001/word.bin"] == before["files"]["shards/train-00001/word.bin"]
    assert after["files"]["shards/train-00002/word.bin"] != before["files"]["shards/train-00002/word.bin"]
    check_store(store, PARSER.name, PARSER.settings())


def test_prepare_shard_is_idempotent(tmp_path: Path) -> None:
    plan = plan_of(tmp_path / "store", inputs(tmp_path / "in"))
    StoreLayout(plan.store).shards.mkdir(parents=True)
    first = prepare_shard(plan, "train", 1)
    assert prepare_shard(plan, "train", 1) == first  # the same files: same mtimes, not written again


def test_other_settings_prepare_every_shard_again(tmp_path: Path) -> None:
    splits = inputs(tmp_path / "in")
    store = tmp_path / "store"
    prepare_store(plan_of(store, splits), log=lambda _: None)
    other = ToyParser(buckets=7)
    lines: list[str] = []
    manifest = prepare_store(plan_of(store, splits, parser=other), log=lines.append)
    assert sum("prepared shard" in line for line in lines) == 4
    assert manifest.settings == {"buckets": 7, "hash": "crc32"}
    assert int(SampleStore.open(store, other.name, other.settings()).span("train", 0, 651)["word"][:, 0].max()) < 7
    with pytest.raises(StoreError, match="prepared with buckets=7, this job has buckets=1000"):
        check_store(store, PARSER.name, PARSER.settings())


def test_a_damaged_line_fails_with_its_file_and_line_even_from_a_worker(tmp_path: Path) -> None:
    splits = inputs(tmp_path / "in")
    write_toy_file(splits["train"][2], 301, seed=2, damaged={7: "2\t5\tword"})
    store = tmp_path / "store"
    with pytest.raises(BadLineError) as caught:
        prepare_store(plan_of(store, splits), workers=2, log=lambda _: None)
    assert str(caught.value) == "day_2.tsv:7: label '2' is not 0 or 1"
    assert caught.value.__cause__ is None  # the worker's line, not the pool's remote traceback
    assert "train-00002" not in published(store) and leftovers(store) == []
    assert not StoreLayout(store).manifest.exists()


def test_bad_lines_skip_counts_them_per_file(tmp_path: Path) -> None:
    splits = inputs(tmp_path / "in")
    write_toy_file(splits["train"][0], 230, seed=0, damaged={3: "1\tmany\tword", 200: "0\t1", 230: "x\t1\ty"})
    lines: list[str] = []
    manifest = prepare_store(plan_of(tmp_path / "store", splits, bad_lines="skip"), log=lines.append)
    assert [s.bad_lines for s in manifest.shards] == [3, 0, 0, 0]
    assert manifest.shards[0].rows == 227
    assert any("prepared shard train-00000: 227 rows from" in line and "3 bad lines skipped" in line for line in lines)


def test_a_second_prepare_is_refused_while_one_runs(tmp_path: Path) -> None:
    """Two real processes: the first holds the lock (slowed down); the second is refused in one line."""
    splits = inputs(tmp_path / "in")
    store = tmp_path / "store"
    first = subprocess.Popen(driver(store, splits, chunk_rows=10), env=driver_env(TOY_PARSER_DELAY="0.2"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lock = StoreLayout(store).lock
        _wait_for(lambda: lock.exists() and lock.read_text().startswith(f"{first.pid} "), first)
        second = subprocess.run(driver(store, splits), env=driver_env(), capture_output=True, text=True, timeout=60)
        assert second.returncode == 2
        assert second.stderr == (f"error: data.store='{store}': is being prepared by pid {first.pid} on "
                                 f"{socket.gethostname()}: wait for it to finish, or stop it\n")
    finally:
        first.kill()
        first.wait()
    lines: list[str] = []
    prepare_store(plan_of(store, splits), log=lines.append)  # the kernel dropped the dead one's lock
    check_store(store, PARSER.name, PARSER.settings())


def _wait_for(condition: Callable[[], bool], process: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the prepare ended early: {process.communicate()}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _kill_mid_way(store: Path, splits: dict[str, tuple[Path, ...]], shards: int, workers: int) -> None:
    """Start a slowed prepare; SIGKILL it once `shards` shards are published and another is in progress."""
    process = subprocess.Popen(driver(store, splits, workers=workers, chunk_rows=20),
                               env=driver_env(TOY_PARSER_DELAY="0.03"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        shards_dir = StoreLayout(store).shards
        _wait_for(lambda: shards_dir.is_dir() and len(published(store)) >= shards and bool(leftovers(store)), process)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not StoreLayout(store).manifest.exists()


def test_a_prepare_killed_twice_then_rerun_gives_the_uninterrupted_store(tmp_path: Path) -> None:
    splits = inputs(tmp_path / "in", sizes=(200, 160, 180, 200, 120), eval_rows=160)
    prepare_store(plan_of(tmp_path / "whole", splits), log=lambda _: None)
    store = tmp_path / "store"
    _kill_mid_way(store, splits, shards=1, workers=2)
    at_first_kill = published(store)
    time.sleep(0.5)  # its workers died with it: nothing more gets published
    assert published(store) == at_first_kill
    _kill_mid_way(store, splits, shards=len(at_first_kill) + 1, workers=1)
    at_second_kill = published(store)
    assert len(at_second_kill) < 6 and leftovers(store)
    lines: list[str] = []
    prepare_store(plan_of(store, splits), log=lines.append)
    assert sum("prepared shard" in line for line in lines) == 6 - len(at_second_kill)  # only the missing ones
    assert leftovers(store) == []
    assert fingerprint(store) == fingerprint(tmp_path / "whole")


def test_a_full_disk_publishes_nothing_half_and_the_rerun_finishes(tmp_path: Path) -> None:
    """RLIMIT_FSIZE stands in for a full disk: train-00000's files fit under it, train-00001's do not."""
    splits = inputs(tmp_path / "in", sizes=(40, 400, 30))
    store = tmp_path / "store"
    run = subprocess.run(driver(store, splits, workers=2, fsize_limit=2000), env=driver_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1
    assert run.stderr.startswith(f"error: data.store='{store}': no room to write shard train-00001 (File too large; ")
    assert "bytes free there): free some space and run gpujobs prepare again" in run.stderr
    assert "train-00001" not in published(store) and leftovers(store) == []
    assert not StoreLayout(store).manifest.exists()
    prepare_store(plan_of(store, splits), log=lambda _: None)
    prepare_store(plan_of(tmp_path / "whole", splits), log=lambda _: None)
    assert fingerprint(store) == fingerprint(tmp_path / "whole")


def test_expand_inputs_takes_paths_and_globs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("day_2.gz", "day_10.gz", "day_1.gz", "other.tsv"):
        (tmp_path / name).write_text("")
    monkeypatch.chdir(tmp_path)
    found = expand_inputs("data.train_files", ["day_*.gz", str(tmp_path / "day_1.gz"), "other.tsv"])
    assert found == tuple(tmp_path / n for n in ("day_1.gz", "day_10.gz", "day_2.gz", "other.tsv"))


@pytest.mark.parametrize(("pattern", "allowed"), [("nothing_*.gz", "nothing_*.gz matches nothing"),
                                                  ("missing.tsv", "missing.tsv matches nothing"),
                                                  ("folder", "folder is not one")])
def test_expand_inputs_refuses_what_names_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  pattern: str, allowed: str) -> None:
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        expand_inputs("data.eval_files", [pattern])
    assert caught.value.key == "data.eval_files" and allowed in str(caught.value)
    assert str(caught.value).startswith(f"data.eval_files=['{pattern}'] is invalid: allowed ")


def test_an_unknown_bad_lines_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.bad_lines='ignore' is invalid: allowed fail or skip"):
        prepare_store(plan_of(tmp_path / "store", inputs(tmp_path / "in"), bad_lines="ignore"))
    assert not (tmp_path / "store").exists()


def test_the_manifest_reads_back_through_its_record(tmp_path: Path) -> None:
    manifest = prepare_store(plan_of(tmp_path / "store", inputs(tmp_path / "in")), log=lambda _: None)
    assert Manifest.from_json(json.loads(StoreLayout(tmp_path / "store").manifest.read_text())) == manifest
