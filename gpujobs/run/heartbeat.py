"""Each rank's progress, cheap enough for every step: its step and phase, written by a thread.

The training loop only stores two attributes (`beat.step = ...`, `beat.phase = ...`): no call, no
clock, no I/O on the hot path. A daemon thread rewrites `RUN_DIR/heartbeat/rank_<N>.json` every
`interval_s` with the step, the phase and a counter of its own writes. The watchdog beside the ranks
(`gpujobs.run.watchdog`) reads those files with its own clock, so the ranks' clocks never matter:

- no rank's (step, phase) changed for `trainer.hang_timeout_s`: the attempt is hung;
- a rank whose counter stopped moving has a process that no longer runs (stopped, or gone), and is
  the first one blamed.

Each rank also registers `faulthandler` on SIGUSR1, writing every thread's Python stack to
`rank_<N>.stacks`: the watchdog's way to a rank's stack where it cannot run py-spy (another node).
Torch-free.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import IO, Any, Optional

from gpujobs.rundir import HEARTBEAT_DIR
from gpujobs.rundir.trust import open_own, own_dir

#: What a rank is doing. `collective` and `compute` (forward and backward, with DDP's gradient
#: all-reduce inside) are where a rank waits for the others.
PHASES = ("start", "data", "compute", "optimizer", "collective", "checkpoint", "eval", "done")
#: Phases that are slow by nature: `trainer.hang_slow_phase_s` applies to them.
SLOW_PHASES = frozenset({"start", "checkpoint", "eval"})
#: Phases in which a rank waits on the others (a hung rank elsewhere keeps them there).
WAITING_PHASES = frozenset({"collective", "compute"})
#: The signal on which a rank writes its Python stacks (faulthandler: works while it is blocked in C).
STACKS_SIGNAL = signal.SIGUSR1
# fixed-size writes in place: a reader sees the old record or the new one, never a shorter file
_RECORD_BYTES = 512


def interval_for(hang_timeout_s: float) -> float:
    """How often a rank rewrites its heartbeat: often enough to tell a stopped process quickly, rarely
    enough for a shared filesystem (0.5 to 5 s)."""
    return min(5.0, max(0.5, hang_timeout_s / 30))


def instance() -> str:
    """Which run of the job this process belongs to, as the watchdog beside it knows it: the Slurm job id
    and its restart count, or the local job's id (its controller's pid); stale files of an earlier
    attempt say another."""
    if "SLURM_JOB_ID" in os.environ:
        return f"slurm:{os.environ['SLURM_JOB_ID']}:{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    return f"local:{os.environ.get('SUBMITIT_LOCAL_JOB_ID', os.getppid())}"


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    """Rank `rank`'s heartbeat file."""
    return Path(run_dir) / HEARTBEAT_DIR / f"rank_{rank}.json"


def stacks_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` writes its stacks on STACKS_SIGNAL."""
    return Path(run_dir) / HEARTBEAT_DIR / f"rank_{rank}.stacks"


class NoBeat:
    """A heartbeat that reports nowhere (a loop without a watchdog: the debug executor, benches)."""

    step: int = 0
    phase: str = "start"
    start_step: int = 0
    """The step this attempt began at (its checkpoint's)."""
    trained_from: Optional[float] = None
    """When its first training step began (epoch seconds)."""

    def close(self) -> None:
        """Nothing to stop."""


class Heartbeat(NoBeat):
    """This rank's heartbeat; `start` it, set `step` and `phase` as the loop goes, `close` at the end."""

    def __init__(self, run_dir: Path, rank: int, node: str, interval_s: float) -> None:
        self.step = self.start_step = 0
        self.phase = "start"
        self.rank = rank
        self.interval_s = interval_s
        self.path = heartbeat_path(run_dir, rank)
        self._identity = {
            "rank": rank, "pid": os.getpid(), "node": node, "host": socket.gethostname(),
            "instance": instance(), "started": round(time.time(), 3),
        }
        self._beats = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._fd: Optional[int] = None
        self._stacks: Optional[IO[str]] = None

    def start(self) -> Heartbeat:
        """Open the files, register the stack dump, write the first beat and start the writer thread."""
        own_dir(self.path.parent.parent, HEARTBEAT_DIR)  # a link planted in the run dir is refused, not followed
        self._fd = open_own(self.path)
        self._stacks = os.fdopen(open_own(stacks_path(self.path.parent.parent, self.rank)), "w")
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self._write()
        self._thread = threading.Thread(target=self._run, name="gpujobs-heartbeat", daemon=True)
        self._thread.start()
        return self

    def record(self) -> dict[str, Any]:
        """What the next write says."""
        return {**self._identity, "step": self.step, "start_step": self.start_step, "phase": self.phase,
                "trained_from": self.trained_from, "beats": self._beats}

    def _write(self) -> None:
        if self._fd is None:
            return
        self._beats += 1
        data = json.dumps(self.record()).encode()
        os.pwrite(self._fd, data.ljust(_RECORD_BYTES), 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except OSError:  # a full or vanished filesystem: the watchdog sees the beats stop
                continue

    def close(self) -> None:
        """Say `done`, stop the thread, close the files (the stack dump goes back to default)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 1)
            self._thread = None
        self.phase = "done"
        with contextlib.suppress(OSError):
            self._write()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._stacks is not None:
            faulthandler.unregister(STACKS_SIGNAL)
            self._stacks.close()
            self._stacks = None


def read_heartbeat(path: Path) -> Optional[dict[str, Any]]:
    """The record in a heartbeat file, or None (absent, or read while being written)."""
    try:
        value = json.loads(path.read_bytes().strip() or b"null")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and isinstance(value.get("rank"), int) else None
