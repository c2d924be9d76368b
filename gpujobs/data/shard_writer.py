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
import json
import os
import shutil
import signal
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Optional

import numpy as np

from gpujobs.base.atomic import fsync_path, write_json_atomic
from gpujobs.data.layout import SHARD_RECORD, StoreLayout, column_file_name
from gpujobs.data.manifest import ColumnFile, ColumnSpec, ShardRecord, SourceFile

if TYPE_CHECKING:
    from gpujobs.data.prepare import ParsedChunk

_PR_SET_PDEATHSIG = 1


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
                    columns: tuple[ColumnSpec, ...]) -> Optional[ShardRecord]:
    """The record of the published shard `name` when it is complete and of `source` as it is now; else None.

    Costs a few stats, never a read of the rows: a column file is taken as prepare left it when its size
    and mtime are those recorded (as `check_store` does).
    """
    try:
        record = ShardRecord.from_json(_read_json(layout.shard_record(name)))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    specs = {spec.name: spec for spec in columns}
    if (record.name, record.split) != (name, split) or record.source != SourceFile.of(source) \
            or sorted(c.name for c in record.columns) != sorted(specs):
        return None
    for column in record.columns:
        try:
            info = os.stat(layout.column_file(name, column.name))
        except OSError:
            return None
        if (info.st_size, info.st_mtime_ns) != (column.size, column.mtime_ns) \
                or column.size != record.rows * specs[column.name].row_bytes():
            return None
    return record


def _read_json(path: Path) -> dict[str, Any]:
    payload = json.loads(path.read_text())
    if not isinstance(payload, dict):
        raise ValueError(f"{path} holds no JSON object")
    return payload


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
        self.handle.close()
        info = os.stat(self.path)
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
                chunks: Iterable[ParsedChunk]) -> ShardRecord:
    """Write the rows of `chunks` (parsed from `source`) as shard `name` and publish it; its record.

    Any failure (a damaged line, a full disk, a kill) removes the temp directory, or leaves it to the next
    prepare; nothing is published but a complete shard.
    """
    as_prepared = SourceFile.of(source)  # before reading: a change while parsing is caught by the next prepare
    temp = layout.temp_dir(name, os.getpid())
    shutil.rmtree(temp, ignore_errors=True)  # this pid's own leftover, should a pid come back
    temp.mkdir(parents=True)
    try:
        rows = bad_lines = 0
        with contextlib.ExitStack() as stack:
            paths = [temp / column_file_name(spec.name) for spec in columns]
            writers = [_ColumnWriter(spec, path, stack.enter_context(open(path, "xb")))
                       for spec, path in zip(columns, paths, strict=True)]
            for chunk in chunks:
                rows += _chunk_rows(chunk, columns, source)
                bad_lines += chunk.bad_lines
                for writer in writers:
                    writer.write(chunk.columns[writer.spec.name])
            files = tuple(writer.finish() for writer in writers)
        record = ShardRecord(name, split, rows, as_prepared, bad_lines, files)
        write_json_atomic(temp / SHARD_RECORD, record.to_json())
        _publish(layout, name, temp)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return record


def _publish(layout: StoreLayout, name: str, temp: Path) -> None:
    """Rename the complete `temp` to shard `name`, replacing an outdated one; fsync `shards/`."""
    target = layout.shard_dir(name)
    replaced = temp.with_name(f"{temp.name}-replaced")
    had_one = target.exists()
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
        shutil.rmtree(replaced)
