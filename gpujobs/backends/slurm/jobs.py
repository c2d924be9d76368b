"""Slurm's jobs once queued: their state, their end, cancel, requeue, node range, signals to their steps.

Every command goes through `commands.slurm_command`; what a caller must not die of (a requeue that
failed, a signal that did not arrive) comes back as one line, None once done.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Sequence
from typing import Any, Optional

from gpujobs.backends.slurm.commands import SlurmCommandError, last_line, slurm_command

log = logging.getLogger(__name__)

#: Slurm states in which a job may still run (or is running) in its run dir.
LIVE_STATES = {
    "PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED", "COMPLETING",
    "CONFIGURING", "STOPPED", "SIGNALING", "STAGE_OUT", "PREEMPTED", "RESV_DEL_HOLD", "SPECIAL_EXIT",
}


def job_state(job_id: str, timeout_s: float = 20.0) -> Optional[str]:
    """The job's state as `squeue` says, "" when Slurm no longer knows it, None when Slurm cannot be asked."""
    try:
        proc = slurm_command(["squeue", "-h", "-j", job_id, "-o", "%T"], timeout_s=timeout_s, check=False)
    except SlurmCommandError:
        return None
    if proc.returncode != 0:
        return "" if "Invalid job id" in proc.stderr else None
    states = proc.stdout.split()
    return states[0] if states else ""


def job_liveness(job_id: str) -> tuple[bool, str]:
    """Whether the job may still run in its run dir, and what says so (a lease's holder: `rundir.lease`)."""
    state = job_state(job_id)
    if state is None:
        return True, "Slurm cannot be asked (squeue failed): assumed running"
    return state in LIVE_STATES, state or "gone from squeue"


class SlurmEnd:
    """Whether a Slurm job is over: its tasks' result files are there *and* Slurm no longer runs or
    queues it.

    submitit calls a job done once every task has a result file. A requeued job keeps the files of its
    instance before until its ranks write new ones: a rank that failed there (its error pickled) counts
    as done while the requeued instance runs, and its old error would be read as the job's ending. And
    the batch step's supervisor writes its ledger line after the ranks end. So the job is over only once
    Slurm says so. A Slurm that cannot be asked is trusted to the files after `patience_s`.
    """

    def __init__(self, sjob: Any, patience_s: float = 120.0, ask_every_s: float = 1.0) -> None:
        self.sjob = sjob
        self.patience_s = patience_s
        self.ask_every_s = ask_every_s
        self._asked = -math.inf
        self._unasked_since: Optional[float] = None

    def over(self) -> bool:
        """Whether the job is over (asks `squeue` at most every `ask_every_s`, and only once done)."""
        now = time.monotonic()
        if now - self._asked < self.ask_every_s or not self.sjob.done():
            return False
        self._asked = now
        state = job_state(str(self.sjob.job_id))
        if state is None:  # squeue failed: the files say done, and they are believed after a while
            self._unasked_since = self._unasked_since if self._unasked_since is not None else now
            return now - self._unasked_since >= self.patience_s
        self._unasked_since = None
        return state not in LIVE_STATES


def cancel(job_ids: Sequence[str]) -> dict[str, str]:
    """`scancel -v` the jobs (one call); the ids it could not signal, with scancel's words.

    `scancel -v` names every id it could not signal, so the others are known cancelled even when some
    fail (Slurm 22.05 exits 0 for ids that already ended, and 1 for other errors). Raises
    SlurmCommandError when scancel could not run, did not answer, or failed without naming an id.
    """
    if not job_ids:
        return {}
    command = ["scancel", "-v", *job_ids]
    try:
        proc = slurm_command(command, timeout_s=30, check=False)
    except SlurmCommandError as err:
        raise SlurmCommandError(command, f"{err.reason}: nothing recorded as cancelled") from None
    errors = {job_id: why.strip() for job_id, why in re.findall(r"error on job id (\S+): (.+)$", proc.stderr, re.M)}
    if proc.returncode != 0 and not errors:  # it named no id: it did not get as far as signalling any
        raise SlurmCommandError(command, f"failed: {last_line(proc.stderr) or proc.returncode}", proc.returncode)
    return errors
