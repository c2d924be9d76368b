"""`python -m gpujobs cost DIR [--json]`: where the GPU-hours of a run or a sweep went (torch-free).

**What was held.** Each point's allocations are its *segments*. A Slurm point's come from one
`sacct` call for every job of every point, each requeued instance its own segment (`cost_sacct`):
elapsed seconds x the GPUs it held (`gres/gpu`), or x its CPUs when it held none. A local point's are
its attempts in `attempts.jsonl`: start..end x the attempt's world size x 1 GPU per rank (CPU ranks:
x `resources.cpus_per_task`). Hours are these unit-seconds / 3600, in GPU-hours or CPU-hours.

**Where it went.** Each part is measured from its own records, not from what is left over, so the
parts add up to what was held only when the bookkeeping is right; what they miss is `unaccounted`:

- `training`: steps that counted, each logged window's steps x rank 0's mean step time there
  (metrics.jsonl), steps trained after the last logged window x the last window's step time.
- `redone`: the same, for steps an attempt trained past the checkpoint the next one resumed from.
- `checkpoint`: the time saves blocked training (`blocking_s` of each checkpoint record).
- `eval`: evaluations: an eval record's time less that of the record of the same step before it.
- `startup`: rank 0's attempt start to its first training step (`trained_from`), less `health`:
  imports, the process group, the restore.
- `health`: the health check at start (`health_s`).
- `hung`: from the last progress to the watchdog's kill (`hung_s`).
- `stopping`: from the attempt's last record to its end, less `hung` and unlogged steps: the stop
  agreement, a failure's detection, the final result.
- `launch` (Slurm): allocation start to rank 0's attempt start: batch script, supervisor, srun.
- `teardown` (Slurm): the attempt's end to the allocation's: exit, process-group teardown, epilog.
  Slurm's times are whole seconds, so up to a second can move between `launch` and `teardown`.
- `unaccounted`: held less all of the above (the loop's own overhead: log gathers, stop checks;
  anything the records miss). A few percent at most when the ledger is whole.

**JSON** (`--json`; keys are stable; parts in unit-seconds, i.e. GPU- or CPU-seconds)::

    {"dir": str, "points": [POINT...], "totals": [TOTAL...]}     one TOTAL per unit present
    POINT   {"point": int | null, "run_dir": str, "source": "sacct" | "attempts" | "sacct+attempts" |
             "none", "unit": "gpu" | "cpu" | "mixed" | null, "seconds": float, "hours": float,
             "parts": PARTS, "steps": STEPS, "segments": [SEGMENT...], "notes": [str...]}
    SEGMENT {"source": "sacct" | "attempts", "job_id": str | null, "attempt": int | null,
             "state": str, "start": float, "end": float, "unit": "gpu" | "cpu", "units": int,
             "seconds": float, "parts": PARTS, "steps": STEPS}
    TOTAL   {"unit": "gpu" | "cpu", "seconds": float, "hours": float, "parts": PARTS, "steps": STEPS}
    PARTS   {"training", "redone", "checkpoint", "eval", "startup", "health", "hung", "stopping",
             "launch", "teardown", "unaccounted": float}
    STEPS   {"counted": int, "redone": int}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpujobs.backends import Scheduler, backend_named
from gpujobs.backends.base import Allocation
from gpujobs.launch.manage import PointState
from gpujobs.rundir import ATTEMPTS_FILE
from gpujobs.rundir.files import read_config, read_submissions
from gpujobs.rundir.records import (
    Attempt,
    CheckpointRecord,
    EvalRecord,
    HealthRecord,
    MetricsRecord,
    PlanRecord,
    TrainRecord,
    read_ledger,
    read_metrics,
)

#: The measured parts, in the order the table and the JSON give them; `unaccounted` follows.
PARTS = ("training", "redone", "checkpoint", "eval", "startup", "health", "hung", "stopping", "launch", "teardown")
UNACCOUNTED = "unaccounted"
POINT_KEYS = ("point", "run_dir", "source", "unit", "seconds", "hours", "parts", "steps", "segments", "notes")
SEGMENT_KEYS = ("source", "job_id", "attempt", "state", "start", "end", "unit", "units", "seconds", "parts", "steps")
TOTAL_KEYS = ("unit", "seconds", "hours", "parts", "steps")
#: An attempt belongs to the instance of its job that ran when it started (Slurm's whole seconds, clocks).
_MATCH_SLACK_S = 2.0
#: The metrics records that belong to a step.
_STEPPED = (TrainRecord, EvalRecord, PlanRecord, CheckpointRecord)


@dataclass
class Segment:
    """One allocation of a point: a Slurm job instance (sacct) or a local attempt (attempts.jsonl)."""

    source: str
    job_id: Optional[str]
    start: float
    end: float
    held_s: float
    """Wall seconds held (sacct's elapsed; a local attempt's end - start)."""
    unit: str
    units: int
    state: str
    attempt: Optional[Attempt]
    wall: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    """Each part, in wall seconds."""
    counted: int = 0
    redone: int = 0

    @property
    def seconds(self) -> float:
        """Unit-seconds held."""
        return self.held_s * self.units

    def parts(self) -> dict[str, float]:
        """Each part in unit-seconds, `unaccounted` last."""
        parts = {name: self.wall[name] * self.units for name in PARTS}
        return {**parts, UNACCOUNTED: self.seconds - sum(parts.values())}


@dataclass
class PointCost:
    """What one point held, segment by segment, and anything the ledger could not say."""

    point: PointState
    segments: list[Segment]
    notes: list[str]

    @property
    def source(self) -> str:
        """Where its segments came from: sacct, attempts, sacct+attempts or none."""
        return "+".join(s for s in ("sacct", "attempts") if any(g.source == s for g in self.segments)) or "none"

    @property
    def unit(self) -> Optional[str]:
        """gpu or cpu (mixed when its segments differ; None without any)."""
        units = {s.unit for s in self.segments}
        return units.pop() if len(units) == 1 else ("mixed" if units else None)


def queued_jobs(run_dir: Path) -> dict[str, str]:
    """Every job queued for `run_dir` (resubmissions too), oldest first: id -> the scheduler that knows it."""
    ids: dict[str, str] = {}
    for line in read_submissions(run_dir):
        if line.logs is not None:
            ids.setdefault(line.job_id, line.cluster)
    return ids


def cost_of(points: list[PointState], timeout_s: float = 10.0) -> list[PointCost]:
    """The cost of every point, from one sacct call for all their Slurm jobs and their run dirs' records.

    Raises SlurmCommandError when a point has Slurm jobs and sacct cannot be asked.
    """
    by_scheduler: dict[str, list[str]] = {}
    for point in points:
        for job_id, cluster in queued_jobs(point.run_dir).items():
            by_scheduler.setdefault(cluster, []).append(job_id)
    held: dict[str, list[Allocation]] = {}
    for cluster, job_ids in sorted(by_scheduler.items()):  # a JobSet's scheduler keeps no accounting: none
        scheduler = backend_named(cluster)
        assert isinstance(scheduler, Scheduler), cluster  # read_submissions keeps schedulers' ids only
        held.update(scheduler.allocations(job_ids, timeout_s))
    return [_point_cost(point, held) for point in points]


def _point_cost(point: PointState, held: dict[str, list[Allocation]]) -> PointCost:
    attempts, unreadable = read_ledger(point.run_dir)
    records = sorted(read_metrics(point.run_dir), key=lambda r: r.time)
    notes: list[str] = []
    if unreadable:
        notes.append(f"{ATTEMPTS_FILE}: {unreadable} line{'s are' if unreadable > 1 else ' is'} no attempt (a field "
                     "missing or of the wrong type): not counted")
    matched: set[int] = set()
    segments = []
    for job_id, cluster in queued_jobs(point.run_dir).items():
        if not held.get(job_id):
            word = getattr(backend_named(cluster), "job_word", "job")
            notes.append(f"{word} {job_id} has no allocation on record (pending, never started, or its scheduler "
                         "keeps no accounting: Kubernetes)")
        for alloc in held.get(job_id, []):
            attempt = _attempt_of(attempts, matched, alloc)
            segments.append(Segment("sacct", job_id, alloc.start, alloc.end, alloc.elapsed_s, alloc.unit, alloc.units,
                                    alloc.state, attempt))
    segments += _local_segments(point.run_dir, [a for a in attempts if a.job_id is None], records, notes)
    for attempt in attempts:
        if attempt.job_id is not None and attempt.attempt not in matched:
            notes.append(f"attempt {attempt.attempt} (job {attempt.job_id}) is in no allocation of the point's "
                         "Slurm jobs: not counted")
    segments.sort(key=lambda s: s.start)
    windows = [_window(s, records) for s in segments]
    resumes = [_resume_step(s, own, records) for s, own in zip(segments, windows, strict=True)]
    for i, (segment, own) in enumerate(zip(segments, windows, strict=True)):
        _measure(segment, own, resumes[i], resumes[i + 1] if i + 1 < len(resumes) else None, notes)
    return PointCost(point, segments, notes)


def _attempt_of(attempts: list[Attempt], matched: set[int], alloc: Allocation) -> Optional[Attempt]:
    """The attempt that ran in `alloc`: of its job, started (or, unstarted, ended) within it."""
    for attempt in attempts:
        when = attempt.start if attempt.start is not None else attempt.end
        inside = alloc.start - _MATCH_SLACK_S <= when <= alloc.end + _MATCH_SLACK_S
        if attempt.job_id == alloc.job_id and attempt.attempt not in matched and inside:
            matched.add(attempt.attempt)
            return attempt
    return None


def _local_segments(
    run_dir: Path, local: list[Attempt], records: list[MetricsRecord], notes: list[str]
) -> list[Segment]:
    """A local run's attempts as segments: start..end x world size x GPUs (or CPUs) per rank."""
    if not local:
        return []
    res = read_config(run_dir).resources
    segments, previous_end = [], None
    for attempt in local:
        # as it ran (a resume may change the placement); an older line says nothing: the config's
        if attempt.unit is not None and attempt.per_rank is not None:
            unit, per_rank = attempt.unit, attempt.per_rank
        else:
            unit, per_rank = str(res.held_per_rank["unit"]), int(res.held_per_rank["per_rank"])
        start = attempt.start
        if start is None:  # rank 0 died before it could say; the launcher restarts at once
            start = previous_end if previous_end is not None else min((r.time for r in records), default=attempt.end)
            notes.append(f"attempt {attempt.attempt}: no start recorded (rank 0 died), counted from "
                         f"{'the previous attempt' if previous_end is not None else 'its first metrics record'}")
        world = attempt.world_size
        if world is None:
            world = res.world_size
            notes.append(f"attempt {attempt.attempt}: no world size recorded, counted as the config's {world}")
        held_s = attempt.end - start
        if held_s < 0:  # a clock set back between start and end, or a line edited by hand
            notes.append(f"attempt {attempt.attempt}: ends {-held_s:.3f} s before it starts: counted as 0 s")
            held_s = 0.0
        segments.append(Segment("attempts", None, start, attempt.end, held_s, unit, world * per_rank,
                                attempt.reason, attempt))
        previous_end = attempt.end
    return segments


