"""What the job side asks of Slurm about its own job: requeue it, reopen its node range, signal its steps.

Small named wrappers over the one runner (`commands.slurm_command`); each raises `SlurmCommandError`,
whose message carries the command and Slurm's one-line reason.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from gpujobs.backends.slurm.commands import SlurmCommandError, slurm_command, slurm_output

log = logging.getLogger(__name__)

#: `scontrol requeue`: tries, 1 + 2 + 4 + 8 s apart (a busy controller refuses now and then).
REQUEUE_TRIES = 5
_REQUEUE_TIMEOUT_S = 60.0


def requeue(job_id: str, tries: Optional[int] = None) -> None:
    """`scontrol requeue JOB_ID`, retried with backoff (`REQUEUE_TRIES` tries unless told);
    SlurmCommandError once every try failed."""
    tries = REQUEUE_TRIES if tries is None else tries
    command = ["scontrol", "requeue", job_id]
    last: SlurmCommandError = SlurmCommandError(command, "was not tried")
    for attempt in range(tries):
        if attempt:
            time.sleep(2 ** (attempt - 1))
        try:
            slurm_command(command, timeout_s=_REQUEUE_TIMEOUT_S)
            return
        except SlurmCommandError as err:
            last = err
            log.warning("scontrol requeue %s failed (try %d of %d): %s", job_id, attempt + 1, tries, err.reason)
    if tries == 1:
        raise last
    raise SlurmCommandError(command, f"{last.reason} (tried {tries} times)", last.returncode)


def set_node_range(job_id: str, least: int, most: int, tasks: Optional[int] = None) -> None:
    """Let pending job `job_id` start on `least` to `most` nodes (with `tasks` tasks where given)."""
    command = ["scontrol", "update", f"JobId={job_id}", f"NumNodes={least}-{most}"]
    if tasks is not None:
        command.append(f"NumTasks={tasks}")
    slurm_command(command)


def job_steps(job_id: str) -> list[str]:
    """The ids (`JOB.STEP`) of job `job_id`'s numbered steps: not its batch or extern step."""
    listed = slurm_output(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"])
    return [step for step in listed.split() if step.rpartition(".")[2].isdigit()]


def signal_steps(steps: list[str], signal_name: str) -> None:
    """Send `signal_name` (`KILL`, `USR1`) to every process of `steps`, on every node."""
    slurm_command(["scancel", f"--signal={signal_name}", *steps])
