"""One shard written whole or not at all (torch-free), and the check that a published one is complete.

A shard is written into its own temp directory (`.tmp-<shard>-<pid>`): every column file hashed while it is
written, fsynced, then shard.json, then the directory renamed into place and `shards/` fsynced. A process
killed at any point leaves a temp directory (removed by the next prepare) or a complete shard, never a
half one under a published name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import signal
import sys
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Optional

import numpy as np

from gpujobs.base.atomic import fsync_path, write_json_atomic
from gpujobs.base.errors import GpujobsError
from gpujobs.data.layout import SHARD_RECORD, StoreLayout, column_file_name
from gpujobs.data.manifest import ColumnFile, ColumnSpec, ShardRecord, SourceFile, shard_record_in
from gpujobs.data.store_files import (
    StoreError,
    check_store_dir,
    check_store_file,
    file_sha256,
    make_store_dir,
    remove_store_dir,
)

if TYPE_CHECKING:
    from gpujobs.data.prepare import ParsedChunk

_PR_SET_PDEATHSIG = 1


class BadLineError(GpujobsError):
    """A damaged input line under bad_lines=fail: "day_3.gz:1234: label '2' is not 0 or 1"; or an input
    file that cannot be read, or holds no rows."""


def die_with_parent(parent_pid: int) -> None:
    """Make this worker process die with the prepare that started it (a pool's initializer).

    A SIGKILLed prepare cannot stop its workers; left running, they would publish shards beside the next
    prepare, which no longer holds them under its lock. Linux kills them with the parent (PR_SET_PDEATHSIG);
    a worker whose parent is already gone exits at once.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def published_shard(layout: StoreLayout, name: str, split: str, source: Path,
                    columns: tuple[ColumnSpec, ...], verify: bool = False) -> Optional[ShardRecord]:
    """The record of the published shard `name` when it is complete and of `source` as it is now; else None.

    Costs a few stats and the read of shard.json: a column file is taken as prepare left it when its size
    and mtime are those recorded (as `check_store` does); with `verify`, only when its sha256 is too
    (O(bytes): what a rerun of prepare asks). A file there that is not trusted (a link, a FIFO, another
    user's) is a StoreError, never read nor replaced.
    """
    store = layout.root
    if not check_store_dir(store, layout.shard_dir(name)):
        return None
    try:
        record = shard_record_in(store, layout.shard_record(name))
    except FileNotFoundError:
        return None
    specs = {spec.name: spec for spec in columns}
    if record is None or (record.name, record.split) != (name, split) or record.source != SourceFile.of(source) \
            or sorted(c.name for c in record.columns) != sorted(specs):
        return None
    for column in record.columns:
        path = layout.column_file(name, column.name)
        try:
            info = check_store_file(store, path)
        except FileNotFoundError:
            return None
        if (info.st_size, info.st_mtime_ns) != (column.size, column.mtime_ns) \
                or column.size != record.rows * specs[column.name].row_bytes() \
                or (verify and file_sha256(store, path) != column.sha256):
            return None
    return record


class _ColumnWriter:
    """A column file being written, hashed as it is written."""

    def __init__(self, spec: ColumnSpec, path: Path, handle: BinaryIO) -> None:
        self.spec = spec
        self.path = path
        self.handle = handle
        self.sha256 = hashlib.sha256()

    def write(self, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values).reshape(-1).view(np.uint8)
        self.sha256.update(data.data)
        self.handle.write(data.data)

    def finish(self) -> ColumnFile:
        """Flush and fsync the file; its record (size and mtime as published: a rename keeps both)."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        info = os.fstat(self.handle.fileno())
        self.handle.close()
        return ColumnFile(self.spec.name, info.st_size, info.st_mtime_ns, self.sha256.hexdigest())


def _chunk_rows(chunk: ParsedChunk, columns: tuple[ColumnSpec, ...], source: Path) -> int:
    """The rows of `chunk`, after checking it holds exactly `columns`, each of its dtype and width."""
    if sorted(chunk.columns) != sorted(spec.name for spec in columns):
        raise ValueError(f"the parser gave columns {sorted(chunk.columns)} for {source}, "
                         f"not {sorted(spec.name for spec in columns)}")
    rows = {len(values) for values in chunk.columns.values()}
    if len(rows) != 1:
        raise ValueError(f"the parser gave columns of different lengths for {source}: {sorted(rows)}")
    for spec in columns:
        values = chunk.columns[spec.name]
        shapes = {(len(values),), (len(values), 1)} if spec.width == 1 else {(len(values), spec.width)}
        if values.dtype != np.dtype(spec.dtype) or values.shape not in shapes:
            raise ValueError(f"the parser gave column {spec.name} for {source} as {values.dtype} {values.shape}, "
                             f"not {spec.dtype} with width {spec.width}")
    return rows.pop()


def write_shard(layout: StoreLayout, name: str, split: str, source: Path, columns: tuple[ColumnSpec, ...],
                chunks: Iterable[ParsedChunk], bad_lines: str) -> ShardRecord:
    """Write the rows of `chunks` (parsed from `source`) as shard `name` and publish it; its record.

    Any failure (a damaged line, a full disk, a kill) removes the temp directory, or leaves it to the next
    prepare; nothing is published but a complete shard. Not published either: the rows of a file that
    changed while it was read (its size, mtime or inode after the read are not those before), and no rows
    under `bad_lines="fail"` (an empty file, or a compressed one that holds nothing: BadLineError).
    """
    before = os.stat(source)
    temp = layout.temp_dir(name, os.getpid())
    remove_store_dir(layout.root, temp)  # this pid's own leftover, should a pid come back
    make_store_dir(layout.root, temp)
    try:
        rows = skipped = 0
        with contextlib.ExitStack() as stack:
            paths = [temp / column_file_name(spec.name) for spec in columns]
            writers = [_ColumnWriter(spec, path, stack.enter_context(open(path, "xb")))  # O_EXCL: no link followed
                       for spec, path in zip(columns, paths, strict=True)]
            for chunk in _read_chunks(chunks, source):
                rows += _chunk_rows(chunk, columns, source)
                skipped += chunk.bad_lines
                for writer in writers:
                    writer.write(chunk.columns[writer.spec.name])
            files = tuple(writer.finish() for writer in writers)
        _check_read_whole(layout, name, source, before, rows, skipped, bad_lines)
        as_read = SourceFile(str(source), before.st_size, before.st_mtime_ns)
        record = ShardRecord(name, split, rows, as_read, skipped, files)
        write_json_atomic(temp / SHARD_RECORD, record.to_json())
        _publish(layout, name, temp)
    except BaseException:
        with contextlib.suppress(OSError, StoreError):
            remove_store_dir(layout.root, temp)
        raise
    return record


def _read_chunks(chunks: Iterable[ParsedChunk], source: Path) -> Iterator[ParsedChunk]:
    """`chunks`, with a read error of the parser's (a truncated gzip: EOFError, zlib's, OSError) as one line
    naming `source`."""
    iterator = iter(chunks)
    while True:
        try:
            chunk = next(iterator)
        except StopIteration:
            return
        except (OSError, EOFError, zlib.error) as err:
            raise BadLineError(f"{source}: the file cannot be read ({err}): not prepared") from None
        yield chunk


def _check_read_whole(layout: StoreLayout, name: str, source: Path, before: os.stat_result, rows: int,
                      skipped: int, bad_lines: str) -> None:
    """Refuse to publish shard `name` when `source` changed while it was read, or gave no rows under
    `bad_lines="fail"` (a StoreError, a BadLineError)."""
    after = os.stat(source)
    if (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns) != \
            (before.st_dev, before.st_ino, before.st_size, before.st_mtime_ns):
        raise StoreError(layout.root, f"{source} changed while it was read (size {before.st_size} -> "
                                      f"{after.st_size}, or its mtime): shard {name} not published; run gpujobs "
                                      f"prepare again once the file is complete")
    if rows == 0 and not skipped and bad_lines == "fail":
        raise BadLineError(f"{source}: no rows (an empty file, or a compressed one holding nothing): not prepared; "
                           f"remove it from the input files, or prepare with data.bad_lines=skip to keep it empty")


def _publish(layout: StoreLayout, name: str, temp: Path) -> None:
    """Rename the complete `temp` to shard `name`, replacing an outdated one (a folder of ours, never a link:
    `remove_store_dir`); fsync `shards/`."""
    target = layout.shard_dir(name)
    replaced = temp.with_name(f"{temp.name}-replaced")
    had_one = check_store_dir(layout.root, target)
    if had_one:  # an outdated shard (its input changed): moved aside first, as rename cannot replace a directory
        os.rename(target, replaced)
    try:
        os.rename(temp, target)
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise FileExistsError(f"shard {name} was published by another process meanwhile: "
                                  f"two prepares of one store ran at once") from None
        raise
    fsync_path(layout.shards)
    if had_one:
        remove_store_dir(layout.root, replaced)