def _window(segment: Segment, records: list[MetricsRecord]) -> list[MetricsRecord]:
    """The metrics records written during the segment's attempt (or the segment, without one)."""
    attempt = segment.attempt
    low = attempt.start if attempt is not None and attempt.start is not None else segment.start
    high = attempt.end if attempt is not None else segment.end + 1.0  # Slurm's End is truncated to seconds
    return [r for r in records if low - 1e-3 <= r.time <= high + 1e-3]


def _resume_step(segment: Segment, own: list[MetricsRecord], records: list[MetricsRecord]) -> int:
    """The step the segment's training began from: its attempt's start step, else its first plan
    record's, else the newest checkpoint saved before it (what a resume picks), else 0."""
    if segment.attempt is not None and segment.attempt.start_step is not None:
        return segment.attempt.start_step
    plans = [r.step for r in own if isinstance(r, PlanRecord)]
    if plans:
        return plans[0]
    began = own[0].time if own else segment.start
    saved = [r.step for r in records if isinstance(r, CheckpointRecord) and r.time < began]
    return saved[-1] if saved else 0


def _measure(segment: Segment, own: list[MetricsRecord], resume: int, next_resume: Optional[int],
             notes: list[str]) -> None:
    """Fill the segment's parts (wall seconds) and step counts from its attempt and its records."""
    wall, attempt = segment.wall, segment.attempt
    label = f"attempt {attempt.attempt}" if attempt is not None else f"job {segment.job_id} from {segment.start:.0f}"
    if attempt is not None and attempt.end < (attempt.start if attempt.start is not None else segment.start):
        # no record can be placed in a span that ends before it begins: nothing is measured in it
        if segment.source == "sacct":  # (a local one was noted as counted 0 s)
            notes.append(f"{label}: ends before it starts: its parts are not measured")
        return
    reached, step_s, first_window = resume, None, None
    for record in own:
        if not isinstance(record, TrainRecord) or not record.step_time_s or record.step <= reached:
            continue
        step_s = record.step_time_s[0]  # rank 0's: its timestamps frame the attempt
        _count_steps(segment, reached, record.step, step_s, next_resume)
        if first_window is None:
            first_window = record.time - (record.step - reached) * step_s
        reached = record.step
    unlogged_s = 0.0
    if attempt is not None and attempt.steps_done is not None and attempt.steps_done > reached:
        if step_s is None:
            notes.append(f"{label}: {attempt.steps_done - reached} steps with no logged window: their time is "
                         "not measured")
        else:
            unlogged_s = _count_steps(segment, reached, attempt.steps_done, step_s, next_resume)
    wall["checkpoint"] = sum(r.blocking_s for r in own if isinstance(r, CheckpointRecord))
    evals = _eval_seconds(own)
    wall["eval"] = sum(seconds for _, seconds in evals if seconds is not None)
    unmeasured = sum(1 for _, seconds in evals if seconds is None)
    if unmeasured:
        notes.append(f"{label}: {unmeasured} evaluations at steps with no record before them: not measured")
    if attempt is None:
        notes.append(f"{label}: no attempt recorded ({segment.state}): only its records are measured")
        return
    # the attempt's own health_s, else that of the health record rank 0 wrote before training
    checked = [r.health_s for r in own if isinstance(r, HealthRecord)]
    wall["health"] = attempt.health_s if attempt.health_s is not None else sum(checked)
    wall["hung"] = attempt.hung_s or 0.0
    began = attempt.trained_from
    if began is None and first_window is not None:
        began = first_window
        notes.append(f"{label}: no trained_from recorded: training taken to begin with its first logged window")
    start = attempt.start
    if start is None:
        start = segment.start
        notes.append(f"{label}: no start recorded: what came before training is counted as start-up")
    elif segment.source == "sacct":
        wall["launch"] = start - segment.start
    wall["startup"] = (began if began is not None else attempt.end) - start - wall["health"]
    if began is not None:
        # after the last logged window: the unlogged steps, saves and evals (measured), then the stop
        anchor = max((r.time for r in own if isinstance(r, TrainRecord) and r.time >= began), default=began)
        measured = unlogged_s + sum(seconds or 0.0 for r, seconds in evals if r.time > anchor)
        measured += sum(r.blocking_s for r in own if isinstance(r, CheckpointRecord) and r.time > anchor)
        wall["stopping"] = attempt.end - wall["hung"] - anchor - measured
    if segment.source == "sacct":
        wall["teardown"] = segment.end - attempt.end


