"""Sweeps (`-m`): validate every point first, then queue the Slurm points as job arrays (submit side).

How a sweep runs (the launcher is `hydra_plugins/gpujobs_launcher`, the default for `-m`):

1. **Plan.** The launcher runs each point's task function through Hydra's `run_job`, as Hydra's basic
   launcher does, so any Hydra app works with it (and Hydra's launcher test suites pass). Meanwhile a
   `SweepPlan` is active. gpujobs' own task (`gpujobs.submit`) sees it and, instead of running its
   point, validates it (`load_config` + preflight; Slurm is asked once for the whole sweep) and checks its
   run dir as a single run's is (`check_start`: checkpoints of another run, a live job's lease), and adds
   it to the plan. A bad point stops the sweep there with one error line and exit code 2: nothing has been
   written or queued yet, and a sweep dir run before keeps its sweep.json and its points' files. When
   only plain values are swept, the gpujobs sweeper (`hydra_plugins/gpujobs_launcher/gpujobs_sweeper.py`)
   composes the config once and hands the launcher every point's config derived from it, instead of
   Hydra composing each point twice; the task (marked `PLANS_SWEEP_POINTS`) plans each point the same way.
2. **Carry out.** The launcher then calls `run_plan`. Slurm points are grouped by their sbatch header
   (resources, partition, time, NCCL environment: an array shares one), each group is one job array
   (`--array=0-N%P`, P = `cluster.array_parallelism`), split where it would pass the cluster's
   MaxArraySize: one `sbatch` per array, never one per point. Points of other clusters (local, debug)
   run here one after another.

Each point keeps Hydra's sweep layout (`hydra.sweep.dir/hydra.sweep.subdir`) with its config.yaml, its
`submit.sbatch` (that point alone, for a hand resubmission) and `slurm_jobs.jsonl` (its job ids). The
array's own script, task logs and list of run dirs live in `SWEEP_DIR/submitit/`; `sweep.json` lists
the points for `python -m gpujobs status|logs|cancel|resubmit`. Array task `i` runs line `i` of the
list (`gpujobs.rank.srun --points`), building its payload from that run dir's config.yaml.

Slurm sweeps return once queued unless a point sets `cluster.wait=true`; then the launcher follows every
point and reports each as completed or failed (exit code 1 if any failed). `cluster.dry_run=true`
prints the array scripts and writes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpujobs.backends import backend_for
from gpujobs.base.atomic import fsync_batch, write_text_atomic
from gpujobs.base.errors import ConfigError, SubmitError
from gpujobs.config.load import JobConfig
from gpujobs.config.memory import MemoryPlan
from gpujobs.launch import check_start, preflight
from gpujobs.launch.sweep_file import read_sweep_file, unlist, write_sweep_file
from gpujobs.rundir import CONFIG_FILE, PLAN_FILE, SBATCH_FILE
from gpujobs.rundir.files import discard_if_empty, write_config
from gpujobs.rundir.plan import write_plan

#: Set (True) on a task function that, in a gpujobs sweep, only plans its point (`gpujobs.submit`'s): the
#: gpujobs sweeper may then derive the points' configs from one composition instead of composing each.
PLANS_SWEEP_POINTS = "gpujobs_plans_sweep_points"
ARRAY_FOLDER = "submitit"


@dataclass
class Point:
    """One validated point of a sweep."""

    num: int
    overrides: list[str]
    job: JobConfig
    run_dir: Path
    plan: Optional[MemoryPlan] = None
    """Its memory plan (plan.json), where its model can describe itself."""


@dataclass
class Outcome:
    """What became of one point: queued (job id), completed or failed."""

    point: Point
    code: int
    job_id: Optional[str] = None
    error: Optional[str] = None
    handle: Any = None
    """submitit's job of a queued point (to wait for it)."""


