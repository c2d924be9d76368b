"""USR2 → a flag → an agreed stop at a step boundary, then requeue within the budgets (torch-free).

Slurm sends USR2 `signal_lead_s` seconds before the time limit (`--signal`) and at once when a
preempting job arrives (`preempt_send_user_signal`). The handler (`StopFlag`) only sets a flag: no I/O,
no collectives, nothing that could deadlock or tear a file. At each step boundary the ranks agree on it
(`gpujobs.rank.stop`: a one-element all-reduce), so they all stop after the same step, save one
complete checkpoint together and exit; rank 0 records the attempt and requeues the job
(`record_attempt`). No step is lost or redone.

Data never comes from loader worker processes here (batches are built in the rank's own process), so
no worker can die first or swallow the signal.

A USR2 can also come while a rank is still starting (a preempting job arrives just then). The Slurm
entry calls `catch_early` before anything slow, and the flag adopts what it caught: until then the
signal would go to submitit's handler, which requeues the job outside the attempt budgets, or, with no
handler at all, kill the process. This module is cheap to import that early.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Optional, TypeVar

from gpujobs.attempt.image import image_fields
from gpujobs.backends import backend_for
from gpujobs.backends.jobenv import allocated_world_size
from gpujobs.backends.slurm import control, quarantine
from gpujobs.backends.slurm.commands import SlurmCommandError
from gpujobs.base.errors import GpujobsError
from gpujobs.config.load import JobConfig, ResourcesConfig
from gpujobs.rundir.attempts import AttemptLog, Decision
from gpujobs.rundir.records import NODE_FAULTS, Attempt

log = logging.getLogger(__name__)

#: Exit status of a rank that stopped to be requeued (EX_TEMPFAIL: "try again later").
EXIT_REQUEUED = 75
# A USR2 this close to the time limit (beyond the signal lead) means the time limit, not preemption.
_TIMEOUT_SLACK_S = 60


# signal number → when it first came, for signals caught before any flag was installed
_EARLY: dict[int, float] = {}

_Flag = TypeVar("_Flag", bound="StopFlag")


def catch_early(signum: int = signal.SIGUSR2) -> None:
    """First thing in a rank's process: remember a `signum` that comes before the flag is installed."""
    signal.signal(signum, _remember_early)


def _remember_early(signum: int, frame: Optional[FrameType]) -> None:
    _EARLY.setdefault(signum, time.time())


class StopFlag:
    """USR2 (`signum`) turned into a flag, and when it first came: what a rank's handler may do."""

    def __init__(self, signum: int = signal.SIGUSR2) -> None:
        self.signum = signum
        self.flagged = False
        self.flagged_at: Optional[float] = None
        self._previous: Any = None

    def install(self: _Flag) -> _Flag:
        """Replace the signal's handler (submitit's own, in a submitit job) with ours."""
        self._previous = signal.signal(self.signum, self._handle)
        early = _EARLY.pop(self.signum, None)
        if early is not None:
            self.flagged, self.flagged_at = True, early
        return self

    def uninstall(self) -> None:
        """Put the previous handler back."""
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        self.flagged = True  # only a flag: the loop acts at the next step boundary
        if self.flagged_at is None:
            self.flagged_at = time.time()


def classify_stop(job: JobConfig, attempt_started: float, signalled_at: Optional[float]) -> str:
    """`timeout` when the signal came near the time limit, else `preempted`."""
    at = signalled_at if signalled_at is not None else time.time()
    limit_s = job.cluster.timeout_min * 60
    return "timeout" if at - attempt_started >= limit_s - job.cluster.signal_lead_s - _TIMEOUT_SLACK_S else "preempted"