def _count_steps(segment: Segment, after: int, upto: int, step_s: float, next_resume: Optional[int]) -> float:
    """Steps `after`+1..`upto` at `step_s` each: redone past `next_resume`, else counted; their seconds."""
    steps = upto - after
    again = max(0, upto - max(after, next_resume)) if next_resume is not None else 0
    segment.counted += steps - again
    segment.redone += again
    segment.wall["training"] += (steps - again) * step_s
    segment.wall["redone"] += again * step_s
    return steps * step_s


def _eval_seconds(own: list[MetricsRecord]) -> list[tuple[EvalRecord, Optional[float]]]:
    """Each evaluation among `own` and its seconds (None: not measurable).

    An eval record is written when its evaluation ends; the record before it of the same step (the
    step's train, plan or checkpoint record), when it began.
    """
    found: list[tuple[EvalRecord, Optional[float]]] = []
    for at, record in enumerate(own):
        if isinstance(record, EvalRecord):
            before = own[at - 1] if at else None
            same_step = isinstance(before, _STEPPED) and before.step == record.step
            found.append((record, record.time - before.time if before is not None and same_step else None))
    return found


# ------------------------------------------------------------------ output


def _sum(items: list[Segment]) -> dict[str, Any]:
    parts = dict.fromkeys((*PARTS, UNACCOUNTED), 0.0)
    for segment in items:
        for name, value in segment.parts().items():
            parts[name] += value
    seconds = sum(s.seconds for s in items)
    return {"seconds": round(seconds, 3), "hours": round(seconds / 3600, 6),
            "parts": {name: round(value, 3) for name, value in parts.items()},
            "steps": {"counted": sum(s.counted for s in items), "redone": sum(s.redone for s in items)}}


def to_json(directory: Path, costs: list[PointCost]) -> dict[str, Any]:
    """The `--json` document (keys as the module docstring lists them)."""
    points = []
    for cost in costs:
        segments = [{
            "source": s.source, "job_id": s.job_id, "attempt": s.attempt.attempt if s.attempt else None,
            "state": s.state, "start": s.start, "end": s.end, "unit": s.unit, "units": s.units,
            **{key: value for key, value in _sum([s]).items() if key != "hours"},
        } for s in cost.segments]
        points.append({"point": cost.point.num, "run_dir": str(cost.point.run_dir), "source": cost.source,
                       "unit": cost.unit, **_sum(cost.segments), "segments": segments, "notes": cost.notes})
    units = sorted({s.unit for c in costs for s in c.segments})
    totals = [{"unit": unit, **_sum([s for c in costs for s in c.segments if s.unit == unit])} for unit in units]
    return {"dir": str(directory), "points": points, "totals": totals}
