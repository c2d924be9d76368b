"""A local job's ranks never outlive their launcher.

The local launcher follows its job, records the attempts nobody else can, and holds the run dir's lease
by its pid: once it is gone (a SIGKILL, a crash), the next submission of the run dir takes the lease over
and starts a job of its own. Ranks that went on training there would write the same checkpoints and the
same ledger as that job. So every local rank watches its launcher (its pid and start time: a reused pid
is another process) and ends itself, with what it started (a script), within a second of its going.
Ranks of a Slurm job have Slurm for that. Torch-free.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gpujobs.attempt.evidence import descendants, kill_tree
from gpujobs.base.process import alive, process_start

if TYPE_CHECKING:
    from gpujobs.config.load import JobConfig

log = logging.getLogger(__name__)

#: Exit code of a rank that ended because its launcher was gone.
EXIT_ORPHANED = 1

#: What runs before this rank ends for its launcher's going, with the launcher's pid: rank 0 records the
#: attempt there (the launcher that would have is gone), so the ledger keeps every attempt.
last_words: list[Callable[[int], None]] = []



def record_if_orphaned(run_dir: str, job: JobConfig, started: float, progress: Callable[[], dict[str, Any]]) -> None:
    """Rank 0 of a local job whose attempt began at `started`: should its launcher be killed outright,
    record the attempt as `interrupted` (with `progress()`, how far it got) before the rank ends with it,
    unless a line was written since the attempt began (rank 0's own, just before)."""
    from gpujobs.attempt.preemption import record_attempt
    from gpujobs.rundir.attempts import AttemptLog

    ledger = AttemptLog(Path(run_dir))
    before = len(ledger.read())

    def record(launcher: int) -> None:
        if len(ledger.read()) == before:
            record_attempt(run_dir, job, "interrupted", start=round(started, 3),
                           error=f"its launcher (pid {launcher}) was gone", **progress())

    last_words.append(record)


_watched: Optional[tuple[int, Optional[str]]] = None
_said = threading.Lock()
_spoken = False


def watch_launcher(pid: int, started: Optional[str], interval_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that ends this process (and its descendants) once launcher `pid`, started
    at `started` (`process_start`), is gone, after `last_words`; returns the thread."""
    global _watched
    _watched = (pid, started)

    def watch() -> None:
        while gone_launcher() is None:
            time.sleep(interval_s)
        log.error("gpujobs: the local launcher (pid %d) is gone: this rank ends with it", pid)
        say_last_words(pid)
        kill_tree(descendants(os.getpid()), grace_s=2.0)
        os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="gpujobs-launcher-watch", daemon=True)
    thread.start()
    return thread


def gone_launcher() -> Optional[int]:
    """The pid of the launcher this rank watches, when it is gone now; None while it lives (or where
    none is watched: a Slurm rank).

    A rank that fails asks first: its peers end with the launcher, one watcher's second apart, and a
    rank that fails of that (a collective whose peer went, a script killed) is no failure of its own.
    """
    if _watched is None:
        return None
    pid, started = _watched
    return None if alive(pid) and process_start(pid) == started else pid


def say_last_words(pid: int) -> None:
    """Run `last_words` for the going of launcher `pid`, once per process (the watcher and a rank that
    fails of the launcher's going may both come here)."""
    global _spoken
    with _said:
        if _spoken:
            return
        _spoken = True
        for say in last_words:
            try:
                say(pid)
            except Exception as err:  # best effort: the rank ends all the same
                log.error("gpujobs: could not record the attempt: %s", err)
