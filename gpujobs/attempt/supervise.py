"""`python -m gpujobs.attempt.supervise -- srun ... -m gpujobs.rank.srun ARGS`: the batch step beside the ranks.

The sbatch script runs this in the batch step; it runs the job's one `srun` step and stays beside it,
as the local launcher does for a local job. It records what the ranks could not: an attempt whose rank
0 died (a SIGKILL, the OOM killer, a segfault), or that ended with no line at all. Such an attempt is
recorded as `failed`, naming the rank whose error came first where one lived to leave it
(`gpujobs.attempt.failures`: a script's rank that failed after rank 0 was done), else the ranks that `srun`
says died; the failure budget decides, as for any attempt, whether the job is requeued. A script job
whose every rank exited 0 is recorded `completed` here: only the step's end shows that. It also holds
the run dir's lease: a duplicate job (a hand-run `sbatch` of a running run dir) stands down before any
rank starts.

It also runs the hang watchdog (`gpujobs.attempt.hangs`) beside the step: once no rank made progress for
`trainer.hang_timeout_s`, it takes every rank's stacks (py-spy on this node, SIGUSR1 through
`scancel --signal` elsewhere), kills the step (`scancel --signal=KILL JOB.STEP`: Slurm kills every
process of it, on every node), and records the attempt as `hung`, naming the culprit's rank and node:
the node is excluded from the requeued attempt.

Torch-free and quick to start: it only reads the run dir and waits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Optional

from gpujobs.attempt import failures
from gpujobs.attempt.hangs import Watchdog
from gpujobs.attempt.preemption import record_attempt, slurm_job_id
from gpujobs.backends.jobenv import allocated_world_size
from gpujobs.config.load import JobConfig
from gpujobs.rank import srun as start
from gpujobs.rank.observe.prometheus import withdraw_left_target
from gpujobs.rank.script import record_completed
from gpujobs.rundir.attempts import AttemptLog, AttemptNotRecorded, say_unrecorded
from gpujobs.rundir.files import read_config
from gpujobs.rundir.heartbeat import STACKS_SIGNAL, instance

_WATCH_S = 0.5

# "srun: error: node1: task 0: Killed", "srun: error: node2: tasks 1-3: Exited with exit code 1"
_TASK_LINE = re.compile(r"srun: error: (?P<node>[^:]+): tasks? (?P<tasks>[0-9,\-]+): (?P<what>.+)$")


def died(srun_lines: list[str]) -> list[str]:
    """What `srun` said of the tasks that ended badly, one entry per line, in order."""
    found = []
    for line in srun_lines:
        match = _TASK_LINE.search(line.strip())
        if match:
            tasks = match.group("tasks")
            label = f"rank {tasks}" if tasks.isdigit() else f"ranks {tasks}"
            found.append(f"{label} on {match.group('node')}: {match.group('what')}")
    return found


def crashed_node(srun_lines: list[str]) -> Optional[str]:
    """The node of the first task `srun` says ended badly (the crash is attributed to it), or None."""
    for line in srun_lines:
        match = _TASK_LINE.search(line.strip())
        if match:
            return match.group("node")
    return None


def run_step(command: list[str], watchdog: Optional[Watchdog] = None) -> tuple[int, list[str]]:
    """Run the srun step, passing its stderr through, with `watchdog` ticking beside it; returns the
    step's exit code and its stderr lines."""
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")
    assert proc.stderr is not None
    if watchdog is not None:
        threading.Thread(target=_watch, args=(proc, watchdog), name="gpujobs-watchdog", daemon=True).start()
    lines = []
    for line in proc.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        lines.append(line)
    return proc.wait(), lines


def _watch(proc: subprocess.Popen[str], watchdog: Watchdog) -> None:
    """Tick the watchdog until the step ends or the watchdog killed it."""
    while proc.poll() is None:
        try:
            if watchdog.tick():
                return
        except Exception as err:  # the watchdog must never take the supervisor down
            print(f"gpujobs: the hang watchdog failed: {err!r}", file=sys.stderr, flush=True)
            return
        time.sleep(_WATCH_S)


