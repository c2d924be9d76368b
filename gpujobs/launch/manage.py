"""Watch, cancel and repair submitted runs and sweeps (submit side, torch-free).

A run dir (config.yaml) or a sweep dir (sweep.json) is all these need: each Slurm run dir lists the job
ids that ran it (`slurm_jobs.jsonl`, the last is the current one). States come from ONE `sacct` call
for the whole sweep per poll, never one per job; when `sacct` is slow or fails, the table says so and
falls back to what the run dirs' files say. Every JSON-lines file is read with `atomic.read_jsonl`, so a
torn or garbage line in any of them is skipped, never fatal.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from gpujobs.base.errors import GpujobsError
from gpujobs.rundir import CONFIG_FILE, lease
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.files import read_config, read_submissions, record_cancel
from gpujobs.rundir.records import Attempt, Result, read_result

if TYPE_CHECKING:
    from gpujobs.launch.sweep import Outcome

#: States after which a job will not run again by itself.
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
#: States `resubmit --failed` brings back (CANCELLED only with --cancelled: cancelling was a choice).
FAILED = {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
#: How a run that ran here (cluster=local or debug) ended, as its files say, that `resubmit --failed`
#: brings back: its last attempt's reason once no attempt follows, or `interrupted` (its launcher is gone).
FAILED_HERE = {"failed", "hung", "unhealthy", "timeout", "preempted", "interrupted"}
#: A pending (or never started) part of an array, as sacct lists it: `JOBID_[4-999]`, `JOBID_[1,3,5-7%2]`.
_ARRAY_RANGE = re.compile(r"^(\d+)_\[([0-9,\-]+)(?:%\d+)?\]$")
#: How `scancel -v` names an id it could not signal, and why.
_SCANCEL_ERROR = re.compile(r"error on job id (\S+): (.+)$", re.MULTILINE)
#: scancel's reasons for a job that had already ended (one purged after MinJobAge is "invalid").
_ALREADY_ENDED = ("already completing or completed", "Invalid job id specified")


class SlurmCommandError(GpujobsError):
    """A Slurm command (sacct, scancel) failed or did not answer: exit code 1, not bad input."""


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


def parse_sacct(text: str) -> dict[str, str]:
    """`sacct -X -n -P -o JobID,State` lines to {job id: state}; pending array ranges are expanded.

    An array that never started may also be one bare `JOBID` record (seen when its tasks were cancelled
    one by one before accounting listed them): `sacct_state_of` gives its state to every task.
    """
    states: dict[str, str] = {}
    for line in text.splitlines():
        if "|" not in line:
            continue
        job_id, state = line.split("|", 1)
        state = state.split()[0] if state.strip() else "?"  # "CANCELLED by 0" -> CANCELLED
        match = _ARRAY_RANGE.match(job_id)
        if match is None:
            states[job_id] = state
            continue
        for part in match.group(2).split(","):
            low, _, high = part.partition("-")
            for index in range(int(low), int(high or low) + 1):
                states[f"{match.group(1)}_{index}"] = state
    return states


def sacct_state_of(job_id: str, states: dict[str, str]) -> Optional[str]:
    """What `parse_sacct`'s `states` say of `job_id`, or None when sacct has no record of it.

    A task `JOBID_i` without a record of its own takes the state of a bare `JOBID` record: that
    record stands for the whole array (a started array lists its tasks as `JOBID_i`, never bare).
    """
    if job_id in states:
        return states[job_id]
    array, sep, _ = job_id.partition("_")
    return states.get(array) if sep else None


def sacct_states(job_ids: list[str], timeout_s: float) -> dict[str, str]:
    """States of every job in one `sacct` call. Raises SlurmCommandError when sacct fails or is too slow."""
    return parse_sacct(run_sacct(["-X", "-n", "-P", "-o", "JobID,State"], job_ids, timeout_s))


def run_sacct(options: list[str], job_ids: list[str], timeout_s: float, env: Optional[dict[str, str]] = None) -> str:
    """One `sacct OPTIONS -j ...` call over the jobs of `job_ids` (an array task's whole array); its
    output ("" without ids). `env` is added to this process's. Raises SlurmCommandError when sacct
    fails or is too slow."""
    mains = sorted({job_id.split("_")[0] for job_id in job_ids})
    if not mains:
        return ""
    cmd = ["sacct", *options, "-j", ",".join(mains)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                              env={**os.environ, **env} if env else None)
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(f"sacct did not answer within {timeout_s:g} s") from None
    except OSError as err:
        raise SlurmCommandError(f"sacct could not run: {err}") from None
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip().splitlines()  # its last line says why ("fatal: ...")
        raise SlurmCommandError(f"sacct failed: {said[-1] if said else proc.returncode}")
    return proc.stdout


def _local_lease(run_dir: Path) -> Optional[lease.Lease]:
    """The run dir's lease when a launcher on a machine (cluster=local or debug) holds it, not a Slurm job."""
    held = lease.read(run_dir)
    return held if held is not None and held.holder == "local" else None


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
    try:
        states = sacct_states([p.job_id for p in points if p.job_id], timeout_s)
    except SlurmCommandError as err:
        for point in points:
            _from_files(point)
        return f"{err}: showing what the run dirs say"
    for point in points:
        state = sacct_state_of(point.job_id, states) if point.job_id else None
        if state is not None:
            point.state, point.final = state, state in FINAL
        elif point.cancelled:  # Slurm keeps no record of an array task cancelled while pending
            point.state, point.final = "CANCELLED", True
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
    """`scancel` the current job of each point (one call); note each id it cancelled in its run dir.

    `scancel -v` names every id it could not signal, so the others are noted even when some fail
    (Slurm 22.05 exits 0 for ids that already ended, and 1 for other errors).
    """
    outcome = CancelOutcome()
    ids = [p.job_id for p in points if p.job_id]
    if not ids:
        return outcome
    try:
        proc = subprocess.run(["scancel", "-v", *ids], capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmCommandError("scancel did not answer within 30 s: nothing recorded as cancelled") from None
    except OSError as err:
        raise SlurmCommandError(f"scancel could not run: {err}") from None
    errors = {job_id: why.strip() for job_id, why in _SCANCEL_ERROR.findall(proc.stderr)}
    if proc.returncode != 0 and not errors:  # it named no id: it did not get as far as signalling any
        raise SlurmCommandError(f"scancel failed: {proc.stderr.strip() or proc.returncode}")
    for point in points:
        if point.job_id is None:
            continue
        why = errors.get(point.job_id)
        if why is None:
            record_cancel(point.run_dir, point.job_id)
            outcome.cancelled.append(point.job_id)
        elif any(words in why for words in _ALREADY_ENDED):
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

    slurm_wanted = FAILED | ({"CANCELLED"} if cancelled else set())
    here_wanted = FAILED_HERE | ({"cancelled"} if cancelled else set())
    # a point never queued to Slurm ran here: only its files say how it ended
    chosen = [p for p in points if (p.state in slurm_wanted if p.job_id else p.ended in here_wanted)]
    plan = SweepPlan(sweep_dir.absolute(), single=bool(chosen) and chosen[0].num is None)
    for p in chosen:
        plan.add(read_config(p.run_dir), p.run_dir, p.num or 0, p.overrides)
    slurm = [point for point in plan.points if point.job.cluster.name == "slurm"]
    here = [point for point in plan.points if point.job.cluster.name != "slurm"]
    if chosen and chosen[0].num is None:  # a single run dir: one job again, as it was
        (point,) = plan.points
        if slurm:
            from gpujobs.backends.slurm.executor import submit_slurm

            sjob = submit_slurm(point.job, point.run_dir)
            print(f"gpujobs: submitted Slurm job {sjob.job_id}; run dir {point.run_dir}", flush=True)
            return [Outcome(point, 0, job_id=sjob.job_id)]
        from gpujobs.launch import start

        return [Outcome(point, start(point.job, point.run_dir))]
    outcomes = submit_arrays(slurm, sweep_dir.absolute() / ARRAY_FOLDER) if slurm else []
    return outcomes + run_here(sweep_dir.absolute(), here)