@dataclass
class SweepPlan:
    """The points of a sweep, validated, not yet started."""

    sweep_dir: Path
    points: list[Point] = field(default_factory=list)
    single: bool = False
    """A single run dir's plan (`resubmit` of one run dir): its point is the run dir, not a dir inside it."""
    _cluster_cache: dict[Any, Any] = field(default_factory=dict)
    _places: dict[Path, Point] = field(default_factory=dict)
    """The points' run dirs, resolved: to find a clash in O(depth), not by comparing with every point."""
    _around: dict[Path, Point] = field(default_factory=dict)
    """Every directory inside the sweep dir that holds a point's run dir, and one point it holds."""

    def add(self, job: JobConfig, run_dir: Path, num: int, overrides: list[str]) -> None:
        """Validate one point against where it will run (ConfigError/SubmitError if it cannot) and against
        its run dir, as a single run is (`check_start`: a rerun of the sweep with other values), and keep it."""
        place = None if self.single else self._check_place(run_dir, num)
        plan = preflight(job, self._cluster_cache)
        check_start(job, run_dir, "hydra.sweep.subdir")
        point = Point(num, list(overrides), job, run_dir, plan)
        self.points.append(point)
        if place is not None:
            self._places[place] = point
            for parent in place.parents:
                if parent == self._sweep_place:
                    break
                self._around.setdefault(parent, point)

    @functools.cached_property
    def _sweep_place(self) -> Path:
        """The sweep dir, resolved (once: every point is checked against it)."""
        return self.sweep_dir.resolve()

    def _check_place(self, run_dir: Path, num: int) -> Path:
        """Refuse a point whose run dir is not a dir of its own inside the sweep dir (ConfigError on
        hydra.sweep.subdir): on the sweep dir or outside it the point is no point of this sweep; sharing
        an earlier point's run dir (or lying inside it, or around it), two points would write one
        config.yaml on Slurm, and a local one would find the other's result and call itself completed; in
        the sweep's array folder (`ARRAY_FOLDER`), its files would lie among every task's. Returns the run
        dir, resolved."""
        sweep_dir, place = self._sweep_place, run_dir.resolve()
        wrong: Optional[str] = None
        if place == sweep_dir:
            wrong = f"point #{num} would run on the sweep dir itself"
        elif not place.is_relative_to(sweep_dir):
            wrong = f"point #{num} would run in {run_dir}, outside it"
        elif place.is_relative_to(sweep_dir / ARRAY_FOLDER):
            wrong = f"point #{num} would run in {run_dir}, among the array scripts, logs and pickles of the sweep"
        elif place in self._places:
            wrong = f"points #{self._places[place].num} and #{num} would both run in {run_dir}"
        else:
            other = self._around.get(place) or next((self._places[p] for p in place.parents if p in self._places), None)
            if other is not None:
                wrong = f"points #{other.num} and #{num} would nest their run dirs {other.run_dir} and {run_dir}"
        if wrong:
            subdir = os.path.relpath(os.path.abspath(run_dir), os.path.abspath(self.sweep_dir))  # as the user wrote it
            raise ConfigError("hydra.sweep.subdir", subdir, f"a dir per point inside the sweep dir {self.sweep_dir} "
                              f"(the default is ${{hydra.job.num}}): {wrong}")
        return place

    def check_together(self) -> None:
        """Refuse what the points cannot do side by side: Slurm may pack the points of a sweep onto one
        node, and there only one of them can listen on a fixed Prometheus port (the others would fail
        their attempts with `Address already in use`, again at every requeue)."""
        first: dict[int, Point] = {}
        for point in self.points:
            port = point.job.telemetry.prometheus_port
            if not backend_for(point.job).shares_nodes or not port:
                continue
            if port in first:
                raise ConfigError(
                    "telemetry.prometheus_port", port,
                    f"0 (a free port for each point, written to its prometheus.json and file_sd target) or a "
                    f"port per point in a Slurm sweep: points #{first[port].num} and #{point.num} may share a node",
                )
            first[port] = point

    def discard(self) -> None:
        """Remove the empty run dirs Hydra made for the points (the sweep was refused)."""
        for point in self.points:
            discard_if_empty(point.run_dir)
        discard_if_empty(self.sweep_dir / ARRAY_FOLDER)  # Hydra made it for a point refused for lying in it
        hydra_file = self.sweep_dir / "multirun.yaml"  # Hydra's sweeper wrote it before the launcher ran
        if self.sweep_dir.is_dir() and [entry.name for entry in self.sweep_dir.iterdir()] == [hydra_file.name]:
            hydra_file.unlink()
        discard_if_empty(self.sweep_dir)


_active: Optional[SweepPlan] = None


def active_plan() -> Optional[SweepPlan]:
    """The plan being collected by the gpujobs launcher, or None outside a gpujobs sweep."""
    return _active


@contextlib.contextmanager
def collecting(sweep_dir: Path) -> Iterator[SweepPlan]:
    """Make a plan active while the launcher runs the points' task functions.

    A sweep dir whose sweep.json is damaged is refused first (GpujobsError), before any point's run dir
    is made: the sweep would add its points to that file once they are planned.
    """
    global _active
    if _active is not None:
        raise RuntimeError("a gpujobs sweep is already being planned in this process")
    read_sweep_file(sweep_dir)
    _active = SweepPlan(sweep_dir)
    try:
        yield _active
    finally:
        _active = None


