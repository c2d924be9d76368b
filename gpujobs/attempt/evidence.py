"""A hung attempt's evidence, taken before anything is killed: `RUN_DIR/hangs/<attempt>/`.

- `rank_<N>.txt`: every rank's Python stacks. py-spy (a PyPI wheel: `pip install 'gpujobs[hangs]'`)
  reads them from outside, even from a stopped process, for the ranks on this machine; where it is
  missing or cannot reach a rank, the rank's own faulthandler writes them on SIGUSR1 (registered by
  its heartbeat). A stopped rank cannot run a handler: without py-spy it gets SIGUSR1 and then SIGCONT,
  so its stack is written as it resumes, an instant before it is killed.
- `nccl_trace_rank_<N>`: PyTorch's NCCL flight recorder, where the ranks run NCCL. The watchdog leaves a
  request file in the run dir; each rank's heartbeat thread writes it into the pipe torch listens on
  (`TORCH_NCCL_DEBUG_INFO_PIPE_FILE`, private to the rank's node), on every node alike.
- `nvml.json`: this node's GPUs as NVML reads them now.
- `hang.json`: the heartbeats, the culprit and why, and how each rank's stack was taken.

Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from stat import S_ISREG
from typing import Any, Optional

from gpujobs.base.atomic import write_json_atomic
from gpujobs.base.process import alive, process_state
from gpujobs.rundir import HANGS_DIR, HEARTBEAT_DIR
from gpujobs.rundir.heartbeat import NCCL_PIPE_STEM, STACKS_SIGNAL, Beat, flight_recorder_request_path, stacks_path
from gpujobs.rundir.trust import Untrusted, move_own, read_own, write_own

log = logging.getLogger(__name__)

_PY_SPY_TIMEOUT_S = 20.0
_FAULTHANDLER_WAIT_S = 3.0
#: How long a dump's file must stay the same size to be taken as whole (its last thread's frames).
_SETTLED_S = 0.3
_FLIGHT_RECORDER_WAIT_S = 5.0
#: Stem of the NCCL flight recorder's dumps: `<stem><rank>`, in the heartbeat dir.
NCCL_TRACE_STEM = "nccl_trace_rank_"


def hang_dir(run_dir: Path, attempt: int) -> Path:
    """Where attempt `attempt`'s evidence goes."""
    return Path(run_dir) / HANGS_DIR / str(attempt)


def nccl_debug_env(run_dir: Path, entries: int, pipe_dir: Optional[Path]) -> dict[str, str]:
    """The flight recorder's settings for a rank of `run_dir`: `entries` collectives kept, dumped into the
    heartbeat dir on NCCL's own timeout and on request through a pipe in `pipe_dir` (its heartbeat's,
    which relays the watchdog's requests; None: no pipe)."""
    beats = Path(run_dir) / HEARTBEAT_DIR
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(entries),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1" if entries else "0",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(beats / NCCL_TRACE_STEM),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(pipe_dir / NCCL_PIPE_STEM) if entries and pipe_dir else "",
    }


def stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, or a debugger)."""
    return process_state(pid) in ("T", "t")


def local_ranks(ranks: dict[int, Beat]) -> dict[int, int]:
    """rank -> pid of the ranks whose heartbeat says they run on this machine, and whose process lives."""
    host = socket.gethostname()
    return {rank: beat.pid for rank, beat in ranks.items() if beat.host == host and alive(beat.pid)}


def py_spy_dump(pid: int) -> Optional[str]:
    """py-spy's dump of `pid`'s threads, or None (no py-spy, no permission, it failed)."""
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    # py-spy pauses a running process to read a consistent stack; a stopped one it cannot pause (it fails
    # to find the interpreter), but it is still already, so it is read as it is
    command = [exe, "dump", "--pid", str(pid), *(["--nonblocking"] if stopped(pid) else [])]
    try:
        proc = subprocess.run(command, capture_output=True, text=True,
                              timeout=_PY_SPY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 and proc.stdout.strip() else None


def take_stacks(run_dir: Path, out: Path, ranks: dict[int, Beat],
                signal_remote: Optional[Callable[[], None]] = None) -> dict[int, str]:
    """Every rank's stacks into `out/rank_<N>.txt`; returns rank -> how they were taken.

    `signal_remote` asks the ranks this machine cannot reach for theirs (on Slurm: `scancel --signal`; in a
    JobSet's pods: a request the other pods' supervisors answer with `ask_local_stacks`).
    """
    here = local_ranks(ranks)
    how, asked = ask_local_stacks(run_dir, ranks, here, out)
    for rank in sorted(set(ranks) - set(here)):
        how[rank] = "faulthandler (asked on its node)"
        asked.append(rank)
    if asked and any(rank not in here for rank in asked) and signal_remote is not None:
        signal_remote()
    deadline = time.monotonic() + _FAULTHANDLER_WAIT_S
    waits = {rank: _Answer(stacks_path(run_dir, rank), ranks[rank].main_thread) for rank in asked}
    while not all(wait.whole() for wait in waits.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for rank in sorted(asked):
        try:  # never through a link: its target's text would be copied into the evidence
            text = read_own(stacks_path(run_dir, rank))
        except OSError:
            text = ""
        write_own(out / f"rank_{rank}.txt", text or "no stack: the rank did not answer SIGUSR1\n")
        if not text:
            how[rank] += ", no answer"
    return dict(sorted(how.items()))


def ask_local_stacks(run_dir: Path, ranks: dict[int, Beat], here: dict[int, int],
                     out: Optional[Path] = None) -> tuple[dict[int, str], list[int]]:
    """Ask the ranks of this machine (`here`: rank -> pid) for their stacks: py-spy's, written into `out`
    where there is one (and `out` is given), else their faulthandler's, which they write into their stacks
    files. Returns rank -> how, and the ranks whose faulthandler was asked (their answers are still coming).

    A stopped rank is continued alone while the others are held: a rank held mid-dump went on, when
    continued, with its threads running under its own handler, and left half a dump (CI). So the stopped
    ranks answer first, before any running rank is asked. A stopped rank that dies while it writes them
    (faulthandler reads the frames of its other threads, which run meanwhile, and can crash it: CI) ends the
    asking: the ranks still held stay stopped for the kill that follows, and are not asked."""
    how: dict[int, str] = {}
    asked: list[int] = []
    signalled: list[int] = []
    for rank in sorted(here, key=lambda r: not stopped(here[r])):
        pid = here[rank]
        if out is not None and (text := py_spy_dump(pid)) is not None:
            write_own(out / f"rank_{rank}.txt", text)
            how[rank] = "py-spy"
            continue
        if stopped(pid):  # it runs no handler until it continues: alone, then stops again
            asked.append(rank)
            if not _stacks_of_stopped(stacks_path(run_dir, rank), ranks[rank].main_thread, pid,
                                      [p for p in here.values() if p != pid]):
                how[rank] = "faulthandler (stopped: continued alone to write them, and died doing it)"
                _keep_held(how, here, rank, out)
                return how, asked  # stopped ranks come first: no running rank was signalled yet
            how[rank] = "faulthandler (stopped: continued alone to write them, then stopped again)"
            continue
        signalled.append(pid)
        how[rank] = "faulthandler"
        asked.append(rank)
    for pid in signalled:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, STACKS_SIGNAL)
    return how, asked


class _Answer:
    """A rank's faulthandler answer in `stacks`, watched until whole. faulthandler writes the threads one
    by one, the main thread last; a rank descheduled mid-dump (a busy node) leaves a part of it for a
    while, so the answer is whole once the main thread's block (`main_thread`: its ident, 0 when not
    known) is there and the file has stopped growing. A link there is no answer."""

    def __init__(self, stacks: Path, main_thread: int) -> None:
        self.stacks = stacks
        # "Current thread 0x...", or "Thread 0x..." where another thread ran the handler
        self.header = f"hread 0x{main_thread:016x} (most recent call first)" if main_thread else ""
        self.size = -1
        self.since = time.monotonic()

    def whole(self) -> bool:
        """Whether the dump is whole now (call it every few tens of milliseconds)."""
        try:
            info = os.lstat(self.stacks)
        except OSError:
            return False
        if not S_ISREG(info.st_mode) or info.st_size == 0:
            return False
        now = time.monotonic()
        if info.st_size != self.size:
            self.size, self.since = info.st_size, now
            return False
        if now - self.since < _SETTLED_S:
            return False
        if not self.header:
            return True
        try:
            return self.header in read_own(self.stacks)
        except OSError:
            return False


def _stacks_of_stopped(written: Path, main_thread: int, pid: int, others: list[int]) -> bool:
    """SIGUSR1, then SIGCONT, to stopped rank `pid`, until its faulthandler has written `written`; then it is
    stopped again. The ranks beside it (`others`, on this machine) are held still meanwhile: once the
    stopped rank runs, the attempt judged hung could go on training, saving and recording past its verdict.
    False where the rank died meanwhile: the others are left held then, as once continued they would find
    their peer gone and record a failure of their own before the kill of the hung attempt."""
    held = [other for other in others if alive(other) and not stopped(other)]
    for other in held:
        with contextlib.suppress(ProcessLookupError):
            os.kill(other, signal.SIGSTOP)
    try:
        os.kill(pid, STACKS_SIGNAL)
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + _FAULTHANDLER_WAIT_S
        answer = _Answer(written, main_thread)
        while not answer.whole() and time.monotonic() < deadline and alive(pid):
            time.sleep(0.05)
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        pass  # it is gone: nothing more to read
    if not alive(pid):
        return False
    for other in held:
        with contextlib.suppress(ProcessLookupError):
            os.kill(other, signal.SIGCONT)
    return True


def _keep_held(how: dict[int, str], here: dict[int, int], died: int, out: Optional[Path]) -> None:
    """Say of each rank of `here` not asked yet that it was kept stopped when rank `died` died answering."""
    said = f"not asked: rank {died} died writing its stacks, and this rank was kept stopped for the kill"
    for rank in sorted(set(here) - set(how)):
        how[rank] = said
        if out is not None:
            write_own(out / f"rank_{rank}.txt", said + "\n")


def dump_flight_recorder(run_dir: Path, out: Path, ranks: dict[int, Beat],
                         beat_interval_s: float) -> list[int]:
    """Ask the flight recorder of every rank whose heartbeat (in `ranks`) says it has one (NCCL's; gloo has
    none) for a dump, and move the dumps into `out`; returns the ranks that wrote one. The request is a file
    that each rank's heartbeat thread relays on its next beat (every `beat_interval_s`), from any node."""
    asked = []
    for rank in sorted(rank for rank, beat in ranks.items() if beat.flight_recorder):
        with contextlib.suppress(OSError):  # a full disk: that rank is not asked
            write_own(flight_recorder_request_path(run_dir, rank), "dump\n")
            asked.append(rank)
    deadline = time.monotonic() + (beat_interval_s + _FLIGHT_RECORDER_WAIT_S if asked else 0)
    found: list[int] = []
    while True:
        for rank in ranks:
            if rank not in found and _take_trace(Path(run_dir) / HEARTBEAT_DIR / f"{NCCL_TRACE_STEM}{rank}", out):
                found.append(rank)
        if len(found) >= len(asked) or time.monotonic() >= deadline:
            return sorted(found)
        time.sleep(0.2)


