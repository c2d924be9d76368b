"""The store is trusted only as a run dir is, and prepare removes only what it wrote (issue 36, items 1-4).

Each test reproduces a defect a hostile review found, caused for real: folders of user files, symlinks,
hard links and FIFOs planted where the store's files belong, a byte flipped with its mtime put back, an
input appended to while it is parsed, empty and truncated inputs. Every test that plants something checks
that nothing outside the store changed (bytes and mtimes). A prepare that could hang on a FIFO runs in its
own process, under a timeout.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import compose_job, missing, submit
from data_toy_parser import ToyParser, write_toy_file
from rec_store import prepare as prepare_criteo
from rec_store import write_days
from test_data_prepare import PARSER, driver, driver_env, inputs, leftovers, plan_of, published

from gpujobs.base.errors import ConfigError
from gpujobs.data.layout import StoreLayout
from gpujobs.data.manifest import StoreError, check_store
from gpujobs.data.prepare import BadLineError, ParsedChunk, prepare_store
from gpujobs.data.reader import SampleStore

HASH_BUCKETS = 1000
#: Another user: `nobody`.
NOBODY = 65534


def snapshot(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under `folder` (links not followed): its mode, mtime and, for a file, its bytes."""
    found = {}
    for entry in [folder, *sorted(folder.rglob("*"))]:
        info = entry.lstat()
        data = entry.read_bytes() if entry.is_file() and not entry.is_symlink() else b""
        found[str(entry)] = (info.st_mode, info.st_mtime_ns, data)
    return found


@pytest.fixture
def outside(tmp_path: Path) -> Iterator[Path]:
    """A folder of the user's outside the store, with what a prepare must never touch; unchanged at the end."""
    folder = tmp_path / "home"
    (folder / "results").mkdir(parents=True)
    (folder / "results" / "model.pt").write_bytes(b"weights of a week of training")
    (folder / ".bashrc").write_text("export PATH=/usr/bin\n")
    (folder / "data" / "run1").mkdir(parents=True)  # folders only: what rmtree of each entry empties
    (folder / "data" / "run1" / "model.pt").write_bytes(b"weights of another run")
    (folder / "train-00000").mkdir()  # looks like a shard: a link to it must not be taken for one
    (folder / "train-00000" / "label.bin").write_bytes(b"\x01" * 10)
    before = snapshot(folder)
    yield folder
    assert snapshot(folder) == before, "a file outside the store changed"


@pytest.fixture
def splits(tmp_path: Path) -> dict[str, tuple[Path, ...]]:
    return inputs(tmp_path / "in")


