"""A run dir is trusted only if it is this user's; nothing in it is opened through a link.

Whoever can write a run dir can plant a symlink where the job writes (heartbeat/rank_0.json ->
~/.bashrc) or a pickle that submitit loads: they would have the job overwrite the user's files or run
their code as the user. So a run dir (and a sweep dir) must be owned by the user who submits and runs
it, and writable by no one else unless sticky (`open_to_others`, the rule `telemetry.prometheus_sd_dir`
follows too): checked at submit (`check_dir`, a ConfigError naming the key) and on the job side before
the pickles are read and the ranks write (`check_run_dir`). Inside it, the job makes its folders with
`own_dir` and its files with `write_own` and reads them with `read_own`: a symlink, another user's
entry or a folder others may write is refused (`Untrusted`), never followed.

The directories above it are held as OpenSSH's StrictModes holds a home (`check_parents`, part of both
checks): every one, from the run dir's parent up to `/`, along the path as resolved and as written, must
be owned by root or the user and writable by no one else unless sticky (/tmp is 1777). Not only up to the
first one that is the user's: whoever may change any directory above can rename the chain below it and put
a link of theirs where the run dir was (a group-writable project dir is such a place: use a dir of your own
under a root-owned or sticky one).

At submit a run dir must also be one (`check_run_dir_files`): an existing directory that holds entries but
none of those a run dir's layout names (`RUN_DIR_NAMES`: config.yaml, lease.json, attempts.jsonl, checkpoints/,
..., or the submitit folder) is the user's other work, never written among; and no file in it may have another
name (a hard link: `cp -al RUN COPY` shares RUN's ledger with COPY, and resuming COPY would append to RUN's),
which JSON-lines appends and `write_own` refuse on their own too.

Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import stat
from pathlib import Path
from typing import BinaryIO, Optional

from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.base.permissions import open_to_others
from gpujobs.rundir import CHECKPOINT_DIR, LEASE_FILE, RUN_DIR_NAMES

#: What a trusted directory is, as the errors say it.
ALLOWED = "a directory of this user's that no one else may write, unless sticky (chmod go-w, or chmod +t like /tmp)"
#: What the directories above a trusted one must be, as the errors say it.
PARENTS_ALLOWED = ("a directory under directories that only root or this user may change, up to / (as OpenSSH's "
                   "StrictModes holds a home)")


class Untrusted(GpujobsError, PermissionError):
    """An entry of the run dir that the job will not follow or write: a symlink, another user's, open to others."""


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _problem(info: os.stat_result) -> Optional[str]:
    """Why a directory with `info` (an lstat: a symlink is a problem) is not to be trusted, or None."""
    if stat.S_ISLNK(info.st_mode):
        return "a symlink"
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory"
    if info.st_uid != os.geteuid():
        return f"owned by {_user(info.st_uid)}, not by {_user(os.geteuid())}, mode {stat.S_IMODE(info.st_mode):04o}"
    if open_to_others(info.st_mode):
        return f"writable by others: mode {stat.S_IMODE(info.st_mode):04o}"
    return None


