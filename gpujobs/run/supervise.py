"""`python -m gpujobs.run.supervise -- srun ... -m gpujobs.run.start ARGS`: the batch step beside the ranks.

The sbatch script runs this in the batch step; it runs the job's one `srun` step and stays beside it,
as the local launcher does for a local job. It records what the ranks could not: an attempt whose rank
0 died (a SIGKILL, the OOM killer, a segfault), or that ended with no line at all. Such an attempt is
recorded as `failed`, naming the ranks that `srun` says died, and the failure budget decides, as for
any attempt, whether the job is requeued. It also holds the run dir's lease: a duplicate job (a hand-run
`sbatch` of a running run dir) stands down before any rank starts.

Torch-free and quick to start: it only reads the run dir and waits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional

from gpujobs.run import start
from gpujobs.run.jobenv import allocated_world_size
from gpujobs.run.preemption import record_attempt, slurm_job_id
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.files import read_config

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


def run_step(command: list[str]) -> tuple[int, list[str]]:
    """Run the srun step, passing its stderr through; returns its exit code and its stderr lines."""
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        sys.stderr.write(line)
        sys.stderr.flush()
        lines.append(line)
    return proc.wait(), lines


def supervise(run_dir: Path, job_id: str, command: list[str]) -> int:
    """Run one attempt of the job in `run_dir` and record it if its ranks did not; returns the exit code."""
    job = read_config(run_dir)
    train_dir = start.training_dir(run_dir, job_id)
    start.stand_down_unless_ours(train_dir, job_id)
    ledger = AttemptLog(train_dir)
    before = len(ledger.read())
    code, lines = run_step(command)
    if len(ledger.read()) > before or code == 0:
        return code  # rank 0 recorded the attempt (and requeued the job if it may go again)
    what = died(lines)
    error = "; ".join(what) if what else f"srun exited with code {code}"
    why = f"the ranks recorded nothing: {error}"
    # SLURM_NTASKS of the batch step: the allocation's ranks (an elastic job's differ between attempts)
    record_attempt(str(train_dir), job, "failed", recorded_by="supervisor", error=why,
                   world_size=allocated_world_size())
    return code


def main(argv: Optional[list[str]] = None) -> None:
    """Supervise `COMMAND...`, the job's srun line; its `gpujobs.run.start` words name the run dir."""
    # Slurm's USR2 is for the ranks (they agree on a stop); in the batch step it must not kill us.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] != ["--"] or "gpujobs.run.start" not in args:
        raise SystemExit("usage: python -m gpujobs.run.supervise -- srun ... python -m gpujobs.run.start ARGS")
    command = args[1:]
    job_id = slurm_job_id()
    if job_id is None:
        raise SystemExit("gpujobs: the supervisor runs in a Slurm batch step (no SLURM_JOB_ID here)")
    target = start.parse_args(command[command.index("gpujobs.run.start") + 1:])
    raise SystemExit(supervise(start.run_dir_of(target, os.environ.get("SLURM_ARRAY_TASK_ID")), job_id, command))


if __name__ == "__main__":
    main()