def refusal(store: Path, splits: dict[str, tuple[Path, ...]], **spec: object) -> str:
    """The one line a prepare in its own process exits 2 with (a hang fails the test at 60 s)."""
    proc = subprocess.run(driver(store, splits, **spec), env=driver_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: data.store='{store}': "), proc.stderr
    return lines[0]


# --- 1. prepare removes only what it wrote ---------------------------------------------------------------


def test_a_shards_folder_of_user_files_is_refused_not_emptied(tmp_path: Path, splits: dict[str, tuple[Path, ...]],
                                                              outside: Path) -> None:
    """Defect: with no prepared_with.json, prepare rmtree'd every entry of an existing shards/ (a user's
    results/model.pt was deleted)."""
    store = tmp_path / "store"
    (store / "shards" / "results").mkdir(parents=True)
    (store / "shards" / "results" / "model.pt").write_bytes(b"mine")
    kept = snapshot(store)
    line = refusal(store, splits)
    assert "shards/results is no shard of a prepare: not removed" in line
    assert snapshot(store) == kept


def test_a_folder_of_user_files_is_no_store(tmp_path: Path, splits: dict[str, tuple[Path, ...]]) -> None:
    """Defect: data.store pointed at a folder of the user's was written into as if it were a store."""
    store = tmp_path / "home"
    store.mkdir()
    (store / "notes.txt").write_text("mine")
    kept = snapshot(store)
    assert "holds notes.txt and no manifest.json or prepared_with.json of a prepare: it is no store" in \
        refusal(store, splits)
    assert snapshot(store) == kept  # not even a lock file made in it


def test_a_shards_link_to_a_folder_outside_is_refused(tmp_path: Path, splits: dict[str, tuple[Path, ...]],
                                                      outside: Path) -> None:
    """Defect: a `shards` symlink was followed, and every file where it pointed deleted."""
    store = tmp_path / "store"
    store.mkdir()
    (store / "shards").symlink_to(outside / "data")
    assert "shards is a symlink: not used" in refusal(store, splits)
    assert (store / "shards").is_symlink()


def test_a_stale_shard_that_is_a_link_is_refused_not_replaced(tmp_path: Path, splits: dict[str, tuple[Path, ...]],
                                                              outside: Path) -> None:
    """Defect: a stale shard was rmtree'd wherever it pointed; now a shard that is a link is refused."""
    store = tmp_path / "store"
    prepare_store(plan_of(store, splits), log=lambda line: None)
    layout = StoreLayout(store)
    os.rename(layout.shard_dir("train-00000"), tmp_path / "moved")
    layout.shard_dir("train-00000").symlink_to(outside / "train-00000")
    assert "shards/train-00000 is a symlink: not used" in refusal(store, splits)


def test_a_foreign_file_in_a_shard_is_refused_not_removed(tmp_path: Path, splits: dict[str, tuple[Path, ...]]) -> None:
    """Defect: a stale shard was removed with whatever else its folder held."""
    store = tmp_path / "store"
    prepare_store(plan_of(store, splits), log=lambda line: None)
    planted = StoreLayout(store).shard_dir("train-00001") / "model.pt"
    planted.write_bytes(b"mine")
    write_toy_file(splits["train"][1], 50, seed=5)  # its input changed: the shard is stale
    assert "shards/train-00001/model.pt is no file of a prepare: not removed" in refusal(store, splits)
    assert planted.read_bytes() == b"mine"


def test_a_planted_lock_link_is_not_followed(tmp_path: Path, splits: dict[str, tuple[Path, ...]],
                                             outside: Path) -> None:
    """Defect: a `.prepare.lock` symlink made prepare truncate its target (and write its pid there), as root too."""
    store = tmp_path / "store"
    store.mkdir()
    StoreLayout(store).lock.symlink_to(outside / ".bashrc")
    assert ".prepare.lock is a symlink: not opened" in refusal(store, splits)


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_store_others_may_write_is_refused(tmp_path: Path, splits: dict[str, tuple[Path, ...]], mode: int) -> None:
    """Defect: a store anyone could write (and plant links in) was prepared into and opened."""
    store = tmp_path / "store"
    prepare_store(plan_of(store, splits), log=lambda line: None)
    os.chmod(StoreLayout(store).shards, mode)
    assert f"shards is writable by others: mode {mode:04o}" in refusal(store, splits)
    with pytest.raises(StoreError, match="shards is writable by others"):
        check_store(store, PARSER.name, PARSER.settings())


def test_another_users_store_is_refused(tmp_path: Path, splits: dict[str, tuple[Path, ...]]) -> None:
    """Defect: a store of another user's (who may plant anything in it) was prepared into and opened."""
    if os.geteuid() != 0:
        missing("root: the store is chowned to another user")
    store = tmp_path / "store"
    prepare_store(plan_of(store, splits), log=lambda line: None)
    os.chown(store, NOBODY, NOBODY)
    assert re.search(rf"': is owned by .*uid {NOBODY}\)?, not by ", refusal(store, splits))
    with pytest.raises(StoreError, match=rf"': is owned by .*uid {NOBODY}"):
        check_store(store, PARSER.name, PARSER.settings())


# --- 2. no reader blocks ---------------------------------------------------------------------------------


def plant(path: Path, kind: str, outside: Path) -> None:
    """Put a FIFO, a link to a file outside, or a hard link to it, where the store's file `path` was."""
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(outside / ".bashrc")
    else:
        os.link(outside / ".bashrc", path)


PLACES = ["manifest.json", "shards/train-00001/shard.json", "shards/eval-00000/count.bin"]


@pytest.mark.parametrize("kind", ["fifo", "symlink", "hard link"])
@pytest.mark.parametrize("place", PLACES)
def test_no_store_file_is_read_through_a_fifo_or_a_link(tmp_path: Path, splits: dict[str, tuple[Path, ...]],
                                                        outside: Path, place: str, kind: str) -> None:
    """Defect: a FIFO as manifest.json or shard.json hung prepare and submit; a link or a hard link was read
    (and a stale one replaced) as if it were the store's. Now one line, exit 2, at prepare and at opening."""
    store = tmp_path / "store"
    prepare_store(plan_of(store, splits), log=lambda line: None)
    plant(store / place, kind, outside)
    what = {"fifo": "a FIFO", "symlink": "a symlink", "hard link": "a hard link (2 names)"}[kind]
    assert f"{place} is {what}: not " in refusal(store, splits)
    with pytest.raises(StoreError, match=re.escape(f"{place} is {what}: not ")):
        SampleStore.open(store, PARSER.name, PARSER.settings())


@pytest.fixture(scope="module")
def criteo_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], list[Path]]:
    """A Criteo store prepared from two train days and one eval day: (store, train files, eval files)."""
    folder = tmp_path_factory.mktemp("criteo")
    train = write_days(folder / "logs", "day", days=2, rows=300)
    held_out = write_days(folder / "logs", "eval", days=1, rows=200, seed=1)
    prepare_criteo(folder / "store", train, held_out, HASH_BUCKETS)
    return folder / "store", train, held_out