def check_dir(key: str, path: Path) -> None:
    """Refuse (ConfigError on `key`) a directory that is not trusted, or one under a directory that someone
    else may change (`check_parents`); the path itself may be a symlink (to a directory of the user's), which
    is resolved now. An absent path passes when its parents do (it is made later), and so does one where no
    directory can be (a file: it is found unmakeable there)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        check_parents(key, path)
        return
    if not stat.S_ISDIR(info.st_mode):  # no directory can be made there: where it is made says so, in its words
        return
    found = _problem(info)
    if found is not None:
        raise ConfigError(key, str(path), f"{ALLOWED}; it is {found}")
    check_parents(key, path)


def check_parents(key: str, path: Path) -> None:
    """Refuse (ConfigError on `key`) `path` when a directory above it, up to `/`, is owned by someone but root
    and the user, or open to others (`open_to_others`): its owner, or anyone who may write it, can rename what
    lies below and leave a link of theirs in the run dir's place. Both the path resolved and the path as written
    (made absolute) are walked: a link on the way is as safe as the directory that holds it. Directories
    not made yet pass (the user makes them)."""
    me = os.geteuid()
    seen: set[Path] = set()
    for start in (Path(path).resolve(), Path(os.path.abspath(path))):
        for parent in start.parents:
            if parent in seen:
                continue
            seen.add(parent)
            try:
                info = os.stat(parent)
            except OSError:  # not made yet, or not searchable: making or opening the run dir there says so
                continue
            mode = stat.S_IMODE(info.st_mode)
            if info.st_uid not in (0, me):
                found = f"owned by {_user(info.st_uid)}, mode {mode:04o}"
            elif open_to_others(info.st_mode):
                found = f"writable by others, mode {mode:04o}"
            else:
                continue
            raise ConfigError(key, str(path), f"{PARENTS_ALLOWED}; {parent} above it is {found}, and could have the "
                                              "run dir swapped for a link")


def check_run_dir_files(key: str, path: Path, folder: str = "submitit") -> None:
    """Submit side: refuse (ConfigError on `key`) a directory that holds entries but none that a run dir's
    layout names (`RUN_DIR_NAMES`, or `folder`, the submitit folder): the user's other work, which the run would
    write among; and a run dir with a file of more than one name (a hard link, as `cp -al` makes: the job would
    append to the other name's ledger). checkpoints/ is not looked into: its files are only read, or replaced
    by new ones, never written in place. An absent or empty directory passes."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    if names and RUN_DIR_NAMES.isdisjoint(names) and folder not in names:
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(key, str(path), f"a new or empty directory, or a run dir (one holding config.yaml, "
                                          f"checkpoints/, attempts.jsonl, ...); it holds {shown} and none of a run "
                                          "dir's files: it is left as it is")
    linked = _a_linked_file(Path(path))
    if linked is not None:
        raise ConfigError(key, str(path), f"a run dir whose files each have one name; {linked} has "
                                          f"{os.lstat(linked).st_nlink} (a hard link, as cp -al makes: the job "
                                          "would write the other names' file too; copy a run dir with cp -a)")


def _a_linked_file(top: Path) -> Optional[Path]:
    """A regular file under `top` with more than one name, or None. Not looked at: checkpoints/, and the lease
    and its temp files (a taker links its lease into place, so it has two names for a moment; the lease is
    replaced, never written in place, and its spare is opened by `open_own`, which refuses a link itself)."""
    for folder, dirs, files in os.walk(top):
        if Path(folder) == top:
            dirs[:] = [name for name in dirs if name != CHECKPOINT_DIR]
            files = [name for name in files if name != LEASE_FILE and not name.startswith(f".{LEASE_FILE}.")]
        for name in files:
            info = os.lstat(os.path.join(folder, name))
            if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                return Path(folder, name)
    return None


def check_run_dir(path: Path) -> None:
    """The job side's check of its run dir (or submitit folder), before it reads a pickle or writes:
    Untrusted, naming the directory, when it is not the user's alone."""
    try:
        check_dir("run dir", Path(path))
    except ConfigError as err:
        raise Untrusted(f"the run dir {path} is not trusted ({err.allowed}): the job does not run in it") from None


def own_dir(parent: Path, *names: str, mode: int = 0o755) -> Path:
    """`parent/names...`, each made when missing (`mode`: a umask of 002 adds no group write); Untrusted when
    one is a symlink, not a directory, another user's or open to others (made by someone who could write the
    run dir once)."""
    path = Path(parent)
    for name in names:
        path = path / name
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, mode)
        check_own_dir(path, "write in")
    return path


def check_own_dir(path: Path, doing: str = "read") -> None:
    """Untrusted when `path` is a symlink, not a directory, another user's or open to others (an lstat:
    a link is never followed); `doing`: what the job would do with it, as the error says."""
    found = _problem(os.lstat(path))
    if found is not None:
        raise Untrusted(f"{path} is {found}: the job does not {doing} it (remove it, if it is no run's)")


def _open(path: Path, flags: int, mode: int = 0o644) -> int:
    """`os.open` that never follows a symlink at `path` (Untrusted, saying so)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise Untrusted(f"{path} is a symlink: the job does not follow it (remove it, if it is no run's)") from None
        raise


def _own_file(fd: int, path: Path) -> int:
    """`fd` when it is a regular file of this user's with no other name (no hard link to a file elsewhere)."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
        os.close(fd)
        raise Untrusted(f"{path} is not a file of this run's (another owner, a hard link or no regular file): "
                        "the job does not write it")
    return fd