def _take_trace(trace: Path, out: Path) -> bool:
    """Whether a dump was at `trace` and is now in `out`; a symlink there is left, never followed."""
    try:
        info = os.lstat(trace)
        if not S_ISREG(info.st_mode) or not info.st_size:
            return False
        move_own(trace, out / trace.name)
    except Untrusted as err:
        log.warning("gpujobs: %s", err)
        return False
    except OSError:
        return False
    return True


def nvml_snapshot() -> dict[str, Any]:
    """This node's visible GPUs as NVML reads them now (or why it cannot)."""
    from gpujobs.base.nvml import NvmlUnavailable, nvml_session, read_gpu, visible_gpus

    try:
        with nvml_session() as nv:
            return {"node": socket.gethostname(),
                    "gpus": [{"index": g.index, "uuid": g.uuid, **read_gpu(nv, g.handle)} for g in visible_gpus(nv)]}
    except NvmlUnavailable as err:
        return {"node": socket.gethostname(), "unavailable": str(err)}


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """hang.json: what the watchdog saw and decided."""
    write_json_atomic(out / "hang.json", summary)


def kill_tree(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """SIGKILL `pids` (a stopped process dies of it too) and wait until they are gone; returns those left."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        left = [pid for pid in pids if alive(pid)]
        if not left:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def descendants(root: int) -> list[int]:
    """Every process below `root` in the process tree (children first, as /proc lists them)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def local_job_processes(controller: int, *, below: bool = True) -> list[int]:
    """The processes of local job `controller` (submitit's controller pid, its job id): those below it in the
    process tree (`below`: not once the controller has exited, when its pid may be another's), and those whose
    environment names it (SUBMITIT_LOCAL_JOB_ID, which every rank inherits): a rank in a podman container is
    the child of podman's conmon, not of its controller."""
    found = descendants(controller) if below else []
    tag = f"SUBMITIT_LOCAL_JOB_ID={controller}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            named = tag in environ.read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        pid = int(environ.parent.name)
        if named and pid not in found and pid != os.getpid():
            found.append(pid)
    return found