def rec(store: Path, *more: str) -> tuple[str, ...]:
    return ("+experiment=rec", "cluster=local", "data=criteo", f"data.store={store}",
            f"data.hash_buckets={HASH_BUCKETS}", "data.batch_size=8", "resources.gpus_per_node=0", *more)


def submit_refusal(tmp_path: Path, store: Path, *more: str) -> str:
    """The one line `gpujobs submit` exits 2 with; no run dir made."""
    proc = submit(tmp_path / "run", *rec(store, *more), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gpujobs: config error: data.store='{store}': "), proc.stderr
    assert not (tmp_path / "run").exists()
    return lines[0]


def copy_store(store: Path, to: Path) -> Path:
    subprocess.run(["cp", "-a", str(store), str(to)], check=True)
    return to


@pytest.mark.parametrize("place", ["manifest.json", "shards/train-00001/shard.json", "shards/eval-00000/label.bin"])
def test_a_fifo_in_the_store_is_one_line_at_submit(tmp_path: Path, criteo_store: tuple[Path, list[Path], list[Path]],
                                                   place: str) -> None:
    """Defect: submit hung on a FIFO planted as manifest.json (or read past one as a column file)."""
    store = copy_store(criteo_store[0], tmp_path / "store")
    (store / place).unlink()
    os.mkfifo(store / place)
    assert f"{place} is a FIFO: not " in submit_refusal(tmp_path, store)


# --- 3. inputs checked against each other and against the store ------------------------------------------


@pytest.mark.parametrize("how", ["eval among train", "eval a link to a train file", "a train file hard-linked"])
def test_the_same_file_twice_is_refused(tmp_path: Path, splits: dict[str, tuple[Path, ...]], how: str) -> None:
    """Defect: the same file named twice (the glob of conf/data/criteo.yaml put the eval day among the train
    days) was prepared twice: trained twice, or trained on and evaluated."""
    train = splits["train"]
    if how == "eval among train":
        named = {"train": train, "eval": (train[2],)}
        key, said = "data.eval_files", f"it is {train[2]} in data.train_files"
    elif how == "eval a link to a train file":
        (tmp_path / "eval_day.tsv").symlink_to(train[0])
        named = {"train": train, "eval": (tmp_path / "eval_day.tsv",)}
        key, said = "data.eval_files", f"it is {train[0]} in data.train_files"
    else:
        os.link(train[0], tmp_path / "in" / "day_9.tsv")
        named = {"train": (*train, tmp_path / "in" / "day_9.tsv"), "eval": splits["eval"]}
        key, said = "data.train_files", f"it is {train[0]} among them"
    with pytest.raises(ConfigError) as caught:
        prepare_store(plan_of(tmp_path / "store", named), log=lambda line: None)
    assert caught.value.key == key and f"{said}: the same file" in str(caught.value)
    assert not (tmp_path / "store").exists()


def test_a_store_of_other_files_than_the_configs_is_refused_at_submit(
        tmp_path: Path, criteo_store: tuple[Path, list[Path], list[Path]]) -> None:
    """Defect: submit trained on a store prepared from files A while its config.yaml named files B."""
    store, train, held_out = criteo_store
    other = write_days(tmp_path / "other", "day", days=2, rows=300, seed=7)
    line = submit_refusal(tmp_path, store, f"data.train_files=[{other[0]},{other[1]}]",
                          f"data.eval_files=[{held_out[0]}]")
    assert line.endswith(f"data.train_files names {other[0]}, which it was not prepared from: prepare it again from "
                         "this config's files")
    job = compose_job(*rec(store, f"data.train_files=[{train[0]},{train[1]}]", f"data.eval_files=[{held_out[0]}]"))
    job.data.check_here(job)  # the files it was prepared from: taken
    fewer = compose_job(*rec(store, f"data.train_files=[{train[0]}]"))
    with pytest.raises(StoreError, match=re.escape(f"it was prepared from {train[1]}, which data.train_files does")):
        fewer.data.check_here(fewer)


def test_a_source_changed_since_prepare_is_refused_at_submit(tmp_path: Path) -> None:
    """Defect: a store whose input file changed after the prepare was trained on as the config's file."""
    train = write_days(tmp_path / "logs", "day", days=2, rows=100)
    held_out = write_days(tmp_path / "logs", "eval", days=1, rows=40, seed=1)
    prepare_criteo(tmp_path / "store", train, held_out, HASH_BUCKETS)
    with open(train[1], "ab") as more:  # a second gzip member: the file grew by a line since
        more.write(gzip.compress(b"1" + b"\t" * 39 + b"\n"))
    job = compose_job(*rec(tmp_path / "store", f"data.train_files=[{train[0]},{train[1]}]"))
    with pytest.raises(StoreError, match=re.escape(f"{train[1]} (data.train_files) changed after the store was")):
        job.data.check_here(job)


@dataclass(frozen=True)
class GrowingParser(ToyParser):
    """The toy parser, and a writer appending to the file it reads once its first chunk is out: an input
    still being copied in while prepare reads it."""

    def parse(self, path: Path, bad_lines: str) -> Iterator[ParsedChunk]:
        for number, chunk in enumerate(super().parse(path, bad_lines)):
            if number == 0 and path.name == "day_2.tsv":
                with open(path, "a") as out:
                    out.write("1\t7\tlate\n")
            yield chunk


def test_an_input_that_grew_while_it_was_read_is_not_published(tmp_path: Path,
                                                              splits: dict[str, tuple[Path, ...]]) -> None:
    """Defect: a file appended to while prepare read it was published with the rows read so far, and recorded
    with its size before: the rerun kept the short shard."""
    store = tmp_path / "store"
    with pytest.raises(StoreError) as caught:
        prepare_store(plan_of(store, splits, parser=GrowingParser()), log=lambda line: None)
    assert f"{splits['train'][2]} changed while it was read" in str(caught.value)
    assert "shard train-00002 not published; run gpujobs prepare again" in str(caught.value)
    assert "train-00002" not in published(store) and leftovers(store) == []
    manifest = prepare_store(plan_of(store, splits), log=lambda line: None)
    assert manifest.split_shards("train")[2].rows == 302  # the whole file, its late line too


@pytest.mark.parametrize("case", ["0-byte gzip", "empty plain file", "truncated gzip"])
def test_an_input_with_no_rows_is_one_line_not_an_empty_shard(tmp_path: Path, splits: dict[str, tuple[Path, ...]],
                                                              case: str) -> None:
    """Defect: a 0-byte .gz or an empty file became a silent 0-row shard; a truncated .gz a traceback."""
    index = 0 if case == "empty plain file" else 1  # day_1 is the gzip one
    path = splits["train"][index]
    if case == "truncated gzip":
        path.write_bytes(path.read_bytes()[:-40])
    else:
        path.write_bytes(b"")
    with pytest.raises(BadLineError) as caught:
        prepare_store(plan_of(tmp_path / "store", splits), log=lambda line: None)
    said = "the file cannot be read" if case == "truncated gzip" else "no rows (an empty file"
    assert str(caught.value).startswith(f"{path}: {said}") and "\n" not in str(caught.value)
    assert f"train-0000{index}" not in published(tmp_path / "store")
    assert not StoreLayout(tmp_path / "store").manifest.exists()


@pytest.mark.parametrize("case", ["empty", "every line bad"])
def test_skip_keeps_a_file_with_no_rows_with_a_warning(tmp_path: Path, splits: dict[str, tuple[Path, ...]],
                                                       case: str) -> None:
    """Defect: under data.bad_lines=skip a file of only bad lines (or none) gave a 0-row shard without a word."""
    path = splits["train"][0]
    path.write_text("" if case == "empty" else "2\tx\ty\nnot a line\n")
    lines: list[str] = []
    manifest = prepare_store(plan_of(tmp_path / "store", splits, bad_lines="skip"), log=lines.append)
    assert (manifest.shards[0].rows, manifest.shards[0].bad_lines) == (0, 0 if case == "empty" else 2)
    why = "it is empty" if case == "empty" else "every line of it was bad"
    assert any(line.startswith("data.store: prepared shard train-00000: 0 rows") and
               line.endswith(f"(warning: no rows, {why})") for line in lines), lines


def test_a_zero_byte_gzip_is_refused_by_gpujobs_prepare(tmp_path: Path) -> None:
    """Defect: `gpujobs prepare` of the rec job published a 0-byte day_N.gz as a 0-row shard, exit 0."""
    days = write_days(tmp_path / "logs", "day", days=2, rows=50)
    days[1].write_bytes(b"")
    held_out = write_days(tmp_path / "logs", "eval", days=1, rows=20, seed=1)
    command = [sys.executable, "-m", "gpujobs.prepare", *rec(tmp_path / "store"),
               f"data.train_files=[{days[0]},{days[1]}]", f"data.eval_files=[{held_out[0]}]"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=driver_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [f"gpujobs: {days[1]}: no rows (an empty file, or a compressed one "
                                                "holding nothing): not prepared; remove it from the input files, or "
                                                "prepare with data.bad_lines=skip to keep it empty"]
    kept = subprocess.run([*command, "data.bad_lines=skip"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=driver_env())
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert f"prepared shard train-00001: 0 rows from {days[1]} (warning: no rows, it is empty)" in kept.stdout
    assert kept.stdout.strip().splitlines()[-1].endswith("0 bad lines skipped (warning: 1 shard with no rows)")


# --- 4. what opening checks ------------------------------------------------------------------------------


def test_a_byte_flipped_with_its_mtime_kept_is_found_by_verify_and_by_a_rerun(
        tmp_path: Path, splits: dict[str, tuple[Path, ...]]) -> None:
    """Defect: a shard changed with its size and mtime kept was trained on: no opening read its checksums,
    and a rerun of prepare kept it."""
    store = tmp_path / "store"
    prepare_store(plan_of(store, splits), log=lambda line: None)
    column = StoreLayout(store).column_file("train-00002", "count")
    info = column.stat()
    data = bytearray(column.read_bytes())
    data[17] ^= 0x40
    column.write_bytes(bytes(data))
    os.utime(column, ns=(info.st_atime_ns, info.st_mtime_ns))
    check_store(store, PARSER.name, PARSER.settings())  # the default level: sizes and mtimes, which it kept
    with pytest.raises(StoreError) as caught:
        SampleStore.open(store, PARSER.name, PARSER.settings(), verify=True)
    assert str(caught.value).endswith("shard train-00002's count.bin changed after prepare (its sha256 is not the "
                                      "one recorded, though its size and mtime are): prepare it again")
    lines: list[str] = []
    prepare_store(plan_of(store, splits), log=lines.append)
    assert [line.split(":")[1].split()[-1] for line in lines if "prepared shard" in line] == ["train-00002"]
    check_store(store, PARSER.name, PARSER.settings(), verify=True)


def test_a_shard_json_unlike_the_manifest_is_refused(tmp_path: Path, splits: dict[str, tuple[Path, ...]]) -> None:
    """Defect: opening trusted the manifest alone; a shard whose own record says otherwise was read."""
    store = tmp_path / "store"
    prepare_store(plan_of(store, splits), log=lambda line: None)
    record = StoreLayout(store).shard_record("eval-00000")
    payload = json.loads(record.read_text())
    payload["split"] = "train"
    record.write_text(json.dumps(payload))
    with pytest.raises(StoreError, match=r"shard eval-00000's shard\.json is not the manifest's record of it"):
        check_store(store, PARSER.name, PARSER.settings())


def test_verify_is_a_data_key_a_resumed_run_may_change() -> None:
    job = compose_job("+experiment=rec", "data=criteo", "data.store=/tmp/s", "data.verify=true")
    assert job.data.verify is True and "verify" in job.data.SAME_RUN_IGNORES
