"""Writes that matter are atomic: temp file, fsync, rename, fsync the directory (torch-free).

JSON-lines files are read back whole lines only: a last line cut short by a crash is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional


def fsync_path(path: Path) -> None:
    """fsync a file (its contents) or a directory (a rename or a new entry in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsyncBatch:
    """Files written atomically now and made durable together later (`fsync_batch`).

    Writing a sweep's hundreds of small files with two fsyncs each costs a journal commit per fsync;
    written first and fsynced afterwards, one commit carries them all and the later fsyncs find little
    left to do. Each file, its directory and that directory's parent are fsynced before the batch ends.
    """

    def __init__(self) -> None:
        self.paths: list[Path] = []

    def sync(self) -> None:
        for path in self.paths:
            fsync_path(path)
        for folder in dict.fromkeys(f for path in self.paths for f in (path.parent, path.parent.parent)):
            fsync_path(folder)  # the folder's entries, and the folder's own entry in its parent
        self.paths.clear()


@contextlib.contextmanager
def fsync_batch() -> Iterator[FsyncBatch]:
    """Defer the fsyncs of `write_text_atomic(..., batch=)` to the end of the block (not on an error)."""
    batch = FsyncBatch()
    yield batch
    batch.sync()


def write_text_atomic(path: Path, text: str, batch: Optional[FsyncBatch] = None) -> None:
    """Replace `path` with `text`: readers see the old file or the new one, never a part.

    Durable on return, or, given a `batch`, once the batch is synced.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        if batch is None:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(tmp, path)
    if batch is None:
        fsync_path(path.parent)
    else:
        batch.paths.append(path)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """`write_text_atomic` of indented, key-sorted JSON."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a JSON-lines file, oldest first ([] when it does not exist)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a crash: skip it
            continue
    return records