def array_spec(size: int, parallelism: Optional[int]) -> str:
    """`--array` value for indices 0..size-1, at most `parallelism` running at once."""
    spec = f"0-{size - 1}"
    return f"{spec}%{parallelism}" if parallelism else spec


def chunks(points: list[Point], limit: int) -> list[list[Point]]:
    """Split into arrays whose indices stay below the cluster's MaxArraySize (`limit`)."""
    return [points[start:start + limit] for start in range(0, len(points), limit)]


def header_groups(points: list[Point], folder: Path) -> list[list[Point]]:
    """Points that can share one array: the same sbatch header (flags and environment) and container step, in
    sweep order."""
    from gpujobs.backends.slurm.sbatch import sbatch_request

    groups: dict[Any, list[Point]] = {}
    for point in points:
        request = sbatch_request(point.job, folder, "", array="-")
        groups.setdefault((request.flags, request.env, request.container), []).append(point)
    return list(groups.values())


def array_executor(points: list[Point], folder: Path) -> tuple[Any, Path]:
    """The executor of one array over `points`, and the list file its tasks read their run dir from."""
    from gpujobs.backends.slurm.executor import GpujobsSlurmExecutor
    from gpujobs.backends.slurm.sbatch import job_command

    job = points[0].job
    # Named by its content: a dry run prints the name the real submission uses, and a later array
    # (resubmit) never rewrites the list an earlier array's pending tasks still read.
    listing = "".join(f"{p.run_dir}\n" for p in points)
    points_file = folder / f"points-{hashlib.sha256(listing.encode()).hexdigest()[:12]}.txt"
    command = job_command(folder, points=points_file)
    spec = array_spec(len(points), job.cluster.array_parallelism)
    return GpujobsSlurmExecutor(folder, job, command, array=spec), points_file


def submit_arrays(points: list[Point], folder: Path, *, dry_run: bool = False) -> list[Outcome]:
    """Queue `points` as few job arrays as the headers and MaxArraySize allow; one sbatch per array."""
    from gpujobs.backends.slurm.preflight import max_array_size

    limit = max_array_size()  # one `scontrol show config` for the whole sweep
    arrays = [chunk for group in header_groups(points, folder) for chunk in chunks(group, limit)]
    if dry_run:
        for chunk in arrays:
            print(array_executor(chunk, folder)[0].script(), end="")
        return []
    folder.mkdir(parents=True, exist_ok=True)
    queued: list[Outcome] = []
    for chunk in arrays:
        try:
            queued += _queue_array(chunk, folder)
        except SubmitError as err:
            raise ArrayRefused(str(err), queued, len(points)) from None
    return queued


class ArrayRefused(SubmitError):
    """sbatch refused an array of the sweep; `queued` are the points of the arrays it took before."""

    def __init__(self, why: str, queued: list[Outcome], total: int) -> None:
        if queued:
            why = f"{why}; {len(queued)} of {total} points were queued before it, the others were not"
        super().__init__(why)
        self.queued = queued


def _queue_array(points: list[Point], folder: Path) -> list[Outcome]:
    """Write the points' run dirs, queue them as one array, record each point's job id."""
    from gpujobs.backends.slurm.executor import keep_script
    from gpujobs.rundir.files import record_submission

    executor, points_file = array_executor(points, folder)
    written = [path for point in points for path in (point.run_dir / CONFIG_FILE, point.run_dir / SBATCH_FILE,
                                                           point.run_dir / PLAN_FILE)]
    new = [path for path in [*written, points_file] if not path.exists()]
    with fsync_batch() as batch:  # every file durable before sbatch, in one pass of fsyncs
        for point in points:
            write_config(point.run_dir, point.job, batch)
            if point.plan is not None:
                write_plan(point.run_dir, point.plan, batch)
            keep_script(point.run_dir, point.job, batch)
        write_text_atomic(points_file, "".join(f"{p.run_dir}\n" for p in points), batch)  # as named
    try:
        sjobs = executor.submit_script(len(points))
    except SubmitError:  # nothing of this array was queued: what it wrote goes (a resubmit's old files stay)
        for path in new:
            path.unlink(missing_ok=True)
        raise
    queued = [Outcome(point, 0, job_id=sjob.job_id, handle=sjob) for point, sjob in zip(points, sjobs, strict=True)]
    for outcome in queued:
        record_submission(outcome.point.run_dir, str(outcome.job_id), folder)
    print(f"gpujobs: submitted Slurm job array {sjobs[0].job_id.split('_')[0]} ({len(points)} points, "
          f"--array={executor.array}); sweep dir {folder.parent}", flush=True)
    return queued