def _scancel(*args: str) -> Optional[str]:
    """`scancel ARGS JOB.STEP` for every job step of this job (not the batch step: that is us); None once
    done, else what went wrong."""
    job = os.environ.get("SLURM_JOB_ID", "")
    try:
        listed = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True,
                                timeout=30, check=False)
        steps = [s for s in listed.stdout.split() if s.rpartition(".")[2].isdigit()]
        if not steps:
            return f"no job step of {job} to signal ({listed.stderr.strip() or 'squeue listed none'})"
        done = subprocess.run(["scancel", *args, *steps], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return None if done.returncode == 0 else (done.stderr.strip() or f"scancel exited with {done.returncode}")


def ask_stacks() -> None:
    """SIGUSR1 to every rank of the job's steps: each writes its stacks (faulthandler)."""
    error = _scancel(f"--signal={STACKS_SIGNAL.name.removeprefix('SIG')}")
    if error is not None:
        print(f"gpujobs: could not ask the ranks for their stacks: {error}", file=sys.stderr, flush=True)


def kill_steps() -> None:
    """SIGKILL every process of the job's steps, on every node (Slurm tracks them; a stopped one dies too)."""
    error = _scancel("--signal=KILL")
    if error is not None:
        print(f"gpujobs: could not kill the hung step: {error}", file=sys.stderr, flush=True)


def supervise(run_dir: Path, job_id: str, command: list[str]) -> int:
    """Run one attempt of the job in `run_dir` and record it if its ranks did not; returns the exit code."""
    job = read_config(run_dir)
    train_dir = start.training_dir(run_dir, job_id)
    start.stand_down_unless_ours(train_dir, job_id)
    ledger = AttemptLog(train_dir)
    before = len(ledger.read())
    world = allocated_world_size()
    watchdog = Watchdog.for_job(train_dir, job, world or job.resources.world_size, instance(), before + 1,
                                kill=kill_steps, signal_remote=ask_stacks)
    started = time.time()
    code, lines = run_step(command, watchdog)
    withdraw_left_target(train_dir)  # the ranks are gone: a target rank 0 could not withdraw (killed) goes too
    if len(ledger.read()) > before:
        return code  # rank 0 recorded the attempt (and requeued the job if it may go again)
    try:
        _record_step(train_dir, job, watchdog, code, lines, started)
    except AttemptNotRecorded as err:  # a full disk: said in one line, as the local launcher says it
        say_unrecorded(err)
    return code


def _record_step(train_dir: Path, job: JobConfig, watchdog: Optional[Watchdog], code: int, lines: list[str],
                 started: float) -> None:
    """Record the attempt its ranks did not: hung, completed (a script's), or how they ended."""
    world = allocated_world_size()
    if watchdog is not None and watchdog.report is not None:
        record_attempt(str(train_dir), job, "hung", recorded_by="supervisor", world_size=world,
                       **watchdog.report.attempt_fields())
        return
    ranks = world or job.resources.world_size
    if code == 0:
        if job.script is not None:  # every rank's script exited 0: the line is ours (`record_completed`)
            record_completed(train_dir, job, ranks, started, time.time() - started, recorded_by="supervisor")
        return
    left = failures.left_outcome(train_dir, ranks, instance())
    if left is not None:  # a rank lived to say why it failed or stopped (after rank 0 was done, or died)
        reason, fields = left
        record_attempt(str(train_dir), job, reason, recorded_by="supervisor", world_size=ranks,
                       start=round(started, 3), **fields)
        return
    what = died(lines)
    error = "; ".join(what) if what else f"srun exited with code {code}"
    why = f"the ranks recorded nothing: {error}"
    # SLURM_NTASKS of the batch step: the allocation's ranks (an elastic job's differ between attempts)
    record_attempt(str(train_dir), job, "failed", recorded_by="supervisor", error=why, start=round(started, 3),
                   world_size=allocated_world_size(), node=crashed_node(lines))


def _stay(signum: int, frame: Optional[FrameType]) -> None:
    print("gpujobs: the supervisor got SIGTERM: it stays until the srun step ends (Slurm's KillWait at most)",
          file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    """Supervise `COMMAND...`, the job's srun line; its `gpujobs.rank.srun` words name the run dir."""
    # Slurm's USR2 is for the ranks (they agree on a stop); in the batch step it must not kill us.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    # Nor its SIGTERM (the time limit, a scancel): the batch step's end would end the job, and the ranks
    # with it, before KillWait is up; they may be finishing a save and their attempt's line. A handler,
    # not SIG_IGN: srun, which we exec, must get its default back.
    signal.signal(signal.SIGTERM, _stay)
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["--"] or "gpujobs.rank.srun" not in args:
        raise SystemExit("usage: python -m gpujobs.attempt.supervise -- srun ... python -m gpujobs.rank.srun ARGS")
    command = args[1:]
    job_id = slurm_job_id()
    if job_id is None:
        raise SystemExit("gpujobs: the supervisor runs in a Slurm batch step (no SLURM_JOB_ID here)")
    target = start.parse_args(command[command.index("gpujobs.rank.srun") + 1:])
    raise SystemExit(supervise(start.run_dir_of(target, os.environ.get("SLURM_ARRAY_TASK_ID")), job_id, command))


if __name__ == "__main__":
    main()