def open_own(path: Path, mode: int = 0o644, truncate: bool = True) -> int:
    """A descriptor to write `path` from its start, made when missing; a symlink there is not followed
    (O_NOFOLLOW), and a file that is not the user's alone is left as it is (Untrusted): truncated only
    once checked (and only if `truncate`)."""
    try:  # O_NONBLOCK: a FIFO planted there fails at once (ENXIO, no reader) instead of blocking the writer
        fd = _own_file(_open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, mode), Path(path))
    except OSError as err:
        if err.errno == errno.ENXIO:
            raise Untrusted(f"{path} is a FIFO: the job does not write it (remove it, if it is no run's)") from None
        raise
    os.set_blocking(fd, True)  # a regular file's writes never block; the flag is dropped for what follows
    if truncate:
        os.ftruncate(fd, 0)
    return fd


def write_own(path: Path, text: str) -> None:
    """`path`'s whole text, written through `open_own`."""
    fd = open_own(path)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def move_own(path: Path, dest: Path) -> None:
    """Rename `path` to `dest` (one filesystem) when it is a regular file of this user's alone: a symlink
    there is neither followed nor moved (Untrusted), and one swapped in while it moves is taken back out of
    `dest` (Untrusted)."""
    fd = _own_file(_open(path, os.O_RDONLY | os.O_NONBLOCK), Path(path))
    try:
        before = os.fstat(fd)
        os.rename(path, dest)
        after = os.lstat(dest)
    finally:
        os.close(fd)
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        os.unlink(dest)
        raise Untrusted(f"{path} was replaced while it was moved to {dest}: not kept")


def open_read(path: Path) -> BinaryIO:
    """`path` opened for reading without following a symlink (Untrusted) and only if it is a regular file
    (a planted FIFO would block the reader)."""
    fd = _open(path, os.O_RDONLY | os.O_NONBLOCK)
    handle = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        handle.close()
        raise Untrusted(f"{path} is no regular file: not read")
    return handle


def read_own(path: Path) -> str:
    """`path`'s text, read through `open_read`."""
    with open_read(path) as handle:
        return handle.read().decode(errors="replace")


#: What stands where a regular file belongs, when it is something else.
_NOT_A_FILE = {stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory",
               stat.S_IFCHR: "a device", stat.S_IFBLK: "a device", stat.S_IFSOCK: "a socket"}


def file_problem(info: os.stat_result) -> Optional[str]:
    """Why a file with `info` (an lstat, or the fstat of what was opened) is not to be trusted, or None:
    anything but a regular file (a link, a FIFO that would block its reader, a directory, a device), another
    user's, or one with a name elsewhere too (a hard link: writing it would write that other file)."""
    if not stat.S_ISREG(info.st_mode):
        return _NOT_A_FILE.get(stat.S_IFMT(info.st_mode), "no regular file")
    if info.st_uid != os.geteuid():
        return f"owned by {_user(info.st_uid)}, not by {_user(os.geteuid())}"
    if info.st_nlink != 1:
        return f"a hard link ({info.st_nlink} names)"
    return None


def open_trusted(path: Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """A descriptor of `path` (made when missing where `flags` hold O_CREAT) when it is a regular file of this
    user's with one name; else Untrusted, saying what is there. Never follows a link (O_NOFOLLOW), never
    blocks on a FIFO (O_NONBLOCK: it opens at once, and fstat refuses it); FileNotFoundError passes. Pass no
    O_TRUNC: a file is changed only once it is checked."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        raise
    except OSError as err:  # a link (ELOOP), a directory opened to write (EISDIR), a socket (ENXIO): say which
        try:
            found = file_problem(os.lstat(path))
        except OSError:
            found = None
        if found is None:
            raise err from None
        raise Untrusted(f"{path} is {found}: not opened") from None
    found = file_problem(os.fstat(fd))
    if found is not None:
        os.close(fd)
        raise Untrusted(f"{path} is {found}: not opened")
    return fd