def record_attempt(run_dir: str, job: JobConfig, reason: str, *, ledger: Optional[AttemptLog] = None,
                   **fields: Any) -> Attempt:
    """Rank 0 (or a supervisor): decide whether to go again, requeue on Slurm if so, then write the
    attempt's line (`fields`: the other `Attempt` fields) once, complete; returns the attempt as recorded.

    `scontrol requeue` ends this job instance (SIGTERM to its every process, SIGKILL KillWait later):
    SIGTERM is ignored from the requeue until the line is written, so that the line says what came of it
    (a requeue that failed after its retries, a node that could not be excluded) and is never amended.
    A caller that does not say the attempt's world size gets the one its environment gives (on Slurm:
    the allocation's); the line names the container image the ranks ran in (`image.image_fields`). A
    supervisor passes its own `ledger`, which remembers the lines a full disk refused.

    An attempt that blames a node (a reason in `NODE_FAULTS`, with `node`) and goes again on Slurm
    excludes that node from the requeued job (`quarantine`), recorded as `excluded` (the whole list); when
    the job would no longer fit its partition without it, the job is not requeued, and the line says why.
    A crash the supervisor saw (a rank that died on `node`, recorded `failed` by the supervisor) excludes
    its node too, but only where the job still fits without it: a crash is weaker evidence against a node
    (a bug, the OOM killer), so otherwise the job goes again with the node, and the line says so.
    """
    slurm_id = slurm_job_id()
    job_id = slurm_id or os.environ.get(JOB_ID_ENV) or None  # a JobSet's pods: NAMESPACE/NAME
    fields.setdefault("world_size", allocated_world_size())
    for key, value in {**job.resources.held_per_rank, **image_fields(job.container)}.items():
        fields.setdefault(key, value)
    ledger = ledger if ledger is not None else AttemptLog(Path(run_dir))
    decision = ledger.decide(job.cluster, reason)
    slurm_job = slurm_id if backend_for(job).queues else None  # local runs record the node, exclude nothing
    if slurm_job is None or not decision.requeue:
        return _write(ledger, reason, decision, job_id=job_id, **fields)
    with _sigterm_ignored():  # the requeue ends this instance: what follows it, the line too, must not die of that
        decision, changes = _requeue(ledger, job, slurm_job, reason, decision, fields)
        return _write(ledger, reason, decision, job_id=job_id, **{**fields, **changes})


def _write(ledger: AttemptLog, reason: str, decision: Decision, **fields: Any) -> Attempt:
    """Write the attempt's one line, and say in the log how it ended."""
    attempt = ledger.write(reason, decision, **fields)
    log.warning("attempt %d ended: %s; %s", attempt.attempt, reason, attempt.why)
    return attempt


def _requeue(ledger: AttemptLog, job: JobConfig, job_id: str, reason: str, decision: Decision,
             fields: dict[str, Any]) -> tuple[Decision, dict[str, Any]]:
    """Requeue Slurm job `job_id`, whose attempt just ended with `reason` and may go again (`decision`),
    without the node it blames where it should; returns the decision as it turned out, and the changes
    to the line's `fields` (`excluded`)."""
    node = fields.get("node")
    # a rank that left its own error (`culprit_rank`) lived to report it: a bug, not a crash of the node
    crash = reason == "failed" and fields.get("recorded_by") == "supervisor" and fields.get("culprit_rank") is None
    exclusion: Optional[quarantine.Exclusion] = None
    notes: list[str] = []  # said in the line's why once the requeue is done
    changes: dict[str, Any] = {}
    if (reason in NODE_FAULTS or crash) and node:
        exclusion, problem = _plan_exclusion(ledger, job, job_id, reason, str(node))
        notes += [problem] if problem is not None else []
        if crash and exclusion is not None and exclusion.refused is not None:
            notes.append(f"{node} kept after the crash: {exclusion.refused.partition(': ')[2]}")
            exclusion = None
        if exclusion is not None and exclusion.refused is not None:
            log.error("not requeued: %s", exclusion.refused)
            return Decision(False, f"not requeued: {exclusion.refused}"), changes
        if exclusion is not None and "excluded" not in fields:
            changes["excluded"] = exclusion.excluded
    try:
        control.requeue(job_id)
    except SlurmCommandError as err:
        log.error("Slurm job %s is not requeued: %s", job_id, err)
        return Decision(False, f"{decision.why}, but the requeue failed: {err}"), {"excluded": []}
    if exclusion is not None:  # only now: Slurm refuses it while the job runs
        failed = quarantine.exclude(job_id, exclusion.excluded)
        if failed is not None:
            notes.append(f"{node} could not be excluded ({failed}): the job may run there again")
            changes["excluded"] = [n for n in exclusion.excluded if n != node]
    excluded = changes.get("excluded", fields.get("excluded"))
    log.warning("requeued Slurm job %s%s", job_id, f" without {', '.join(excluded)}" if excluded else "")
    reopened = reopen_node_range(job_id, job.resources)
    notes += [reopened] if reopened is not None else []  # it runs again, but only once all MAX nodes are free
    return Decision(True, "; ".join([decision.why, *notes])), changes


