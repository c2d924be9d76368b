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
from typing import Optional

from gpujobs.errors import GpujobsError
from gpujobs.rundir import CONFIG_FILE
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.files import read_config, read_submissions, record_cancel
from gpujobs.rundir.records import read_result

#: States after which a job will not run again by itself.
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
#: States `resubmit --failed` brings back (CANCELLED only with --cancelled: cancelling was a choice).
FAILED = {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
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


def state_from_files(point: PointState) -> tuple[str, bool]:
    """What the run dir says without Slurm, and whether that is final.

    Final: result.json says completed, `gpujobs cancel` cancelled the current job, or the current job's
    last attempt says it will not be requeued. An attempt of an earlier job (the point was resubmitted
    since) says nothing about the current one.
    """
    result = read_result(point.run_dir)
    if result is not None and result.completed:
        return "completed (files)", True
    if point.cancelled:
        return "cancelled (files)", True
    attempts = AttemptLog(point.run_dir).read()
    if not attempts or attempts[-1].job_id != point.job_id:
        return "? (files)", False
    return f"{attempts[-1].reason} (files)", not attempts[-1].requeue


def refresh(points: list[PointState], timeout_s: float = 10.0) -> Optional[str]:
    """Fill in every point's state and finality; returns a warning when sacct could not be asked."""
    try:
        states = sacct_states([p.job_id for p in points if p.job_id], timeout_s)
    except SlurmCommandError as err:
        for point in points:
            point.state, point.final = state_from_files(point)
        return f"{err}: showing what the run dirs say"
    for point in points:
        state = sacct_state_of(point.job_id, states) if point.job_id else None
        if state is not None:
            point.state, point.final = state, state in FINAL
        elif point.cancelled:  # Slurm keeps no record of an array task cancelled while pending
            point.state, point.final = "CANCELLED", True
        else:  # a local run, or a job sacct does not list (yet)
            point.state, point.final = state_from_files(point)
    return None


def select(points: list[PointState], num: Optional[int]) -> list[PointState]:
    """All points, or the one numbered `num`."""
    if num is None:
        return points
    chosen = [p for p in points if p.num == num or (p.num is None and num == 0)]
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


def resubmit(sweep_dir: Path, points: list[PointState], *, cancelled: bool = False) -> list[PointState]:
    """Queue again, as one new array, the points that failed (and, if asked, were cancelled).

    Each resumes from its run dir's last complete checkpoint, as every start does. Returns those queued.
    """
    from gpujobs.launch.sweep import ARRAY_FOLDER, Point, submit_arrays

    wanted = FAILED | ({"CANCELLED"} if cancelled else set())
    chosen = [p for p in points if p.state in wanted]
    if not chosen:
        return []
    plan = [Point(p.num or 0, p.overrides, read_config(p.run_dir), p.run_dir) for p in chosen]
    if chosen[0].num is None:  # a single run dir: one job again, as it was
        from gpujobs.launch.slurm import submit_slurm

        sjob = submit_slurm(plan[0].job, plan[0].run_dir)
        print(f"gpujobs: submitted Slurm job {sjob.job_id}; run dir {plan[0].run_dir}", flush=True)
    else:
        submit_arrays(plan, sweep_dir.absolute() / ARRAY_FOLDER)
    return chosen
