"""Watch, cancel and repair submitted runs and sweeps (submit side, torch-free).

A run dir (config.yaml) or a sweep dir (sweep.json) is all these need: each Slurm run dir lists the job
ids that ran it (`slurm_jobs.jsonl`, the last is the current one). States come from ONE `sacct` call
for the whole sweep per poll, never one per job; when `sacct` is slow or fails, the table says so and
falls back to what the run dirs' files say.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpujobs.attempts import AttemptLog
from gpujobs.errors import GpujobsError
from gpujobs.launch.rundir import CONFIG_FILE, read_config, read_submissions, record_cancel
from gpujobs.run.entry import METRICS_FILE, RESULT_FILE

#: States after which a job will not run again by itself.
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
#: States `resubmit --failed` brings back (CANCELLED only with --cancelled: cancelling was a choice).
FAILED = {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
_ARRAY_RANGE = re.compile(r"^(\d+)_\[([0-9,\-]+)(?:%\d+)?\]$")


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
        queued = [line for line in submissions if "logs" in line]
        last = queued[-1] if queued else {}
        logs = Path(last["logs"]) if "logs" in last else None
        cancelled = any("cancelled" in line and line["job_id"] == last.get("job_id") for line in submissions)
        points.append(PointState(entry["num"], list(entry["overrides"]), run_dir, last.get("job_id"), logs, cancelled))
    return points


def parse_sacct(text: str) -> dict[str, str]:
    """`sacct -X -n -P -o JobID,State` lines to {job id: state}; pending array ranges are expanded."""
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


def sacct_states(job_ids: list[str], timeout_s: float) -> dict[str, str]:
    """States of every job in one `sacct` call. Raises GpujobsError when sacct fails or is too slow."""
    mains = sorted({job_id.split("_")[0] for job_id in job_ids})
    if not mains:
        return {}
    cmd = ["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", ",".join(mains)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise GpujobsError(f"sacct did not answer within {timeout_s:g} s") from None
    except OSError as err:
        raise GpujobsError(f"sacct could not run: {err}") from None
    if proc.returncode != 0:
        raise GpujobsError(f"sacct failed: {(proc.stderr or proc.stdout).strip() or proc.returncode}")
    return parse_sacct(proc.stdout)


def state_from_files(run_dir: Path) -> str:
    """What the run dir says without Slurm: completed, the last attempt's reason, or unknown."""
    result = _json(run_dir / RESULT_FILE)
    if result.get("status") == "completed":
        return "completed (files)"
    attempts = AttemptLog(run_dir).read()
    return f"{attempts[-1].get('reason', '?')} (files)" if attempts else "? (files)"


def refresh(points: list[PointState], timeout_s: float = 10.0) -> Optional[str]:
    """Fill in every point's state; returns a warning when sacct could not be asked."""
    try:
        states = sacct_states([p.job_id for p in points if p.job_id], timeout_s)
    except GpujobsError as err:
        for point in points:
            point.state = state_from_files(point.run_dir)
        return f"{err}: showing what the run dirs say"
    for point in points:
        if point.job_id is None:
            point.state = state_from_files(point.run_dir)
        else:  # no record: a task cancelled while pending, or one sacct does not list yet
            point.state = states.get(point.job_id) or ("CANCELLED" if point.cancelled else "?")
    return None


def _json(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def progress(run_dir: Path) -> tuple[str, str]:
    """(last step, last metric): the result's AUC when there is one, else the last logged loss."""
    result = _json(run_dir / RESULT_FILE)
    last: dict[str, Any] = {}
    path = run_dir / METRICS_FILE
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if line.endswith("}")]
        last = json.loads(lines[-1]) if lines else {}
    step = result.get("steps", last.get("step", ""))
    if "auc" in result:
        return str(step), f"auc={result['auc']:.4f}"
    metric = next((f"{key}={last[key]:.4f}" for key in ("auc", "loss") if key in last), "")
    return str(step), metric


def attempts_text(run_dir: Path) -> str:
    """How many attempts ran, and why the last one ended."""
    attempts = AttemptLog(run_dir).read()
    return f"{len(attempts)} ({attempts[-1].get('reason', '?')})" if attempts else "0"


def status_table(points: list[PointState]) -> Any:
    """A rich table: one row per point."""
    from rich.table import Table

    # Only what tells the points apart: overrides every point shares go in the title.
    shared = set.intersection(*(set(p.overrides) for p in points)) if len(points) > 1 else set()
    table = Table(title=" ".join(o for o in points[0].overrides if o in shared) or None)
    for column in ("point", "overrides", "job id", "state", "attempts", "step", "metric"):
        table.add_column(column, overflow="fold")
    for point in points:
        step, metric = progress(point.run_dir)
        own = [o for o in point.overrides if o not in shared]
        table.add_row(
            "-" if point.num is None else str(point.num), " ".join(own) or point.run_dir.name,
            point.job_id or "-", point.state, attempts_text(point.run_dir), step, metric,
        )
    return table


def select(points: list[PointState], num: Optional[int]) -> list[PointState]:
    """All points, or the one numbered `num`."""
    if num is None:
        return points
    chosen = [p for p in points if p.num == num or (p.num is None and num == 0)]
    if not chosen:
        raise GpujobsError(f"no point #{num}: points are {', '.join(str(p.num) for p in points)}")
    return chosen


def cancel(points: list[PointState]) -> list[str]:
    """`scancel` the current job of each point (one call); returns the ids cancelled."""
    ids = [p.job_id for p in points if p.job_id]
    if ids:
        proc = subprocess.run(["scancel", *ids], capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode != 0:
            raise GpujobsError(f"scancel failed: {proc.stderr.strip() or proc.returncode}")
    for point in points:
        if point.job_id:
            record_cancel(point.run_dir, point.job_id)
    return ids


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