def _plan_exclusion(
    ledger: AttemptLog, job: JobConfig, job_id: str, reason: str, node: str
) -> tuple[Optional[quarantine.Exclusion], Optional[str]]:
    """Slurm job `job_id`'s exclusion of `node`, on top of `cluster.exclude` and what its earlier
    attempts excluded; or, where Slurm cannot say what the partition holds, why `node` stays in."""
    partition = os.environ.get("SLURM_JOB_PARTITION") or job.cluster.partition
    earlier = [name for line in ledger.read() if line.job_id == job_id for name in line.excluded]
    try:
        configured = quarantine.expand_hostlist(job.cluster.exclude)
        if partition is None:
            raise GpujobsError("the job's partition is not known (no SLURM_JOB_PARTITION)")
        nodes = quarantine.partition_nodes(partition)
    except GpujobsError as err:  # a Slurm command's (SlurmCommandError), or the line above
        log.error("%s is not excluded: %s", node, err)
        return None, f"{node} not excluded ({err})"
    return quarantine.plan(node, reason, partition, nodes, [*configured, *earlier], job.resources.least_nodes), None


def reopen_node_range(job_id: str, resources: ResourcesConfig) -> Optional[str]:
    """An elastic job's requeued instance: give it back its `MIN-MAX` node range; None once done (or
    for a fixed allocation, which has nothing to reopen), else what went wrong.

    Slurm 22.05 pins a requeued job to the node and task counts of the allocation it just had (seen:
    `--nodes=1-2 --ntasks-per-node=2` requeued from 2 nodes pends as NumNodes=2 NumTasks=4, reason
    Resources, while one node is free), and refuses to change them while the job runs; right after the
    requeue, while it completes, `scontrol update` may (and the job cannot start again before
    cred_expire has passed, so it never starts pinned). Seen to start it again on 1 node when only one
    is free, and on 2 when both are: with `NumTasks=MIN*ranks per node`, or, for one rank per node
    (whose script gives no --ntasks-per-node), with the node range alone (a NumTasks would keep it at MIN).
    """
    if resources.least_nodes >= resources.nodes:
        return None
    least = resources.least_nodes
    tasks = least * resources.ranks_per_node if resources.ranks_per_node > 1 else None
    try:
        control.set_node_range(job_id, least, resources.nodes, tasks)
    except SlurmCommandError as err:
        return f"the node range could not be reopened ({err}): it waits for {resources.nodes} nodes"
    log.warning("requeued Slurm job %s may start on %d to %d nodes", job_id, least, resources.nodes)
    return None


@contextlib.contextmanager
def _sigterm_ignored() -> Iterator[None]:
    """SIGTERM ignored here and in the children started meanwhile (an ignored disposition survives exec).

    After `scontrol requeue`, Slurm ends this job instance: SIGTERM to every process of its steps at
    once, SIGKILL KillWait seconds later. The batch step's supervisor would die of it at once, and an
    `scontrol` child of any process too, before the node range is reopened and the attempt's line is
    written. A SIGTERM that comes meanwhile is dropped: it can only mean "end now", which the caller
    does right after; SIGKILL still follows. Only the main thread may change a handler: elsewhere
    nothing changes.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


#: The job's id where no SLURM_JOB_ID says it: a JobSet's pods set it (`gpujobs.attempt.pod`) for their ranks and
#: themselves, so that their attempts' lines name the JobSet as the run dir's submissions do.
JOB_ID_ENV = "GPUJOBS_JOB_ID"


def slurm_job_id() -> Optional[str]:
    """This job's id as scontrol wants it (array tasks: ARRAYID_TASKID), or None outside Slurm."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    if "SLURM_ARRAY_JOB_ID" in os.environ and "SLURM_ARRAY_TASK_ID" in os.environ:
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ["SLURM_JOB_ID"]
