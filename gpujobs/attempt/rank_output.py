"""A pod's ranks' output, kept in the run dir as well as shown by `kubectl logs`.

Each rank's stdout and stderr go to the pod's own (what `kubectl logs` shows) and, appended, to
`<folder>/<jobset>_<global rank>_log.out|.err`, where `gpujobs logs RUN_DIR --rank N` reads them as it reads
a Slurm job's: a pod's output is gone with the pod, the run dir's stays. A JobSet restart reuses the name, so
a restart's output follows the last one's in the same file.

One pipe a stream and one thread a pipe, copying what comes in `os.read` chunks (a partial line never holds
the copy back) to both places; a thread ends at EOF, once every process holding its pipe has exited. The
log file is opened as the run dir's other files are (`trust.open_own`: a planted symlink is not followed,
another user's file not written). A log file that cannot be written (a full disk, a planted link) costs the
file, never the rank: the copy to the pod's stream goes on, and one line on the pod's stderr says so.

Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

from gpujobs.backends.kubernetes.jobs import rank_log_path
from gpujobs.rundir.trust import open_own

#: Bytes read from a rank's pipe at once (a pipe's default capacity).
_CHUNK = 65536


def _write_all(fd: int, data: bytes) -> None:
    """All of `data` to `fd` (a short write, as a nearly full disk or a signal gives, is followed by the rest)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _say(line: str) -> None:
    """One line on the pod's stderr, written whole."""
    with contextlib.suppress(OSError):
        _write_all(sys.stderr.fileno(), f"gpujobs: {line}\n".encode())


class LogFile:
    """A rank's log file, appended to until it cannot be: then one line on the pod's stderr, and no more
    writes (a file with a hole in the middle would read as whole)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: Optional[int] = None
        try:
            fd = open_own(path, truncate=False)  # a restart's output follows the last one's
        except OSError as err:  # Untrusted (a planted link, another user's file) is one
            self._give_up(err)
            return
        try:
            os.lseek(fd, 0, os.SEEK_END)
        except OSError as err:
            os.close(fd)
            self._give_up(err)
            return
        self._fd = fd

    def _give_up(self, err: OSError) -> None:
        self.close()
        _say(f"the log file {self.path} could not be written ({err.strerror or err}): this rank's output "
             "from here on is only in the pod's (kubectl logs)")

    def write(self, data: bytes) -> None:
        """Append `data`, unless a write failed before."""
        if self._fd is None:
            return
        try:
            _write_all(self._fd, data)
        except OSError as err:
            self._give_up(err)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _copy(pipe: int, pod_fd: int, log: LogFile) -> None:
    """Copy what comes through `pipe` to `pod_fd` and `log` until EOF, then close both ends it owns.

    It never stops before EOF, whatever fails: a copy that stopped would fill the pipe and block the rank."""
    try:
        while chunk := os.read(pipe, _CHUNK):
            with contextlib.suppress(OSError):  # the pod's stream gone (nothing to tell it on): the file still gets it
                _write_all(pod_fd, chunk)
            log.write(chunk)
    finally:
        os.close(pipe)
        log.close()


class RankOutput:
    """The copies of one pod's ranks' streams: `pipes` gives a rank's stdout and stderr, `join` waits for the
    copies to end."""

    def __init__(self, folder: Path, jobset: str) -> None:
        self.folder = folder
        self.jobset = jobset
        self._threads: list[threading.Thread] = []

    def _pipe(self, pod_fd: int, log_path: Path) -> int:
        """A pipe's write end, whose read end a new thread copies to `pod_fd` and `log_path`."""
        read_end, write_end = os.pipe()
        thread = threading.Thread(target=_copy, args=(read_end, pod_fd, LogFile(log_path)),
                                  name=f"copy {log_path.name}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return write_end

    @contextlib.contextmanager
    def pipes(self, rank: int) -> Iterator[tuple[int, int]]:
        """Global rank `rank`'s stdout and stderr (write ends) to start it with; closed here once it has its
        own (inside the block), so that its exit ends the copies."""
        ends: list[int] = []
        try:
            for pod_fd, err in ((sys.stdout.fileno(), False), (sys.stderr.fileno(), True)):
                ends.append(self._pipe(pod_fd, rank_log_path(self.folder, self.jobset, rank, err=err)))
            yield ends[0], ends[1]
        finally:
            for end in ends:
                os.close(end)

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the copies to reach EOF (the ranks have exited): no tail is lost. One
        still open then is held by a process the ranks left behind: said, and not waited for."""
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        left = [thread.name for thread in self._threads if thread.is_alive()]
        if left:
            _say(f"a process the ranks left holds their output open after {timeout_s:g} s ({', '.join(left)}): "
                 "not waited for")
