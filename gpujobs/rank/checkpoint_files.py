"""One file of a checkpoint: written durably with the size and CRC-32 its marker lists, loaded only if they match.

The checksum is taken as `torch.save` writes, through `_Crc32Writer`: each buffer torch hands to `write`
is checksummed on its way to the page cache, so the marker costs no second read of what was written
(reading 1 GB back cost a synchronous save more than its fsync did). Large buffers (a tensor's storage)
are checksummed on a helper thread while this one copies them into the file: zlib and the write both
release the GIL. CRC-32 finds damaged or truncated files at a fraction of sha256's cost; the files are no
security boundary (they load with `weights_only=True`).
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
"""Read size when verifying; also the size from which a written buffer is checksummed beside its write."""


class _Crc32Writer:
    """The file object `torch.save` writes to: passes each buffer on to `raw` and keeps its CRC-32 and size."""

    def __init__(self, raw: BinaryIO, pool: ThreadPoolExecutor) -> None:
        self._raw = raw
        self._pool = pool
        self.crc32 = 0
        self.size = 0

    def write(self, data: Any) -> int:
        """Write all of `data` (torch passes a memoryview of its own memory: nothing is copied here)."""
        view = memoryview(data).cast("B")
        if view.nbytes >= _CHUNK:
            checksum = self._pool.submit(zlib.crc32, view, self.crc32)
            self._raw.write(view)  # a buffered writer writes all of it or raises
            self.crc32 = checksum.result()
        else:
            self._raw.write(view)
            self.crc32 = zlib.crc32(view, self.crc32)
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        """torch flushes once it has written its end of file."""
        self._raw.flush()


def save_file(obj: Any, path: Path) -> FileEntry:
    """`torch.save` of `obj` into the new file `path`, fsynced; its marker entry (size and CRC-32)."""
    with open(path, "wb") as handle, ThreadPoolExecutor(max_workers=1) as pool:
        writer = _Crc32Writer(handle, pool)
        try:
            torch.save(obj, writer)  # type: ignore[arg-type]  # torch needs only `write` (and `flush`)
        except RuntimeError as err:
            # A disk that fills mid-file: torch's zip writer, closing after the failed write, raises
            # "unexpected pos N vs M" over the OSError that says what happened. Report the cause.
            if isinstance(err.__context__, OSError):
                raise err.__context__ from err
            raise
        handle.flush()
        os.fsync(handle.fileno())
    return FileEntry(writer.size, writer.crc32)


def _checksum_of(handle: BinaryIO) -> tuple[int, int]:
    """Size and CRC-32 of what `handle` reads from where it stands to its end."""
    size, crc = 0, 0
    buffer = bytearray(min(_CHUNK, max(1, os.fstat(handle.fileno()).st_size)))
    view = memoryview(buffer)
    while read := handle.readinto(buffer):  # type: ignore[attr-defined]  # a raw or buffered reader has it
        crc = zlib.crc32(view[:read], crc)
        size += read
    return size, crc


def load_verified(path: Path, entry: Optional[FileEntry], map_location: Any) -> Any:
    """Load `path` after checking it against its marker entry; raises ValueError saying what is wrong.

    The check reads the file in chunks and the load reads it again (from the page cache by then), so a
    rank never holds more than the loaded state in memory.
    """
    if entry is None:
        raise ValueError(f"{path.name} is not listed in the marker")
    # FileNotFoundError (an OSError) when missing; Untrusted for a planted symlink: what is checked is loaded
    with open_read(path) as handle:
        size, crc = _checksum_of(handle)
        if size != entry.size:
            raise ValueError(f"{path.name} has {size} bytes, the marker says {entry.size}")
        if crc != entry.crc32:
            raise ValueError(f"{path.name} fails its checksum")
        handle.seek(0)
        return torch.load(handle, map_location=map_location, weights_only=True)