def wait_for(outcomes: list[Outcome]) -> None:
    """Follow every queued point to its end; mark each completed (0) or failed (1) with why.

    submitit's watcher asks `sacct` once per poll for every job it knows, not once per point.
    """
    from gpujobs.backends.follow import failure_line, results
    from gpujobs.backends.slurm.jobs import SlurmEnd
    from gpujobs.backends.submitit_private import JOB_ENDED_WITHOUT_RESULT

    ends = {id(o): SlurmEnd(o.handle, ask_every_s=0) for o in outcomes if o.handle is not None}
    pending = [o for o in outcomes if o.handle is not None]
    while pending:
        for outcome in [o for o in pending if ends[id(o)].over()]:  # its ledger line is written by then
            pending.remove(outcome)
            try:
                results(outcome.handle, outcome.point.run_dir)
            except JOB_ENDED_WITHOUT_RESULT as err:
                outcome.code, outcome.error = 1, failure_line(err)
        if pending:
            time.sleep(1.0)


def run_plan(plan: SweepPlan) -> list[Outcome]:
    """Carry out a validated plan: Slurm points as job arrays, the others here, one after another. Points
    with `logger=mlflow` first get the sweep's parent run and a child run each
    (`gpujobs.trackers.sweep`)."""
    if any(p.job.cluster.dry_run for p in plan.points) or not any(p.job.logger.mlflow for p in plan.points):
        return _carry_out(plan)
    from gpujobs.trackers.sweep import SweepPoint, SweepRuns

    runs = SweepRuns.open(plan.sweep_dir, [SweepPoint(p.num, p.overrides, p.job, p.run_dir) for p in plan.points])
    try:
        outcomes = _carry_out(plan)
    except BaseException:
        runs.end(ok=False)
        raise
    runs.end(ok=not any(o.code for o in outcomes))
    return outcomes


def _carry_out(plan: SweepPlan) -> list[Outcome]:
    slurm = [p for p in plan.points if backend_for(p.job).queues_arrays]
    others = [p for p in plan.points if not backend_for(p.job).queues_arrays]  # JobSets: one submit each
    outcomes: list[Outcome] = []
    if slurm:
        dry_run = any(p.job.cluster.dry_run for p in slurm)
        folder = plan.sweep_dir.absolute() / ARRAY_FOLDER
        if not dry_run:
            write_sweep_file(plan.sweep_dir, slurm)
        try:
            queued = submit_arrays(slurm, folder, dry_run=dry_run)
        except ArrayRefused as refused:  # sweep.json keeps the points that were queued, and only those
            unlist(plan.sweep_dir, {p.num for p in slurm} - {o.point.num for o in refused.queued})
            if not refused.queued:
                discard_if_empty(folder)
            raise
        if dry_run:
            plan.discard()
            return [Outcome(p, 0) for p in slurm]
        if any(backend_for(p.job).follows(p.job) for p in slurm):
            wait_for(queued)
        outcomes += queued
    rendered = [p for p in others if p.job.cluster.dry_run]  # a backend that renders without queueing
    if rendered:  # one YAML document a point (cluster=kubernetes: a JobSet each, for one kubectl apply -f)
        try:  # a point refused (its run dir off the volume) leaves nothing either
            text = "---\n".join(backend_for(p.job).render(p.job, p.run_dir) for p in rendered)
        finally:
            plan.discard()
        print(text, end="", flush=True)
        return outcomes + [Outcome(p, 0) for p in rendered]
    return outcomes + run_here(plan.sweep_dir, others)


def run_here(sweep_dir: Path, points: list[Point]) -> list[Outcome]:
    """Run points of clusters without job arrays (local, debug) here, one after another (a sweep's, or
    those `gpujobs resubmit` brings back), or queue them one by one (kubernetes: a JobSet a point, each
    created as a single run's is); each point's outcome is its exit code."""
    from gpujobs.launch import start

    if points:  # `gpujobs status SWEEP_DIR` reads local points too, also while they run
        write_sweep_file(sweep_dir, points)
    outcomes = []
    for point in points:
        print(f"gpujobs: sweep point #{point.num}: {' '.join(point.overrides)}", flush=True)
        outcomes.append(Outcome(point, start(point.job, point.run_dir, point.plan)))
    return outcomes


def summary(outcomes: list[Outcome]) -> str:
    """One line per point that did not succeed, and a count of the rest."""
    failed = [o for o in outcomes if o.code]
    lines = [f"gpujobs: point #{o.point.num} ({' '.join(o.point.overrides)}) failed: {o.error or 'exit ' + str(o.code)}"
             for o in failed]
    lines.append(f"gpujobs: sweep: {len(outcomes) - len(failed)} of {len(outcomes)} points ok, {len(failed)} failed")
    return "\n".join(lines)
