"""One job per run dir: the lease file `lease.json` says which job runs it (torch-free; both sides use it).

The lease names its holder: a Slurm job id, or a local launcher (host, pid, the pid's start time and
the boot: a pid alone may be an unrelated process after a reboot or in a container). Whether it is
live is asked of the holder itself, never of a clock: the Slurm job's state (`squeue`), or the
launcher's process on its host. So a lease needs no heartbeat and no release: once its job is gone it
is stale, and the next job takes it over with a log line.

Why a file and not `flock`/`fcntl`: a Slurm job's lease must hold from `sbatch` until the job ends,
across requeues and while it is pending, when no process of it exists to hold a lock; and POSIX locks
on NFS depend on the lock daemons of every node. A file created with `link()` (atomic on NFS, where
`O_EXCL` was not always) and judged against the scheduler holds on any shared filesystem.

The lease also keeps the attempts that no line of `attempts.jsonl` holds (a full disk): whichever process
judges the budgets next (a fresh launcher, the Slurm supervisor after a requeue, rank 0) counts them. A
full disk must not stop that write too: room for it is kept beside the lease (`.lease.json.spare`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.atomic import fsync_path, write_text_atomic
from gpujobs.base.errors import GpujobsError
from gpujobs.base.process import alive, boot_id, process_start, started_at
from gpujobs.rundir import LEASE_FILE
from gpujobs.rundir.trust import open_own

log = logging.getLogger(__name__)

#: How much later than a lease's `since` its pid may seem to have started and still be its holder: a
#: start time from /proc is of whole seconds of boot time, and the wall clock may have been stepped since.
_CLOCK_SLACK_S = 2.0

#: Whether a queued job lives, by the lease holder's word for its scheduler ("slurm"): the scheduler's to
#: say (for Slurm: `squeue`). The backends, the only place a scheduler's commands run, are a layer above
#: the run dir: their registry fills this in when it is imported (`register_job_liveness`).
_JOB_LIVENESS: dict[str, Callable[[str], tuple[bool, str]]] = {}
#: How an error line names a job of that scheduler ("Slurm job"), filled in beside its liveness.
_JOB_WORDS: dict[str, str] = {}
#: `Lease.holder` of a launcher process on a host (the lease files' word for it).
LAUNCHER = "local"


class LeaseHeld(GpujobsError):
    """Another live job holds the run dir."""


@dataclass(frozen=True)
class Lease:
    """Who runs a run dir."""

    holder: str
    """`slurm` (a Slurm job id), `local` (a launcher process on `host`), or `submitting` (a submit
    process on `host` that is about to hand the lease to the Slurm job it queues)."""
    host: str
    pid: int
    job_id: Optional[str] = None
    """The Slurm job id (`A_i` for a task of an array)."""
    since: float = 0.0
    start_ticks: Optional[str] = None
    """When process `pid` started (`process_start`): with `boot_id`, a later process of that pid is not
    the holder. None in a lease of an older gpujobs: a process of that pid started after `since` is not."""
    boot_id: Optional[str] = None
    """The boot of `host` the process ran in (/proc/sys/kernel/random/boot_id)."""
    unrecorded: list[dict[str, Any]] = field(default_factory=list)
    """The attempts whose line `attempts.jsonl` could not take (`AttemptLog`), as their short lines."""

    @property
    def by_launcher(self) -> bool:
        """Held by a launcher on a machine (cluster=local or debug), not by a queued job or its submitter."""
        return self.holder == LAUNCHER

    def describe(self) -> str:
        """How an error line names the holder."""
        if self.job_id is not None:
            return f"{_JOB_WORDS.get(self.holder, f'{self.holder} job')} {self.job_id}"
        return f"a local job (launcher pid {self.pid} on {self.host})"


def here(job_id: Optional[str] = None, *, submitting: bool = False) -> Lease:
    """A lease for this process: Slurm job `job_id`, a submit process about to queue one, or a local launcher."""
    holder = "slurm" if job_id else "submitting" if submitting else LAUNCHER
    pid = os.getpid()
    return Lease(holder, socket.gethostname(), pid, job_id, round(time.time(), 3), process_start(pid), boot_id())


def read(run_dir: Path) -> Optional[Lease]:
    """The run dir's lease, or None (none, or unreadable: a lease torn by a crash holds nothing)."""
    return _parse(run_dir / LEASE_FILE)


