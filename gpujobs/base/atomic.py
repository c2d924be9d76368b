"""Writes that matter are atomic: temp file, fsync, rename, fsync the directory (torch-free).

JSON-lines files are read back whole lines only: a last line cut short by a crash is skipped, and so is
a line holding a number JSON cannot hold (1e999, NaN, Infinity). They are read and written as regular
files only: a symbolic link in a file's place is not followed (its target is never read or written), a
FIFO or a device there is a GpujobsError naming the file, never a reader or writer blocked on it, and a
file with more than one name (a hard link) is never appended to.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.errors import GpujobsError


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


#: What stands where a JSON-lines file belongs, when it is no regular file.
_NOT_A_FILE = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a device",
               stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link"}


def _no_regular_file(path: Path, mode: int, doing: str) -> GpujobsError:
    kind = _NOT_A_FILE.get(stat.S_IFMT(mode), "no regular file")
    unfollowed = " (gpujobs does not follow it)" if stat.S_ISLNK(mode) else ""
    return GpujobsError(f"{path} cannot be {doing}: it is {kind}, not a regular file{unfollowed}")


def _open_jsonl(path: Path, flags: int, doing: str) -> int:
    """A descriptor of the JSON-lines file `path`, or a GpujobsError naming it when it is no regular file
    or cannot be opened (`doing`: "read" or "written"); FileNotFoundError passes.

    `O_NOFOLLOW`: a link planted in the file's place fails here, so its target is never touched.
    `O_NONBLOCK`: opening a FIFO returns at once (it does nothing to a regular file), and fstat refuses it.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except FileNotFoundError:
        raise
    except OSError as err:
        # a link (ELOOP), a directory opened to write (EISDIR), a socket (ENXIO): say which
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise _no_regular_file(path, mode, doing) from None
        raise GpujobsError(f"{path} cannot be {doing}: {err.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _no_regular_file(path, info.st_mode, doing)
    if flags & (os.O_WRONLY | os.O_RDWR) and info.st_nlink > 1:
        os.close(fd)  # an append would land in every name's file: a run dir copied with `cp -al` shares its ledger
        raise GpujobsError(f"{path} cannot be {doing}: it is a hard link ({info.st_nlink} names, as `cp -al` "
                           "makes), and an append would change the other names' file too")
    return fd


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: no float holds it, and no reader's arithmetic survives inf
        raise ValueError(f"{text} is out of range")
    return value


def _not_a_number(name: str) -> float:
    raise ValueError(f"{name} is no JSON number")


_DECODER = json.JSONDecoder(parse_float=_finite, parse_constant=_not_a_number)


def jsonl_record(line: str | bytes) -> Optional[dict[str, Any]]:
    """One JSON-lines line as a record, or None for a line that is not one (cut short, garbage, or holding
    a number that is not finite: 1e999, NaN, Infinity)."""
    try:
        record = _DECODER.decode(line.decode() if isinstance(line, bytes) else line)
    except ValueError:  # JSONDecodeError, a number refused above, or bytes that are not UTF-8 (a torn character)
        return None
    return record if isinstance(record, dict) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSON-lines file, oldest first ([] when it does not exist).

    A line cut short by a crash, or any other line that is not a JSON object, is skipped. A file that is
    there but cannot be read (no regular file in its place, no permission) is a GpujobsError naming it:
    its records would be missing without a word.
    """
    try:
        fd = _open_jsonl(path, os.O_RDONLY, "read")
    except FileNotFoundError:
        return []
    try:
        with open(fd, "rb") as handle:
            data = handle.read()
    except OSError as err:
        raise GpujobsError(f"{path} cannot be read: {err.strerror}") from None
    return [record for line in data.splitlines() if (record := jsonl_record(line)) is not None]


class JsonlTail:
    """The records appended to a JSON-lines file, as they arrive (`poll`).

    A line is taken once it ends with a newline: one still being written is read when complete; a
    complete line that is no JSON object is skipped. A file that shrank was replaced: it is read anew.
    No regular file in its place is a GpujobsError, as for `read_jsonl`.
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
            fd = _open_jsonl(self.path, os.O_RDONLY, "read")
        except FileNotFoundError:
            return
        with open(fd, "rb") as handle:  # bytes: the offset counts bytes
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


class JsonlAppender:
    """A JSON-lines file held open for appending records, each on a line of its own (a context manager).

    After a writer that died mid-line the file ends without a newline: one is written at open, so the torn
    line stays alone, skipped by readers, instead of swallowing the next record. From then on an append is
    one `write` on an `O_APPEND` descriptor; one that failed part way (a full disk) is finished by the next
    append, which writes the rest first. A link in the file's place is refused (its target is never
    written), as is anything but a regular file and a file with another name (a hard link: `cp -al` of a
    run dir shares its ledger with the original's, which `write_own` refuses too).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._rest = b""  # what an append that failed part way did not write
        self._fd = _open_jsonl(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, "written")
        try:
            self._end_torn_line()
        except BaseException:
            os.close(self._fd)
            raise

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(self, records: Iterable[dict[str, Any]], sort_keys: bool = False, durable: bool = False) -> None:
        """Append `records` in one write (readers never see part of them, unless the write fails part way);
        `durable`: fsynced too (the directory entry of a new file is the caller's to fsync)."""
        data = self._rest + b"".join(json.dumps(record, sort_keys=sort_keys).encode() + b"\n" for record in records)
        written = 0
        try:
            while written < len(data):  # a short write (a signal, a nearly full disk): the rest follows
                written += os.write(self._fd, data[written:])
        finally:
            # part of a line in the file: its rest goes first next time; none: what failed was not appended
            self._rest = data[written:] if written or self._rest else b""
        if durable:
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the file (appending after this is an error)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _end_torn_line(self) -> None:
        size = os.fstat(self._fd).st_size
        if size > 0 and os.pread(self._fd, 1, size - 1) != b"\n":
            os.write(self._fd, b"\n")


def append_jsonl(path: Path, record: dict[str, Any], durable: bool = False) -> None:
    """Append `record` as one line, keys sorted (with `durable`, fsynced with its directory), on a line of
    its own (`JsonlAppender`)."""
    with JsonlAppender(path) as out:
        out.append([record], sort_keys=True, durable=durable)
    if durable:
        fsync_path(path.parent)
