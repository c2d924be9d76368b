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
from typing import Optional

from gpujobs.run.evidence import alive, descendants, kill_tree, process_start

log = logging.getLogger(__name__)

#: Exit code of a rank that ended because its launcher was gone.
EXIT_ORPHANED = 1

#: What runs before this rank ends for its launcher's going, with the launcher's pid: rank 0 records the
#: attempt there (the launcher that would have is gone), so the ledger keeps every attempt.
last_words: list[Callable[[int], None]] = []


def watch_launcher(pid: int, started: Optional[str], interval_s: float = 1.0) -> threading.Thread:
    """Start a daemon thread that ends this process (and its descendants) once launcher `pid`, started
    at `started` (`process_start`), is gone, after `last_words`; returns the thread."""

    def watch() -> None:
        while alive(pid) and process_start(pid) == started:
            time.sleep(interval_s)
        log.error("gpujobs: the local launcher (pid %d) is gone: this rank ends with it", pid)
        for say in last_words:
            try:
                say(pid)
            except Exception as err:  # best effort: the rank ends all the same
                log.error("gpujobs: could not record the attempt: %s", err)
        kill_tree(descendants(os.getpid()), grace_s=2.0)
        os._exit(EXIT_ORPHANED)

    thread = threading.Thread(target=watch, name="gpujobs-launcher-watch", daemon=True)
    thread.start()
    return thread
