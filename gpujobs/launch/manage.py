"""Watch, cancel and repair submitted runs and sweeps (submit side, torch-free).

A run dir (config.yaml) or a sweep dir (sweep.json) is all these need: each queued run dir lists the job
ids that ran it (`slurm_jobs.jsonl`, the last is the current one), each with its scheduler (Slurm, or
Kubernetes for a JobSet). States come from ONE call a scheduler for the whole sweep per poll (`sacct`; one
list of JobSets a namespace), never one per job; when it is slow or fails, the table says so and falls back
to what the run dirs' files say. Every JSON-lines file is read with `atomic.read_jsonl`, so a
torn or garbage line in any of them is skipped, never fatal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from gpujobs.backends import Scheduler, backend_for, backend_named
from gpujobs.base.errors import GpujobsError
from gpujobs.rundir import CONFIG_FILE, lease
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.files import read_config, read_submissions, record_cancel
from gpujobs.rundir.records import Attempt, Result, read_result

if TYPE_CHECKING:
    from gpujobs.launch.sweep import Outcome, Point

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
    cluster: str = "slurm"
    """The scheduler that knows `job_id` (a backend name)."""
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
                                 current.cluster, cancelled))
    return points


def _local_lease(run_dir: Path) -> Optional[lease.Lease]:
    """The run dir's lease when a launcher on a machine (cluster=local or debug) holds it, not a Slurm job."""
    held = lease.read(run_dir)
    return held if held is not None and held.by_launcher else None


def launcher_live(point: PointState) -> bool:
    """Whether a launcher here (cluster=local) still holds the point's run dir: its ranks may still be writing
    their logs after rank 0 wrote the result that makes the run final."""
    held = _local_lease(point.run_dir)
    return held is not None and lease.live(held)[0]


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


def scheduler_of(point: PointState) -> Scheduler:
    """The scheduler that knows the point's job id."""
    scheduler = backend_named(point.cluster)
    assert isinstance(scheduler, Scheduler), point.cluster  # read_submissions keeps schedulers' ids only
    return scheduler


def log_path(point: PointState, rank: int, *, err: bool = False) -> Optional[Path]:
    """Where rank `rank` of the point's current job writes its stdout (stderr: `err`): a queued job's file as
    its scheduler names it, or for a run here (cluster=local) the file of its last attempt, the submitit job
    (`<folder>/<id>_<rank>_log.out`) whose submission is the newest; None before a run here started one."""
    if point.job_id is not None and point.logs is not None:
        return scheduler_of(point).log_path(point.logs, point.job_id, rank, err=err)
    folder = point.run_dir / read_config(point.run_dir).cluster.folder
    submitted = [path for path in folder.glob("*_submitted.pkl") if path.name.split("_")[0].isdigit()]
    if not submitted:
        return None
    newest = max(submitted, key=lambda path: path.stat().st_mtime_ns)
    return folder / f"{newest.name.split('_')[0]}_{rank}_log.{'err' if err else 'out'}"


def by_scheduler(points: Sequence[PointState]) -> dict[str, list[PointState]]:
    """The points that have a job id, by the name of the scheduler that knows it."""
    groups: dict[str, list[PointState]] = {}
    for point in points:
        if point.job_id is not None:
            groups.setdefault(point.cluster, []).append(point)
    return groups


def refresh(points: list[PointState], timeout_s: float = 10.0) -> Optional[str]:
    """Fill in every point's state and finality; returns a warning when a scheduler could not be asked."""
    warnings = []
    for point in points:
        if point.job_id is None:  # a run here: its files say
            _from_files(point)
    for group in by_scheduler(points).values():
        scheduler = scheduler_of(group[0])
        try:
            states = scheduler.states([p.job_id for p in group if p.job_id], timeout_s)
        except GpujobsError as err:
            for point in group:
                _from_files(point)
            warnings.append(f"{err}: showing what the run dirs say")
            continue
        for point in group:
            state = states.get(point.job_id) if point.job_id else None
            if state is not None:
                point.state, point.final = state, state in scheduler.final_states
            elif point.cancelled:  # Slurm keeps no record of an array task cancelled while pending; a JobSet is gone
                point.state, point.final = scheduler.cancelled_state, True
            else:  # a job the scheduler does not list (yet, or any more)
                _from_files(point)
    return "; ".join(warnings) or None


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
    for group in by_scheduler(points).values():
        scheduler = scheduler_of(group[0])
        errors = scheduler.cancel([p.job_id for p in group if p.job_id])
        for point in group:
            assert point.job_id is not None  # by_scheduler keeps those that have one
            why = errors.get(point.job_id)
            if why is None:
                record_cancel(point.run_dir, point.job_id, cluster=point.cluster)
                outcome.cancelled.append(point.job_id)
            elif scheduler.already_ended(why):
                outcome.ended[point.job_id] = why
            else:
                outcome.failed[point.job_id] = why
    return outcome


def resubmit(sweep_dir: Path, points: list[PointState], *, cancelled: bool = False) -> list[Outcome]:
    """Start again the points that failed (and, if asked, were cancelled): Slurm points as one new array
    (a single run dir: one job again, as it was), JobSets one each, points that ran here (cluster=local or
    debug) here, one after another, as the sweep ran them (`sweep.run_here`).

    Each is checked first as every start is (preflight, `check_start`): one refused, nothing is queued
    or run. Each resumes from its run dir's last complete checkpoint, as every start does. Returns one
    outcome per point, in order: queued (its job id) or, for those run here, completed or failed.
    """
    from gpujobs.launch.sweep import ARRAY_FOLDER, SweepPlan, run_here, submit_arrays

    here_wanted = FAILED_HERE | ({"cancelled"} if cancelled else set())

    def wanted(point: PointState) -> bool:
        if point.job_id is None:  # never queued: it ran here, and only its files say how it ended
            return point.ended in here_wanted
        scheduler = scheduler_of(point)
        return point.state in scheduler.failed_states | ({scheduler.cancelled_state} if cancelled else set())

    chosen = [p for p in points if wanted(p)]
    plan = SweepPlan(sweep_dir.absolute(), single=bool(chosen) and chosen[0].num is None)
    for p in chosen:
        plan.add(read_config(p.run_dir), p.run_dir, p.num or 0, p.overrides)
    if chosen and chosen[0].num is None:  # a single run dir: one job again, as it was
        (point,) = plan.points
        if backend_for(point.job).queues:
            return [_submit_one(point)]
        from gpujobs.launch import start
        from gpujobs.launch.sweep import Outcome

        return [Outcome(point, start(point.job, point.run_dir))]
    arrays = [point for point in plan.points if backend_for(point.job).queues_arrays]
    each = [point for point in plan.points if backend_for(point.job).queues and point not in arrays]
    here = [point for point in plan.points if not backend_for(point.job).queues]
    outcomes = submit_arrays(arrays, sweep_dir.absolute() / ARRAY_FOLDER) if arrays else []
    outcomes += [_submit_one(point) for point in each]
    return outcomes + run_here(sweep_dir.absolute(), here)


def _submit_one(point: Point) -> Outcome:
    """Queue one checked point again (a single run dir, or a JobSet of a sweep); its outcome."""
    from gpujobs.launch.sweep import Outcome

    backend = backend_for(point.job)
    assert isinstance(backend, Scheduler)
    job_id = backend.submit(point.job, point.run_dir)
    print(f"gpujobs: submitted {backend.job_word} {job_id}; run dir {point.run_dir}", flush=True)
    return Outcome(point, 0, job_id=job_id)