def _parse(path: Path) -> Optional[Lease]:
    try:
        return Lease(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def register_job_liveness(holder: str, liveness: Callable[[str], tuple[bool, str]], job_word: str) -> None:
    """Let `live` ask `liveness(job_id)` about a lease whose holder is `holder` (a scheduler's name), and
    `Lease.describe` name its job as `job_word` ("Slurm job 123")."""
    _JOB_LIVENESS[holder] = liveness
    _JOB_WORDS[holder] = job_word


def live(lease: Lease) -> tuple[bool, str]:
    """Whether the lease's holder may still be running, and what says so."""
    if lease.job_id is not None:
        if lease.holder not in _JOB_LIVENESS:  # a bug, not a user's error: no scheduler was ever imported
            raise RuntimeError(f"no backend registered to say whether a {lease.holder} job lives")
        return _JOB_LIVENESS[lease.holder](lease.job_id)
    if lease.host != socket.gethostname():
        return True, f"a process on {lease.host}, which this host cannot check"
    if not alive(lease.pid):
        return False, "its launcher is gone"
    if lease.boot_id is not None and lease.boot_id != boot_id():
        return False, f"{lease.host} has booted since: pid {lease.pid} is another process now"
    if lease.start_ticks is not None and lease.start_ticks != process_start(lease.pid):
        return False, f"pid {lease.pid} is another process now, not the launcher that took the lease"
    started = started_at(lease.pid) if lease.start_ticks is None and lease.since else None
    if started is not None and started > lease.since + _CLOCK_SLACK_S:  # an older gpujobs' lease: by its time
        return False, f"pid {lease.pid} is another process now, started after the lease was taken"
    return True, "running"


def _same_holder(a: Lease, b: Lease) -> bool:
    if a.job_id is not None or b.job_id is not None:
        return a.job_id == b.job_id  # every rank and every requeue of a Slurm job is that job
    # a stale lease naming a pid that this process now has (a container's launcher after a reboot) is not ours
    return (a.host, a.pid, a.start_ticks, a.boot_id) == (b.host, b.pid, b.start_ticks, b.boot_id)


def _settled(run_dir: Path, wait_s: float) -> Optional[Lease]:
    """The lease, once it is no longer a submit process's: the job that `sbatch` just queued may start
    before its submitter has written the job id (up to `wait_s`)."""
    deadline = time.monotonic() + wait_s
    lease = read(run_dir)
    while lease is not None and lease.holder == "submitting" and time.monotonic() < deadline:
        time.sleep(0.2)
        lease = read(run_dir)
    return lease


def check_free(run_dir: Path, me: Optional[Lease] = None, wait_s: float = 0.0) -> Optional[Lease]:
    """Raise LeaseHeld when a live job other than `me` holds `run_dir`; returns a stale lease, if any.

    `wait_s`: how long a Slurm job waits for its submitter to hand it the lease.
    """
    stale = _judge(run_dir, me, wait_s)
    return stale[0] if stale is not None else None


def _judge(run_dir: Path, me: Optional[Lease], wait_s: float) -> Optional[tuple[Lease, str]]:
    """`check_free`, with why the lease it returns is stale."""
    lease = _settled(run_dir, wait_s)
    if lease is None or (me is not None and _same_holder(lease, me)):
        return None
    if lease.holder == "submitting" and wait_s > 0:
        return lease, "its submitter never handed it to a job: the submission failed or died midway"
    is_live, why = live(lease)
    if is_live:
        raise LeaseHeld(
            f"run dir {run_dir} is in use by {lease.describe()} ({why}): one job per run dir; wait for it, cancel "
            "it, or use another run dir (hydra.run.dir=...)"
        )
    return lease, why


def acquire(run_dir: Path, me: Lease, wait_s: float = 0.0) -> None:
    """Take `run_dir` for `me`: atomically when there is no lease, over a stale (or torn) one with a log line.

    Raises LeaseHeld when another live job holds it, or when another job took it over at the same time.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LEASE_FILE
    judged = _judge(run_dir, me, wait_s)
    stale = judged[0] if judged is not None else None
    current = read(run_dir)
    if stale is None and current is not None and _same_holder(current, me):
        return  # already ours (a requeue, another rank of this job): nothing to write
    if stale is not None or path.exists():  # stale, or torn by a crash
        if not _move_aside(run_dir, stale):
            acquire(run_dir, me, wait_s)  # another taker was first: judge its lease (live: refused)
            return
        if judged is not None:
            log.warning("run dir %s: taking over the stale lease of %s (%s)", run_dir, judged[0].describe(), judged[1])
            me = dataclasses.replace(me, unrecorded=judged[0].unrecorded)  # they still count against the budgets
    tmp = run_dir / f".{LEASE_FILE}.{uuid.uuid4().hex}"
    tmp.write_text(_text(me))
    try:
        os.link(tmp, path)  # atomic, NFS included: fails if another job linked its lease first
    except FileExistsError:
        acquire(run_dir, me, wait_s)  # judge the winner: live (refused) or stale (taken over)
        return
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    fsync_path(run_dir)
    _keep_room(run_dir)
    holder = _read_settled(run_dir)
    if holder is None or not _same_holder(holder, me):  # a taker that judged our lease stale: never, but say so
        raise LeaseHeld(f"run dir {run_dir} was taken over by {holder.describe() if holder else 'another job'}")


def _move_aside(run_dir: Path, judged: Optional[Lease]) -> bool:
    """Move the lease judged stale (`judged`; None: torn) out of the way; False when another taker was first.

    A rename is the takeover: of two takers of one stale lease only one can move that file. The other
    one moves nothing, or, if the first already linked a lease of its own, moves that one, sees that it
    is not the lease it judged, and puts it back.
    """
    path = run_dir / LEASE_FILE
    aside = run_dir / f".{LEASE_FILE}.stale.{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if _parse(aside) != judged:
        os.rename(aside, path)
        return False
    aside.unlink()
    return True


def _read_settled(run_dir: Path, wait_s: float = 2.0) -> Optional[Lease]:
    """The lease, waiting up to `wait_s` while it is missing: a taker may hold ours aside for a moment."""
    deadline = time.monotonic() + wait_s
    lease = read(run_dir)
    while lease is None and time.monotonic() < deadline:
        time.sleep(0.05)
        lease = read(run_dir)
    return lease


def release(run_dir: Path, me: Lease) -> None:
    """Give the run dir back (a submission that sbatch refused): remove the lease if it is still `me`'s.

    A lease is never released otherwise: a job's lease goes stale with its job."""
    current = read(run_dir)
    if current is not None and _same_holder(current, me):
        for name in (LEASE_FILE, _SPARE):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / name).unlink()


