"""Each rank's progress, cheap enough for every step: its step and phase, written by a thread.

The training loop only stores two attributes (`beat.step = ...`, `beat.phase = ...`): no call, no
clock, no I/O on the hot path. A daemon thread rewrites `RUN_DIR/heartbeat/rank_<N>.json` every
`interval_s` with the step, the phase and a counter of its own writes. The watchdog beside the ranks
(`gpujobs.attempt.watchdog`) reads those files with its own clock, so the ranks' clocks never matter:

- no rank's (step, phase) changed for `trainer.hang_timeout_s`: the attempt is hung;
- a rank whose counter stopped moving has a process that no longer runs (stopped, or gone), and is
  the first one blamed.

Each rank also registers `faulthandler` on SIGUSR1, writing every thread's Python stack to
`rank_<N>.stacks`: the watchdog's way to a rank's stack where it cannot run py-spy (another node).

The thread also relays the watchdog's requests for an NCCL flight-recorder dump. A named pipe works only
between processes of one host, and some shared filesystems refuse `mkfifo`: so the pipe torch's NCCL
monitor listens on is in a private directory of this rank's node (`pipe_dir`, 0700 under `$TMPDIR`),
the watchdog leaves a request file `rank_<N>.fr-request` in the run dir instead, and the thread, on its
next beat, writes it into the pipe. Each beat also says whether torch made that pipe (`flight_recorder`),
so the watchdog waits for dumps only from ranks that can write one.
Torch-free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

from gpujobs.base.process import alive
from gpujobs.rundir import HEARTBEAT_DIR
from gpujobs.rundir.lines import from_line, to_line
from gpujobs.rundir.trust import open_own, own_dir

log = logging.getLogger(__name__)

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
#: Stem of the flight recorder's request pipe, as torch names it: `<stem><rank>.pipe` in `pipe_dir`.
NCCL_PIPE_STEM = "nccl_pipe_rank_"
#: A rank's pipe dir is `<$TMPDIR>/<prefix><pid namespace>-<pid>-<random>`: a dir left by a killed rank is
#: known by its pid, and only in the pid namespace that numbers it.
_PIPE_DIR_PREFIX = "gpujobs-nccl-pipe-"


@dataclass(frozen=True)
class Beat:
    """What a rank's heartbeat file says: which process of which run wrote it, and how far it got."""

    rank: int
    pid: int
    node: str
    host: str
    """The host name the rank's process runs on (the evidence reaches its stack from there)."""
    instance: str
    """The run of the job this process belongs to (`instance`): a stale file of an earlier attempt says another."""
    started: float
    """When the rank started (epoch seconds)."""
    step: int = 0
    start_step: int = 0
    """The step this attempt began at (its checkpoint's)."""
    phase: str = "start"
    """One of `PHASES`."""
    trained_from: Optional[float] = None
    """When its first training step began (epoch seconds; None before it)."""
    beats: int = 0
    """How many times the rank's thread has written the file: a counter that stops is a process that stopped."""
    flight_recorder: bool = False
    """Whether torch made the flight recorder's request pipe (a dump can be asked for)."""
    main_thread: int = 0
    """The main thread's ident, as faulthandler names it: a dump is whole once that thread's block, the
    last one it writes, is there (0: not known, from an older heartbeat)."""


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


def flight_recorder_request_path(run_dir: Path, rank: int) -> Path:
    """Where the watchdog asks rank `rank` for a flight-recorder dump (the rank removes it as it relays it)."""
    return Path(run_dir) / HEARTBEAT_DIR / f"rank_{rank}.fr-request"


def _pid_namespace() -> str:
    """This process's pid namespace, as a name part (its inode): a pid means a process only within it."""
    try:
        return os.readlink("/proc/self/ns/pid").split("[")[-1].rstrip("]")
    except OSError:
        return "0"


def remove_dead_pipe_dirs() -> None:
    """The pipe dirs of this user's ranks of this pid namespace that died without closing (SIGKILL after a
    hang): a rank cannot clean up after its own kill; the supervisor that killed it does, and the next rank
    on the node."""
    stem = f"{_PIPE_DIR_PREFIX}{_pid_namespace()}-"
    for path in Path(tempfile.gettempdir()).glob(f"{stem}*-*"):
        pid = path.name[len(stem):].split("-", 1)[0]
        with contextlib.suppress(OSError):
            info = os.lstat(path)
            if (pid.isdigit() and stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
                    and not alive(int(pid))):
                shutil.rmtree(path)


