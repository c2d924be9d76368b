"""One file of a checkpoint: written durably with the size and CRC-32 its marker lists, loaded only if they match.

`torch.save` writes the file as it would anywhere; the checksum is then read back from the page cache
on a helper thread while this one waits for fsync to put the file on the disk. The read costs memory
bandwidth (a few GB/s), the fsync the disk's time, and they overlap: the checksum is nearly free, and
it is taken of the file itself. (Taken instead as torch wrote, through a Python wrapper that passed each
buffer on, it cost 1.2-1.5x the plain write: 83 calls into Python, a thread hand-off for each tensor.)
CRC-32 finds damaged or truncated files at a fraction of sha256's cost; the files are no security
boundary (they load with `weights_only=True`).
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from gpujobs.rundir.marker import FileEntry
from gpujobs.rundir.trust import open_read

_CHUNK = 8 << 20
"""Read size when checksumming a file (after its write, and before a load)."""


def save_file(obj: Any, path: Path) -> FileEntry:
    """`torch.save` of `obj` into the new file `path`, fsynced; its marker entry (size and CRC-32)."""
    with open(path, "wb") as handle:
        try:
            torch.save(obj, handle)
        except RuntimeError as err:
            # A disk that fills mid-file: torch's zip writer, closing after the failed write, raises
            # "unexpected pos N vs M" over the OSError that says what happened. Report the cause.
            if isinstance(err.__context__, OSError):
                raise err.__context__ from err
            raise
        handle.flush()
        with open(path, "rb", buffering=0) as written, ThreadPoolExecutor(max_workers=1) as pool:
            checksum = pool.submit(_checksum_of, written)  # zlib and the reads release the GIL
            os.fsync(handle.fileno())
            size, crc = checksum.result()
    return FileEntry(size, crc)


def _checksum_of(handle: BinaryIO) -> tuple[int, int]:
    """Size and CRC-32 of what `handle` reads from where it stands to its end."""
    size, crc = 0, 0
    buffer = bytearray(min(_CHUNK, max(1, os.fstat(handle.fileno()).st_size)))
    view = memoryview(buffer)
    while read := handle.readinto(buffer):  # type: ignore[attr-defined]  # a raw or buffered reader has it
        crc = zlib.crc32(view[:read], crc)
        size += read
    return size, crc


def entry_of(path: Path) -> FileEntry:
    """The marker entry (size and CRC-32) of the file `path` as it is (written and fsynced by another writer)."""
    with open_read(path) as handle:
        return FileEntry(*_checksum_of(handle))


def _checked(handle: BinaryIO, path: Path, entry: Optional[FileEntry]) -> None:
    if entry is None:
        raise ValueError(f"{path.name} is not listed in the marker")
    size, crc = _checksum_of(handle)
    if size != entry.size:
        raise ValueError(f"{path.name} has {size} bytes, the marker says {entry.size}")
    if crc != entry.crc32:
        raise ValueError(f"{path.name} fails its checksum")


def verify_file(path: Path, entry: Optional[FileEntry]) -> None:
    """Check `path` against its marker entry, reading it whole; raises ValueError saying what is wrong."""
    with open_read(path) as handle:  # FileNotFoundError when missing; Untrusted for a planted symlink
        _checked(handle, path, entry)


def load_verified(path: Path, entry: Optional[FileEntry], map_location: Any) -> Any:
    """Load `path` after checking it against its marker entry; raises ValueError saying what is wrong.

    The check reads the file in chunks and the load reads it again (from the page cache by then), so a
    rank never holds more than the loaded state in memory.
    """
    # FileNotFoundError (an OSError) when missing; Untrusted for a planted symlink: what is checked is loaded
    with open_read(path) as handle:
        _checked(handle, path, entry)
        handle.seek(0)
        return torch.load(handle, map_location=map_location, weights_only=True)
