"""Writes that matter are atomic: temp file, fsync, rename, fsync the directory (torch-free).

JSON-lines files are read back whole lines only: a last line cut short by a crash is skipped.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from gpujobs.errors import GpujobsError


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


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new file beside `path`, under a name nobody can guess or have planted.

    `O_EXCL | O_NOFOLLOW` never opens what is already there (a file, or a link to one elsewhere);
    mode 0666 less the umask, as `open` would give.
    """
    while True:
        tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(8)}")
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue


def write_text_atomic(path: Path, text: str, batch: Optional[FsyncBatch] = None) -> None:
    """Replace `path` with `text`: readers see the old file or the new one, never a part.

    Durable on return, or, given a `batch`, once the batch is synced. A write that fails (a full
    disk) leaves the old file and no temp file behind.
    """
    fd, tmp = _create_temp(path)
    try:
        with open(fd, "w") as handle:
            handle.write(text)
            if batch is None:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if batch is None:
        fsync_path(path.parent)
    else:
        batch.paths.append(path)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """`write_text_atomic` of indented, key-sorted JSON."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")


def jsonl_record(line: str | bytes) -> Optional[dict[str, Any]]:
    """One JSON-lines line as a record, or None for a line that is not one (cut short, or garbage)."""
    try:
        record = json.loads(line)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8 (a tear inside a character)
        return None
    return record if isinstance(record, dict) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSON-lines file, oldest first ([] when it does not exist).

    A line cut short by a crash, or any other line that is not a JSON object, is skipped. A file that is
    there but cannot be read (a directory in its place, no permission) is a GpujobsError naming it: its
    records would be missing without a word.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as err:
        raise GpujobsError(f"{path} cannot be read: {err.strerror}") from None
    return [record for line in data.splitlines() if (record := jsonl_record(line)) is not None]


class JsonlTail:
    """The records appended to a JSON-lines file, as they arrive (`poll`).

    A line is taken once it ends with a newline: one still being written is read when complete; a
    complete line that is no JSON object is skipped. A file that shrank was replaced: it is read anew.
    """

    def __init__(self, path: Path, from_end: bool = False) -> None:
        self.path = path
        self._offset = 0
        if from_end:  # only what is appended from now on
            with contextlib.suppress(OSError):
                self._offset = path.stat().st_size

    def poll(self) -> Iterator[dict[str, Any]]:
        """New complete records since the last call."""
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 (closed below; bytes: the offset counts bytes)
        except FileNotFoundError:
            return
        with handle:
            if handle.seek(0, os.SEEK_END) < self._offset:
                self._offset = 0
            handle.seek(self._offset)
            while True:
                line = handle.readline()
                if not line.endswith(b"\n"):  # a half-written line: read it next time
                    break
                self._offset += len(line)
                record = jsonl_record(line)
                if record is not None:
                    yield record


def append_jsonl(path: Path, record: dict[str, Any], durable: bool = False) -> None:
    """Append `record` as one line (flushed; with `durable`, fsynced with its directory), on a line of its own.

    After a writer that died mid-line the file ends without a newline: one is written first, so the
    torn line stays alone (and is skipped by readers) instead of swallowing this record.
    """
    with open(path, "ab+") as handle:
        if handle.seek(0, os.SEEK_END) > 0:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")
        handle.write(json.dumps(record, sort_keys=True).encode() + b"\n")
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    if durable:
        fsync_path(path.parent)
