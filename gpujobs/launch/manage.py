"""Watch, cancel and repair submitted runs and sweeps (submit side, torch-free).

A run dir (config.yaml) or a sweep dir (sweep.json) is all these need: each Slurm run dir lists the job
ids that ran it (`slurm_jobs.jsonl`, the last is the current one). States come from ONE `sacct` call
for the whole sweep per poll, never one per job; when `sacct` is slow or fails, the table says so and
falls back to what the run dirs' files say. Every JSON-lines file is read with `atomic.read_jsonl`, so a
torn or garbage line in any of them is skipped, never fatal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from gpujobs.backends import Scheduler, backend_for, slurm_backend
from gpujobs.backends.slurm.commands import SlurmCommandError
from gpujobs.base.errors import GpujobsError
from gpujobs.rundir import CONFIG_FILE, lease
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.files import read_config, read_submissions, record_cancel
from gpujobs.rundir.records import Attempt, Result, read_result

if TYPE_CHECKING:
    from gpujobs.launch.sweep import Outcome

#: How a run that ran here (cluster=local or debug) ended, as its files say, that `resubmit --failed`
#: brings back: its last attempt's reason once no attempt follows, or `interrupted` (its launcher is gone).
FAILED_HERE = {"failed", "hung", "unhealthy", "timeout", "preempted", "interrupted"}


@dataclass
class PointState:
    """One run dir of a sweep (or the only one of a single run) and what is known about it."""

    num: Optional[int]
    overrides: list[str]
    run_dir: Path
    job_id: Optional[str]
    logs: Optional[Path]
    cancelled: bool = False
    """`gpujobs cancel` cancelled the current job."""
    state: str = "?"
    final: bool = False
    """The current job will not run again by itself (Slurm says so, or the run dir's files do)."""
    ended: Optional[str] = None
    """Why it is over where the run dir's files say so (`state_from_files`): completed, cancelled,
    interrupted, or the last attempt's reason; None while it may go on, or where Slurm's state is shown."""


def points_of(path: Path) -> list[PointState]:
    """The points of a sweep dir (sweep.json), or the one run of a run dir (config.yaml)."""
    from gpujobs.launch.sweep import read_sweep_file

    entries = read_sweep_file(path)
    if not entries:
        if not (path / CONFIG_FILE).exists():
            raise GpujobsError(f"{path} is neither a run dir (no {CONFIG_FILE}) nor a sweep dir (no sweep.json)")
        entries = [{"num": None, "overrides": [], "run_dir": str(path)}]
    points = []
    for entry in entries:
        run_dir = Path(entry["run_dir"])
        submissions = read_submissions(run_dir)
        queued = [line for line in submissions if line.logs is not None]
        if not queued:
            points.append(PointState(entry["num"], list(entry["overrides"]), run_dir, None, None))
            continue
        current = queued[-1]
        cancelled = any(line.cancelled is not None and line.job_id == current.job_id for line in submissions)
        points.append(PointState(entry["num"], list(entry["overrides"]), run_dir, current.job_id, current.logs,
                                 cancelled))
    return points


def _local_lease(run_dir: Path) -> Optional[lease.Lease]:
    """The run dir's lease when a launcher on a machine (cluster=local or debug) holds it, not a Slurm job."""
    held = lease.read(run_dir)
    return held if held is not None and held.by_launcher else None


def current_result(run_dir: Path, attempts: Optional[list[Attempt]] = None) -> Optional[Result]:
    """result.json while it is the run's last word, else None: a result stays on disk when the run dir is
    started again (a larger trainer.max_steps resumes it here) and when such a start fails.

    It is the last word when no attempt was recorded after the completed one that wrote it, and no local
    launcher took the run dir since (its lease is newer than that attempt: the ranks and the launcher
    share a clock). Slurm jobs queued on a completed run dir train in a rerun dir: its result stays.
    """
    result = read_result(run_dir)
    attempts = AttemptLog(run_dir).read() if attempts is None else attempts
    if result is None or not attempts:  # no ledger: written by a gpujobs that kept none
        return result
    held = _local_lease(run_dir)
    if attempts[-1].reason != "completed" or (held is not None and held.since > attempts[-1].end):
        return None
    return result


def state_from_files(point: PointState) -> tuple[str, Optional[str]]:
    """What the run dir says without Slurm, and why it is over when that is final (else None).

    A local launcher that took the run dir after its last recorded attempt, or is to restart that
    attempt, is running it while it lives (its lease says so: `running`); gone, it was killed or its
    machine went down (`interrupted`, final). A sweep's launcher keeps the leases of the points it ran
    while it runs the next: their last attempts came after it took them. Otherwise final: a current
    result says completed (`current_result`), `gpujobs cancel` cancelled the current job, or the
    current job's last attempt says it will not be requeued. An attempt of an earlier job (the point was
    resubmitted since) says nothing about the current one.
    """
    held = _local_lease(point.run_dir)
    attempts = AttemptLog(point.run_dir).read()
    last = attempts[-1] if attempts else None
    if held is not None and (last is None or last.end < held.since or last.requeue):
        return ("running (files)", None) if lease.live(held)[0] else ("interrupted (files)", "interrupted")
    result = current_result(point.run_dir, attempts)
    if result is not None and result.completed:
        return "completed (files)", "completed"
    if point.cancelled:
        return "cancelled (files)", "cancelled"
    if last is None or last.job_id != point.job_id:
        return "? (files)", None
    return f"{last.reason} (files)", None if last.requeue else last.reason


def refresh(points: list[PointState], timeout_s: float = 10.0) -> Optional[str]:
    """Fill in every point's state and finality; returns a warning when sacct could not be asked."""
    scheduler = slurm_backend()  # the scheduler whose job ids `slurm_jobs.jsonl` lists (a run here has none)
    try:
        states = scheduler.states([p.job_id for p in points if p.job_id], timeout_s)
    except SlurmCommandError as err:
        for point in points:
            _from_files(point)
        return f"{err}: showing what the run dirs say"
    for point in points:
        state = states.get(point.job_id) if point.job_id else None
        if state is not None:
            point.state, point.final = state, state in scheduler.final_states
        elif point.cancelled:  # Slurm keeps no record of an array task cancelled while pending
            point.state, point.final = scheduler.cancelled_state, True
        else:  # a local run, or a job sacct does not list (yet)
            _from_files(point)
    return None


def _from_files(point: PointState) -> None:
    point.state, point.ended = state_from_files(point)
    point.final = point.ended is not None


def select(points: list[PointState], num: Optional[int]) -> list[PointState]:
    """All points, or the one numbered `num`."""
    if num is None:
        return points
    chosen = [p for p in points if p.num == num or (p.num is None and num == 0)]
    if not chosen and points and all(p.num is None for p in points):
        raise GpujobsError(f"no point #{num}: {points[0].run_dir} is a single run, not a sweep (its only point is 0)")
    if not chosen:
        raise GpujobsError(f"no point #{num}: points are {', '.join(str(p.num) for p in points)}")
    return chosen


@dataclass
class CancelOutcome:
    """What `cancel` did to each job id it was given."""

    cancelled: list[str] = field(default_factory=list)
    ended: dict[str, str] = field(default_factory=dict)
    """Ids that had already ended (or were purged, long over), and scancel's words."""
    failed: dict[str, str] = field(default_factory=dict)
    """Ids scancel could not signal for another reason, and why."""


def cancel(points: list[PointState]) -> CancelOutcome:
    """Cancel the current job of each point (one call); note each id it cancelled in its run dir. The
    ids it could not cancel are not noted (`Scheduler.cancel` names them), the others are even when some fail."""
    outcome = CancelOutcome()
    scheduler = slurm_backend()
    errors = scheduler.cancel([p.job_id for p in points if p.job_id])
    for point in points:
        if point.job_id is None:
            continue
        why = errors.get(point.job_id)
        if why is None:
            record_cancel(point.run_dir, point.job_id)
            outcome.cancelled.append(point.job_id)
        elif scheduler.already_ended(why):
            outcome.ended[point.job_id] = why
        else:
            outcome.failed[point.job_id] = why
    return outcome


def resubmit(sweep_dir: Path, points: list[PointState], *, cancelled: bool = False) -> list[Outcome]:
    """Start again the points that failed (and, if asked, were cancelled): Slurm points as one new array
    (a single run dir: one job again, as it was), points that ran here (cluster=local or debug) here, one
    after another, as the sweep ran them (`sweep.run_here`).

    Each is checked first as every start is (preflight, `check_start`): one refused, nothing is queued
    or run. Each resumes from its run dir's last complete checkpoint, as every start does. Returns one
    outcome per point, in order: queued (its job id) or, for those run here, completed or failed.
    """
    from gpujobs.launch.sweep import ARRAY_FOLDER, Outcome, SweepPlan, run_here, submit_arrays

    scheduler = slurm_backend()
    slurm_wanted = scheduler.failed_states | ({scheduler.cancelled_state} if cancelled else set())
    here_wanted = FAILED_HERE | ({"cancelled"} if cancelled else set())
    # a point never queued to Slurm ran here: only its files say how it ended
    chosen = [p for p in points if (p.state in slurm_wanted if p.job_id else p.ended in here_wanted)]
    plan = SweepPlan(sweep_dir.absolute(), single=bool(chosen) and chosen[0].num is None)
    for p in chosen:
        plan.add(read_config(p.run_dir), p.run_dir, p.num or 0, p.overrides)
    queued = [point for point in plan.points if backend_for(point.job).queues]
    here = [point for point in plan.points if not backend_for(point.job).queues]
    if chosen and chosen[0].num is None:  # a single run dir: one job again, as it was
        (point,) = plan.points
        backend = backend_for(point.job)
        if isinstance(backend, Scheduler):
            job_id = backend.submit(point.job, point.run_dir)
            print(f"gpujobs: submitted Slurm job {job_id}; run dir {point.run_dir}", flush=True)
            return [Outcome(point, 0, job_id=job_id)]
        from gpujobs.launch import start

        return [Outcome(point, start(point.job, point.run_dir))]
    outcomes = submit_arrays(queued, sweep_dir.absolute() / ARRAY_FOLDER) if queued else []
    return outcomes + run_here(sweep_dir.absolute(), here)