def replace(run_dir: Path, lease: Lease) -> None:
    """Rewrite our own lease (the submit side, once sbatch has given the job id), keeping its unrecorded attempts."""
    current = read(run_dir)
    write_text_atomic(run_dir / LEASE_FILE, _text(dataclasses.replace(lease, unrecorded=current.unrecorded)
                                                  if current is not None else lease))
    _keep_room(run_dir)


#: Room kept beside the lease for its rewrite on a full disk: a page (the unit tmpfs and most disks allocate).
_SPARE = f".{LEASE_FILE}.spare"
_ROOM = 4096


def _keep_room(run_dir: Path) -> None:
    """Allocate the spare lease's room now, while the disk has it (best effort: without it, a full
    disk leaves unrecorded attempts in memory only)."""
    with contextlib.suppress(OSError), os.fdopen(open_own(run_dir / _SPARE), "wb") as handle:
        handle.write(b" " * _ROOM)


def keep_unrecorded(run_dir: Path, lines: list[dict[str, Any]]) -> bool:
    """Rewrite the run dir's lease with `lines` as its unrecorded attempts; False when there is no lease
    or it could not be written (even into the room kept for it)."""
    current = read(run_dir)
    if current is None:
        return False
    if current.unrecorded == lines:
        return True
    text = _text(dataclasses.replace(current, unrecorded=lines))
    try:
        write_text_atomic(run_dir / LEASE_FILE, text)
        return True
    except OSError:
        pass  # a full disk: the room kept for this takes it, and the rename frees the old lease's
    data = text.encode()
    if len(data) > _ROOM:
        return False
    spare = run_dir / _SPARE
    try:
        fd = open_own(spare, truncate=False)  # truncating would give the kept room back to the full disk
        try:
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(spare, run_dir / LEASE_FILE)
        fsync_path(run_dir)
    except OSError:
        return False
    _keep_room(run_dir)
    return True


def _text(lease: Lease) -> str:
    return json.dumps(asdict(lease), sort_keys=True) + "\n"
