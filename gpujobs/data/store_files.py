"""A sample store is trusted as a run dir is (`gpujobs.rundir.trust`'s rule), and prepare removes only what
it wrote (torch-free).

Whoever can write a store can plant a link where prepare writes or removes (`shards` -> a folder of the
user's, `.prepare.lock` -> ~/.bashrc), a FIFO where a reader would block, or another file's name; and a
`data.store` mistyped as a folder of the user's would have prepare empty it. So the store and every folder
in it must be the user's and writable by no one else unless sticky; every file is opened without following
a link (O_NOFOLLOW), without blocking (O_NONBLOCK), and used only as a regular file of the user's with one
name (`open_trusted`); and a folder is prepared into only when it is a store (`claim_store`): what a
prepare removes (a shard, a dead prepare's temp dir) is removed only when every entry in it bears a name
that prepare writes, and never through a link. Every refusal is one StoreError line naming data.store.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from pathlib import Path

from gpujobs.base.errors import ConfigError
from gpujobs.data.layout import StoreLayout, ours_in_shard, ours_in_shards, ours_in_store
from gpujobs.rundir.trust import ALLOWED, Untrusted, _problem, file_problem, open_trusted

#: The config key every store refusal names.
STORE_KEY = "data.store"

#: What to do about an entry that is not trusted, as the refusals say.
_REMOVE_IT = "remove it, if it is no store's, and run gpujobs prepare again"
#: Bytes read at once while hashing a column file.
_HASH_READ = 8 << 20


class StoreError(ConfigError):
    """The store at `data.store` cannot be used (or prepared); one line naming data.store and what is wrong."""

    def __init__(self, store: Path | str, what: str) -> None:
        super().__init__(STORE_KEY, str(store), what)
        self.args = (f"{STORE_KEY}={str(store)!r}: {what}",)

    def __reduce__(self) -> tuple[type[StoreError], tuple[object, ...]]:
        # rebuilt from (store, what), not from its message: it crosses from a prepare's worker processes
        return (type(self), (str(self.value), self.allowed))


def _where(store: Path, path: Path) -> str:
    """`path` as the store's refusals name it: relative to the store."""
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(store))
    return str(path)


def check_store_root(store: Path) -> None:
    """StoreError unless `store` is absent (made later) or a directory of this user's that no one else may
    write, unless sticky; the path itself may be a link to one (resolved now, as a run dir's is)."""
    try:
        info = os.stat(store)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        raise StoreError(store, "is not a directory: choose a directory for the store")
    found = _problem(info)
    if found is not None:
        raise StoreError(store, f"is {found}: a store is trusted only as {ALLOWED}")


def check_store_dir(store: Path, path: Path) -> bool:
    """True when the folder `path` of `store` is a directory of this user's that no one else may write
    (unless sticky), False when it is absent; StoreError otherwise (an lstat: a link is never followed)."""
    try:
        found = _problem(os.lstat(path))
    except FileNotFoundError:
        return False
    if found is not None:
        raise StoreError(store, f"{_where(store, path)} is {found}: not used ({_REMOVE_IT})")
    return True


