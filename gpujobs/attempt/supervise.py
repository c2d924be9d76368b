"""`python -m gpujobs.attempt.supervise -- srun ... -m gpujobs.rank.srun ARGS`: the batch step beside the ranks.

The sbatch script runs this in the batch step; it runs the job's one `srun` step and stays beside it,
as the local launcher does for a local job. It records what the ranks could not, judged as the local
launcher judges it (`gpujobs.attempt.judge`): an attempt whose rank 0 died (a SIGKILL, the OOM
killer, a segfault), or that ended with no line at all, is recorded as `failed`, naming the rank whose
error came first where one lived to leave it (`gpujobs.attempt.failures`: a script's rank that failed
after rank 0 was done), else the ranks that `srun` says died; the failure budget decides, as for any
attempt, whether the job is requeued. A script job whose every rank exited 0 is recorded `completed`
here: only the step's end shows that. It also holds the run dir's lease: a duplicate job (a hand-run
`sbatch` of a running run dir) stands down before any rank starts.

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
from contextlib import nullcontext
from pathlib import Path
from types import FrameType
from typing import Optional

from gpujobs.attempt import failures
from gpujobs.attempt import slurm_task as task
from gpujobs.attempt.file_sd import withdraw_left_target
from gpujobs.attempt.hangs import HangWatchdog
from gpujobs.attempt.judge import AttemptEnd, judge, record_verdict
from gpujobs.attempt.preemption import slurm_job_id
from gpujobs.backends.jobenv import allocated_world_size
from gpujobs.backends.slurm import control
from gpujobs.backends.slurm.commands import SlurmCommandError
from gpujobs.backends.slurm.relay import Relay
from gpujobs.config.modes import Runtime
from gpujobs.rundir.attempts import AttemptLog
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


def run_step(command: list[str], watchdog: Optional[HangWatchdog] = None) -> tuple[int, list[str]]:
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


def _watch(proc: subprocess.Popen[str], watchdog: HangWatchdog) -> None:
    """Tick the watchdog until the step ends or the watchdog killed it."""
    while proc.poll() is None:
        try:
            if watchdog.tick():
                return
        except Exception as err:  # the watchdog must never take the supervisor down
            print(f"gpujobs: the hang watchdog failed: {err!r}", file=sys.stderr, flush=True)
            return
        time.sleep(_WATCH_S)


def _signal_steps(signal_name: str) -> Optional[str]:
    """Send `signal_name` to every job step of this job (not the batch step: that is us); None once
    done, else what went wrong."""
    job = os.environ.get("SLURM_JOB_ID", "")
    try:
        steps = control.job_steps(job)
        if not steps:
            return f"no job step of {job} to signal (squeue listed none)"
        control.signal_steps(steps, signal_name)
    except SlurmCommandError as err:
        return str(err)
    return None


def ask_stacks() -> None:
    """SIGUSR1 to every rank of the job's steps: each writes its stacks (faulthandler)."""
    error = _signal_steps(STACKS_SIGNAL.name.removeprefix("SIG"))
    if error is not None:
        print(f"gpujobs: could not ask the ranks for their stacks: {error}", file=sys.stderr, flush=True)


def kill_steps() -> None:
    """SIGKILL every process of the job's steps, on every node (Slurm tracks them; a stopped one dies too)."""
    error = _signal_steps("KILL")
    if error is not None:
        print(f"gpujobs: could not kill the hung step: {error}", file=sys.stderr, flush=True)


def supervise(run_dir: Path, job_id: str, command: list[str]) -> int:
    """Run one attempt of the job in `run_dir` and record it if its ranks did not; returns the exit code."""
    job = read_config(run_dir)
    train_dir = task.training_dir(run_dir, job_id)
    task.stand_down_unless_ours(train_dir, job_id)
    ledger = AttemptLog(train_dir)
    before = len(ledger.read())
    # SLURM_NTASKS of the batch step: the allocation's ranks (an elastic job's differ between attempts)
    ranks = allocated_world_size() or job.resources.world_size
    watchdog = HangWatchdog.for_job(train_dir, job, ranks, instance(), before + 1, kill=kill_steps,
                                    signal_remote=ask_stacks)
    started = time.time()
    # ranks in a container run Slurm's commands (rank 0's requeue) through us: the image seldom has them
    with Relay(train_dir / f".slurm-relay-{job_id}") if job.container.runtime != Runtime.none else nullcontext():
        code, lines = run_step(command, watchdog)
    withdraw_left_target(train_dir)  # the ranks are gone: a target rank 0 could not withdraw (killed) goes too
    history = ledger.read()
    what = died(lines)
    end = AttemptEnd(
        ranks=ranks, started=started, exited_ok=code == 0, recorded=history[-1] if len(history) > before else None,
        hang=watchdog.report if watchdog is not None else None,
        # a rank that lived to say why it failed or stopped (after rank 0 was done, or died)
        left=failures.left_outcome(train_dir, ranks, instance()) if code != 0 else None,
        error=f"the ranks recorded nothing: {'; '.join(what) if what else f'srun exited with code {code}'}",
        node=crashed_node(lines), script=job.script is not None,
    )
    # where rank 0 recorded the attempt (and requeued the job if it may go again), its line stands
    record_verdict(ledger, job, judge(end), recorded_by="supervisor")
    return code


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
    if args[:1] != ["--"] or task.RANK_MODULE not in args:
        raise SystemExit(f"usage: python -m gpujobs.attempt.supervise -- srun ... python -m {task.RANK_MODULE} ARGS")
    command = args[1:]
    job_id = slurm_job_id()
    if job_id is None:
        raise SystemExit("gpujobs: the supervisor runs in a Slurm batch step (no SLURM_JOB_ID here)")
    target = task.parse_args(command[command.index(task.RANK_MODULE) + 1:])
    raise SystemExit(supervise(task.run_dir_of(target, os.environ.get("SLURM_ARRAY_TASK_ID")), job_id, command))


if __name__ == "__main__":
    main()
