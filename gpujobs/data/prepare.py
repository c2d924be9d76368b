"""Prepare a job's input files into a store (torch-free): one shard per input file, the manifest last.

The job supplies a `RowParser` (what a line means); everything else is here: the one-prepare lock,
removing a dead prepare's leftovers, preparing only the shards that are missing or whose input changed
(in worker processes), and the manifest. A shard is published whole or not at all (`write_shard`): a
prepare killed at any moment is resumed by running it again, and ends with the same bytes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import glob
import json
import multiprocessing
import os
import shutil
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from gpujobs.base.atomic import fsync_path, write_json_atomic
from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.data.layout import SPLITS, TEMP_PREFIX, StoreLayout, shard_name
from gpujobs.data.manifest import FORMAT_VERSION, ColumnSpec, Manifest, ShardRecord
from gpujobs.data.shard_writer import BadLineError as BadLineError  # where a job's parser finds it
from gpujobs.data.shard_writer import die_with_parent, published_shard, write_shard
from gpujobs.data.store_files import (
    StoreError,
    check_store_root,
    claim_store,
    make_store_dir,
    open_store_file,
    read_store_json,
    remove_store_dir,
)

#: What `data.bad_lines` may say: stop at the first damaged line, or skip and count damaged lines.
BAD_LINES = ("fail", "skip")
#: Errors of a write that found no room: the disk (or quota) is full, or the file size limit is reached.
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass
class ParsedChunk:
    """Consecutive rows of an input file: column name -> [rows, width] array ([rows] for width 1)."""

    columns: dict[str, np.ndarray]
    bad_lines: int


class RowParser(Protocol):
    """A job's reader of its input files (picklable: it travels to worker processes).

    `name` ("jobs.rec.criteo:CriteoParser") and `settings()` are recorded in the manifest and compared
    when the store is opened; `parse` raises BadLineError under bad_lines="fail" and counts under "skip".
    A parser that is a dataclass with an int field `threads` (which must not change its output) is given
    the cores each worker has to itself (`PreparePlan.with_cores`).
    """

    @property
    def name(self) -> str: ...  # a property here, so a plain attribute or a frozen dataclass field serves

    def columns(self) -> tuple[ColumnSpec, ...]: ...

    def settings(self) -> dict[str, Any]: ...

    def parse(self, path: Path, bad_lines: str) -> Iterator[ParsedChunk]: ...


@dataclass(frozen=True)
class PreparePlan:
    """What to prepare: the store, each split's input files (sorted, globs expanded), the parser, and
    what a damaged line does."""

    store: Path
    splits: dict[str, tuple[Path, ...]]
    parser: RowParser
    bad_lines: str

    def shards(self) -> tuple[tuple[str, int], ...]:
        """(split, index) of every shard, in manifest order."""
        return tuple((split, index) for split in SPLITS for index in range(len(self.splits.get(split, ()))))

    def with_cores(self, cores: int) -> PreparePlan:
        """The plan whose parser uses `cores` threads where it has a `threads` field (one big file on a node
        parses on all its cores; many files, a worker process per core, one thread each)."""
        if dataclasses.is_dataclass(self.parser) and "threads" in {f.name for f in dataclasses.fields(self.parser)}:
            return dataclasses.replace(self, parser=dataclasses.replace(self.parser, threads=max(1, cores)))
        return self

    def prepared_with(self) -> dict[str, Any]:
        """What the shards depend on besides their input files."""
        return {"format_version": FORMAT_VERSION, "parser": self.parser.name,
                "settings": json.loads(json.dumps(self.parser.settings(), sort_keys=True)),
                "columns": [vars(c) for c in self.parser.columns()]}


def expand_inputs(key: str, patterns: Sequence[str]) -> tuple[Path, ...]:
    """The files that `patterns` (paths or globs, plain or .gz) name: sorted, absolute, each once.

    A ConfigError naming `key` when a pattern matches nothing or a match is not a regular file.
    """
    if isinstance(patterns, str):  # one path or glob, as a command line gives it
        patterns = [patterns]
    found: set[Path] = set()
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
        matches = [m for m in matches if os.path.lexists(m)]
        if not matches:
            raise ConfigError(key, list(patterns), f"paths or globs of existing files ({pattern} matches nothing)")
        for match in matches:
            if not os.path.isfile(match):
                raise ConfigError(key, list(patterns), f"regular files ({match} is not one)")
            found.add(Path(match).absolute())
    return tuple(sorted(found))


def prepare_shard(plan: PreparePlan, split: str, index: int) -> ShardRecord:
    """Shard `index` of `split` (what a worker process or a Slurm array task runs): the published one when
    it is complete and its input unchanged (sizes and mtimes: `start_prepare` checked the sha256 of what it
    kept), else written anew and published. Idempotent."""
    layout = StoreLayout(plan.store)
    check_store_root(plan.store)  # a task runs long after its plan: the folders are checked again
    make_store_dir(plan.store, layout.shards)
    name = shard_name(split, index)
    source = plan.splits[split][index]
    existing = published_shard(layout, name, split, source, plan.parser.columns())
    if existing is not None:
        return existing
    with no_room_is_a_store_error(plan.store, f"shard {name}"):
        return write_shard(layout, name, split, source, plan.parser.columns(),
                           plan.parser.parse(source, plan.bad_lines), plan.bad_lines)


@contextlib.contextmanager
def no_room_is_a_store_error(store: Path, what: str) -> Iterator[None]:
    """A write in the block that finds no room (ENOSPC, EDQUOT, EFBIG) becomes one StoreError line naming
    `what` and the free bytes."""
    try:
        yield
    except OSError as err:
        if err.errno not in NO_ROOM:
            raise
        free = -1
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(store).free
        raise StoreError(store, f"no room to write {what} ({err.strerror}; {free} bytes free there): free some "
                                f"space and run gpujobs prepare again (the shards done so far are kept)") from None


@contextlib.contextmanager
def prepare_lock(store: Path) -> Iterator[None]:
    """Hold the store's prepare lock for the block; a StoreError naming the holder when another has it.

    flock: the kernel drops it when the holder dies, however it dies, so a killed prepare never blocks
    the next one. The lock file is opened as every store file is (`open_store_file`): a link planted in its
    place is refused, its target never opened, let alone truncated.
    """
    try:
        fd = open_store_file(store, StoreLayout(store).lock, os.O_RDWR | os.O_CREAT)
    except OSError as err:
        raise StoreError(store, f"cannot be written here ({err.strerror}): choose a writable directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").split()
            who = f"pid {holder[0]} on {holder[1]}" if len(holder) == 2 else "another process"
            raise StoreError(store, f"is being prepared by {who}: wait for it to finish, or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def start_prepare(plan: PreparePlan, log: Callable[[str], None] = print) -> tuple[tuple[str, int], ...]:
    """Under the lock: refuse a folder that is not a store of ours (`claim_store`), remove a dead prepare's
    leftovers, start over if the shards were prepared with another parser or settings, remove each shard
    that is not current (its input changed, or a column's sha256 is not the one recorded), and unpublish the
    manifest when any shard needs work. Returns the shards that need work."""
    layout = StoreLayout(plan.store)
    claim_store(plan.store)
    make_store_dir(plan.store, layout.shards)
    for leftover in sorted(layout.shards.glob(f"{TEMP_PREFIX}*")):
        log(f"data.store: removing {leftover.name}, left by a prepare that did not finish")
        remove_store_dir(plan.store, leftover)
    record = layout.prepared_with
    wanted = plan.prepared_with()
    stale = _read_prepared_with(plan.store) != wanted and any(layout.shards.iterdir())
    todo = plan.shards() if stale else tuple(
        (split, index) for split, index in plan.shards()
        if published_shard(layout, shard_name(split, index), split, plan.splits[split][index],
                           plan.parser.columns(), verify=True) is None)
    if todo:
        layout.manifest.unlink(missing_ok=True)  # unfinished from now until every shard is there
        fsync_path(plan.store)
    if stale:
        log("data.store: its shards were prepared with another parser or settings: preparing every shard again")
    outdated = sorted(layout.shards.iterdir()) if stale else [layout.shard_dir(shard_name(*shard)) for shard in todo]
    for shard_dir in outdated:
        remove_store_dir(plan.store, shard_dir)  # a stale shard: gone before its task runs, which writes it anew
    with no_room_is_a_store_error(plan.store, record.name):
        write_json_atomic(record, wanted)
    return todo


def _read_prepared_with(store: Path) -> Any:
    """What the shards were prepared with, or None when unknown (no record, or a damaged one)."""
    try:
        return read_store_json(store, StoreLayout(store).prepared_with)
    except FileNotFoundError:
        return None


def finish_prepare(plan: PreparePlan, records: Sequence[ShardRecord]) -> Manifest:
    """Write the manifest of `records` (every shard of the plan, in order), last; return it."""
    manifest = Manifest(FORMAT_VERSION, plan.parser.name, plan.prepared_with()["settings"],
                        plan.parser.columns(), tuple(records))
    with no_room_is_a_store_error(plan.store, "manifest.json"):
        write_json_atomic(StoreLayout(plan.store).manifest, manifest.to_json())
    return manifest


def prepare_store(plan: PreparePlan, workers: int = 1, log: Callable[[str], None] = print,
                  under_lock: Callable[[], None] = lambda: None) -> Manifest:
    """Prepare every shard of `plan` that is missing or whose input changed, `workers` processes at a time,
    then write the manifest; return it. A second prepare of the same store meanwhile is refused (and
    whatever `under_lock` refuses, asked first under the lock: a prepare queued elsewhere)."""
    check_plan(plan, workers)
    make_store(plan.store)
    with prepare_lock(plan.store):
        under_lock()
        todo = start_prepare(plan, log)
        plan = plan.with_cores(available_cores() // max(1, min(workers, len(todo))))
        done = _run_shards(plan, todo, workers, log)
        records = [done.get((split, index)) or prepare_shard(plan, split, index) for split, index in plan.shards()]
        manifest = finish_prepare(plan, records)
    log(f"data.store: {plan.store} is ready: {manifest.rows('train')} train rows, {manifest.rows('eval')} eval rows "
        f"in {len(records)} shards ({len(todo)} prepared now)")
    return manifest


def available_cores() -> int:
    """The CPUs this process may run on (a Slurm task's allocation, a container's cpuset)."""
    return len(os.sched_getaffinity(0))


def make_store(store: Path) -> None:
    """The store's directory, made if missing (0755) and claimed (`claim_store`: a folder that is no store of
    ours is refused before anything is written in it); StoreError when it cannot be made."""
    try:
        try:
            os.mkdir(store, 0o755)
        except FileNotFoundError:  # its parents first (theirs is not the store's to trust)
            store.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(store, 0o755)
    except FileExistsError:
        pass
    except OSError as err:
        raise StoreError(store, f"cannot be written here ({err.strerror}): choose a writable directory") from None
    claim_store(store)


def check_plan(plan: PreparePlan, workers: int) -> None:
    """Refuse a plan no prepare could carry out (ConfigError naming the key)."""
    if plan.bad_lines not in BAD_LINES:
        raise ConfigError("data.bad_lines", plan.bad_lines, " or ".join(BAD_LINES))
    if workers < 1:
        raise ConfigError("data.prepare_workers", workers, "an integer >= 1")
    unknown = sorted(set(plan.splits) - set(SPLITS))
    if unknown:
        raise ValueError(f"a store's splits are {', '.join(SPLITS)}, not {', '.join(unknown)}")
    check_distinct(plan.splits)


def check_distinct(splits: dict[str, tuple[Path, ...]]) -> None:
    """Refuse (ConfigError naming the key) a file named twice, within a split or across them, by its path or
    through a link (the same device and inode): its rows would be trained twice, or trained and evaluated."""
    seen: dict[tuple[int, int], tuple[str, Path]] = {}
    for split, paths in splits.items():
        for path in paths:
            info = os.stat(path)
            first = seen.setdefault((info.st_dev, info.st_ino), (split, path))
            if first != (split, path):
                where = "among them" if first[0] == split else f"in data.{first[0]}_files"
                raise ConfigError(f"data.{split}_files", str(path), f"files named once, in one split (it is "
                                  f"{first[1]} {where}: the same file)")


def shard_line(record: ShardRecord) -> str:
    """What a prepare says of a shard it published; a warning when it holds no rows (bad_lines=skip)."""
    skipped = f", {record.bad_lines} bad lines skipped" if record.bad_lines else ""
    line = f"prepared shard {record.name}: {record.rows} rows from {record.source.path}{skipped}"
    if record.rows == 0:
        why = "every line of it was bad" if record.bad_lines else "it is empty"
        line += f" (warning: no rows, {why})"
    return line


def _log_shard(record: ShardRecord, log: Callable[[str], None]) -> None:
    log(f"data.store: {shard_line(record)}")


def _run_shards(plan: PreparePlan, todo: Sequence[tuple[str, int]], workers: int,
                log: Callable[[str], None]) -> dict[tuple[str, int], ShardRecord]:
    """Prepare the shards `todo`: here with one worker, else in `workers` spawned processes.

    On the first failure the shards not yet started are cancelled and its error is raised as the worker
    raised it (a BadLineError stays one line).
    """
    done: dict[tuple[str, int], ShardRecord] = {}
    if workers == 1 or len(todo) < 2:
        for split, index in todo:
            done[split, index] = record = prepare_shard(plan, split, index)
            _log_shard(record, log)
        return done
    # spawn: the parser is pickled into fresh interpreters (no fork of a parent holding threads or locks)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(todo)), mp_context=context,
                                                initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
        futures = {pool.submit(prepare_shard, plan, split, index): (split, index) for split, index in todo}
        try:
            for future in concurrent.futures.as_completed(futures):
                done[futures[future]] = record = future.result()
                _log_shard(record, log)
        except BaseException as err:
            pool.shutdown(wait=True, cancel_futures=True)
            if isinstance(err, GpujobsError):
                raise err from None  # the worker's line, without the pool's traceback of it
            raise
    return done