class NoBeat:
    """A heartbeat that reports nowhere (a loop without a watchdog: the debug executor, benches)."""

    step: int = 0
    phase: str = "start"
    start_step: int = 0
    """The step this attempt began at (its checkpoint's)."""
    trained_from: Optional[float] = None
    """When its first training step began (epoch seconds)."""
    pipe_dir: Optional[Path] = None
    """This node's private dir for the flight recorder's request pipe (None: no one relays requests)."""

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
        self._identity = Beat(rank=rank, pid=os.getpid(), node=node, host=socket.gethostname(), instance=instance(),
                              started=round(time.time(), 3), main_thread=threading.main_thread().ident or 0)
        self._beats = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._fd: Optional[int] = None
        self._stacks: Optional[IO[str]] = None
        self._request = flight_recorder_request_path(run_dir, rank)

    def start(self) -> Heartbeat:
        """Open the files, register the stack dump, make the pipe dir, write the first beat and start the
        writer thread."""
        own_dir(self.path.parent.parent, HEARTBEAT_DIR)  # a link planted in the run dir is refused, not followed
        with contextlib.suppress(FileNotFoundError):  # an earlier attempt's: not this one's to answer
            os.unlink(self._request)
        self._fd = open_own(self.path)
        self._stacks = os.fdopen(open_own(stacks_path(self.path.parent.parent, self.rank)), "w")
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        try:
            remove_dead_pipe_dirs()
            self.pipe_dir = Path(tempfile.mkdtemp(prefix=f"{_PIPE_DIR_PREFIX}{_pid_namespace()}-{os.getpid()}-"))
        except OSError as err:  # a full or read-only temp dir costs the dump on request, not the run
            log.warning("gpujobs: rank %d has no flight-recorder pipe, so no dump on a hang (no private dir "
                        "in the node's temp dir: %s)", self.rank, err)
        self._write()
        self._thread = threading.Thread(target=self._run, name="gpujobs-heartbeat", daemon=True)
        self._thread.start()
        return self

    def record(self) -> Beat:
        """What the next write says."""
        return dataclasses.replace(self._identity, step=self.step, start_step=self.start_step, phase=self.phase,
                                   trained_from=self.trained_from, beats=self._beats,
                                   flight_recorder=self._pipe() is not None)

    def _pipe(self) -> Optional[Path]:
        """The pipe torch's NCCL monitor made and reads (only where this rank runs NCCL), or None."""
        if self.pipe_dir is None:
            return None
        pipe = self.pipe_dir / f"{NCCL_PIPE_STEM}{self.rank}.pipe"
        try:
            return pipe if stat.S_ISFIFO(os.lstat(pipe).st_mode) else None
        except OSError:
            return None

    def _relay(self) -> None:
        """A request of the watchdog's, if there is one, written into the pipe (a dump follows)."""
        try:
            os.unlink(self._request)
        except FileNotFoundError:
            return
        pipe = self._pipe()
        if pipe is None:
            return
        with contextlib.suppress(OSError):  # ENXIO: torch's monitor has closed it; no dump to ask for
            fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, b"1\n")
            finally:
                os.close(fd)

    def _write(self) -> None:
        if self._fd is None:
            return
        self._beats += 1
        data = json.dumps(to_line(self.record())).encode()
        os.pwrite(self._fd, data.ljust(_RECORD_BYTES), 0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
                self._relay()
            except OSError:  # a full or vanished filesystem: the watchdog sees the beats stop
                continue

    def close(self) -> None:
        """Say `done`, stop the thread, close the files (the stack dump goes back to default), remove the
        pipe dir."""
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
        if self.pipe_dir is not None:
            shutil.rmtree(self.pipe_dir, ignore_errors=True)
            self.pipe_dir = None


def read_beat(path: Path) -> Optional[Beat]:
    """The beat in a heartbeat file, or None (absent, read while being written, or no beat)."""
    try:
        value = json.loads(path.read_bytes().strip() or b"null")
    except (OSError, ValueError):
        return None
    return from_line(Beat, value)