def make_store_dir(store: Path, path: Path) -> None:
    """The folder `path` of `store`, made when missing (0755: a umask of 002 adds no group write), and
    checked (`check_store_dir`)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o755)
    check_store_dir(store, path)


def check_store_file(store: Path, path: Path) -> os.stat_result:
    """The lstat of the file `path` of `store` when it is a regular file of this user's with one name;
    StoreError otherwise (FileNotFoundError passes)."""
    info = os.lstat(path)
    found = file_problem(info)
    if found is not None:
        raise StoreError(store, f"{_where(store, path)} is {found}: not read ({_REMOVE_IT})")
    return info


def open_store_file(store: Path, path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """`open_trusted(path, flags)` of a file of `store`: StoreError naming it instead of Untrusted
    (FileNotFoundError passes)."""
    try:
        return open_trusted(path, flags, mode)
    except Untrusted:
        found = file_problem(os.lstat(path)) or "not a file of this user's alone"
        raise StoreError(store, f"{_where(store, path)} is {found}: not opened ({_REMOVE_IT})") from None


def read_store_file(store: Path, path: Path) -> bytes:
    """The bytes of the file `path` of `store`, opened through `open_store_file`."""
    with os.fdopen(open_store_file(store, path), "rb") as handle:
        return handle.read()


def read_store_json(store: Path, path: Path) -> object:
    """The JSON in the file `path` of `store` (`read_store_file`); None when it holds none (damaged)."""
    data = read_store_file(store, path)
    try:
        return json.loads(data)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        return None


def file_sha256(store: Path, path: Path) -> str:
    """The sha256 of the file `path` of `store`, read through `open_store_file` (O(its bytes))."""
    digest = hashlib.sha256()
    with os.fdopen(open_store_file(store, path), "rb") as handle:
        while piece := handle.read(_HASH_READ):
            digest.update(piece)
    return digest.hexdigest()


def remove_store_dir(store: Path, path: Path) -> None:
    """Remove the shard or temp folder `path` of `store`, and only when it is one a prepare wrote: a
    directory of this user's (never a link: it is opened O_NOFOLLOW and emptied through that descriptor,
    so a folder swapped for a link meanwhile is not followed) holding only files of the names a shard's
    files bear; else StoreError, and nothing removed. Absent passes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as err:
        if err.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        check_store_dir(store, path)  # says what is there instead
        raise
    try:
        found = _problem(os.fstat(fd))
        entries = os.listdir(fd)
        foreign = [name for name in entries if not ours_in_shard(name)
                   or stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)]
        if found is not None or foreign:
            what = found or f"holding {foreign[0]}, which no prepare wrote"
            raise StoreError(store, f"{_where(store, path)} is {what}: not removed ({_REMOVE_IT})")
        for name in entries:
            os.unlink(name, dir_fd=fd)  # a link is removed, not followed
    finally:
        os.close(fd)
    os.rmdir(path)


def _record_of_ours(store: Path, path: Path, keys: tuple[str, ...]) -> bool:
    """Whether `path` holds a JSON object with `keys` (a manifest or prepared_with.json of a prepare)."""
    try:
        payload = read_store_json(store, path)
    except FileNotFoundError:
        return False
    return isinstance(payload, dict) and all(key in payload for key in keys)


def claim_store(store: Path) -> None:
    """Refuse (StoreError) to prepare into `store` unless everything a prepare may remove there is its own.

    The store must be trusted (`check_store_root`), and so must shards/ and every folder in it. Every entry
    of shards/ must bear a shard's or a temp dir's name, and hold only files of a shard's names, each a
    regular file of the user's with one name: anything else is no prepare's, and is refused, not removed. At
    the top, a folder with no manifest.json or prepared_with.json of a prepare must hold only the names a
    prepare writes (a folder of the user's, not a store: refused before a file is written in it).
    """
    check_store_root(store)
    if not store.is_dir():
        return
    layout = StoreLayout(store)
    records = [_record_of_ours(store, layout.manifest, ("format_version", "shards")),  # both read: both checked
               _record_of_ours(store, layout.prepared_with, ("format_version", "parser"))]
    recorded = any(records)
    foreign = [] if recorded else sorted(name for name in os.listdir(store) if not ours_in_store(name))
    if foreign:
        raise StoreError(store, f"holds {foreign[0]} and no manifest.json or prepared_with.json of a prepare: it "
                                "is no store, and prepare removes only what it wrote; choose a new or empty directory")
    check_store_dir(store, store / ".prepare")
    if not check_store_dir(store, layout.shards):
        return
    for name in sorted(os.listdir(layout.shards)):
        shard = layout.shards / name
        if not ours_in_shards(name):
            raise StoreError(store, f"{_where(store, shard)} is no shard of a prepare: not removed (prepare removes "
                                    f"only what it wrote; {_REMOVE_IT})")
        check_store_dir(store, shard)
        for inner in sorted(os.listdir(shard)):
            if not ours_in_shard(inner):
                raise StoreError(store, f"{_where(store, shard / inner)} is no file of a prepare: not removed "
                                        f"({_REMOVE_IT})")
            check_store_file(store, shard / inner)
