"""The one interface of every place a job runs (torch-free): what the submit side, the supervisors and
the ranks may ask of it, instead of asking which cluster it is.

`Backend` is what every place implements: its properties (does it queue to a scheduler, does the rank
run in this process, may other jobs' ranks share its nodes) and its operations before and at the start
(preflight, render, start). `Scheduler` is a backend that queues jobs to a scheduler and so knows them
afterwards by id: submit, follow, states, cancel, logs, liveness, requeue, node exclusion, accounting.
A backend that runs the job here has no job ids: the run dir's files say how its runs went.
(submitit's executors and torchx's `Scheduler` are the models.) `gpujobs.backends.backend_for` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional, TypeVar

from gpujobs.base.errors import ConfigError
from gpujobs.config.load import JobConfig

#: Why `cluster.dry_run` is refused where no script is queued (a dry run prints the script).
NO_SCRIPT = "false unless cluster=slurm or cluster=kubernetes (a dry run prints the sbatch script or the JobSet)"
#: What a preflight may keep across the points of a sweep (what the cluster said, asked once).
PreflightCache = dict[Any, Any]
Answer = TypeVar("Answer")


def asked_once(cache: Optional[PreflightCache], key: Any, ask: Callable[[], Answer]) -> Answer:
    """What the cluster said under `key` at an earlier point of the sweep, else `ask()`'s answer, kept in
    `cache` for the points after (no cache: asked every time)."""
    if cache is not None and key in cache:
        return cache[key]
    answer = ask()
    if cache is not None:
        cache[key] = answer
    return answer


class Backend(ABC):
    """A place a job runs: `local`, `debug`, `slurm`."""

    name: ClassVar[str]
    """The `cluster=` value that picks it."""
    queues: ClassVar[bool] = False
    """It hands the job to a scheduler (a `Scheduler`): the job has an id, runs later, maybe requeued,
    and its lease passes from the submit process to the queued job."""
    in_process: ClassVar[bool] = False
    """The one rank runs in this process (for pdb): no supervisor beside it, so no hang watchdog."""
    shares_nodes: ClassVar[bool] = False
    """Ranks of other jobs (other points of a sweep) may run on its nodes at the same time, so a fixed
    port of one job's (Prometheus) may be taken by another's."""
    parses_paths: ClassVar[bool] = False
    """Run-dir paths reach the scheduler's parser (`#SBATCH` lines, log paths it expands): `%` and `\\`
    in them are refused at validation."""
    renders: ClassVar[bool] = False
    """It queues a script, which `render` gives and a dry run prints."""
    container_runtimes: ClassVar[frozenset[str]] = frozenset()
    """The `container=` runtimes its ranks run in (none is always run; another is refused at preflight)."""
    runs_images: ClassVar[bool] = False
    """It runs `container.image` itself, with no runtime picked (Kubernetes' kubelet); elsewhere an image
    without a runtime would be ignored, and is refused at preflight."""
    queues_arrays: ClassVar[bool] = False
    """A sweep's points are queued together as job arrays (`gpujobs.launch.sweep.submit_arrays`). A
    scheduler without arrays gets one `submit` a point; a backend that does not queue runs them here."""

    @abstractmethod
    def preflight(self, job: JobConfig, cache: Optional[PreflightCache] = None) -> None:
        """Refuse (ConfigError, SubmitError) what this place could never run, before anything is written or
        started. `cache` keeps what the place said across the points of a sweep."""

    def node_cpus(self, job: JobConfig, cache: Optional[PreflightCache] = None) -> Optional[int]:
        """The CPUs of a node this place may run `job` on, the fewest where they differ (None: unknown): what
        `resources.cpus_per_task: null` is derived from."""
        return None

    def render(self, job: JobConfig, run_dir: Path) -> str:
        """The exact text that is queued for `run_dir` (what a dry run prints). Only a backend that queues a
        script has one: the others refuse `cluster.dry_run` (also in `preflight`)."""
        raise ConfigError("cluster.dry_run", True, NO_SCRIPT)

    @abstractmethod
    def start(self, job: JobConfig, run_dir: Path) -> int:
        """Run the checked job (its lease taken, its config written), or queue it and, with
        `follows(job)`, follow it to its end; the exit code (0: completed, or queued and not followed).
        Raises SubmitError or ConfigError when refused before anything ran or was queued."""

    def follows(self, job: JobConfig) -> bool:
        """Whether a start stays with the job to its end: `cluster.wait`, by default only where the job
        runs here (a queued job may wait hours for its nodes)."""
        return job.cluster.wait if job.cluster.wait is not None else not self.queues


@dataclass(frozen=True)
class Allocation:
    """One instance of a queued job as the scheduler's accounting records it (`gpujobs cost`)."""

    job_id: str
    """`JOBID`, or `ARRAYID_TASK` for a task of a job array (as gpujobs records them)."""
    state: str
    """Its state: REQUEUED for every instance but a requeued job's last."""
    start: float
    end: float
    """Epoch seconds (the middle of Slurm's second); for an instance still running, start + elapsed so far."""
    elapsed_s: float
    gpus: int
    """GPUs of the allocation (0: none)."""
    cpus: int

    @property
    def unit(self) -> str:
        """What the allocation is counted in: `gpu` when it held GPUs, else `cpu`."""
        return "gpu" if self.gpus else "cpu"

    @property
    def units(self) -> int:
        """How many of `unit` it held (over all its nodes)."""
        return self.gpus or self.cpus


class Scheduler(Backend):
    """A backend that queues jobs to a scheduler and knows them by id afterwards.

    The operations that ask the scheduler raise `GpujobsError` subclasses (for Slurm: SlurmCommandError,
    whose message carries the command's last stderr line) when it cannot be asked; those that must not
    stop their caller (requeue, exclude) return that line instead, None once done.
    """

    queues = True
    final_states: ClassVar[frozenset[str]]
    """States after which a job will not run again by itself."""
    failed_states: ClassVar[frozenset[str]]
    """States `resubmit --failed` brings back."""
    cancelled_state: ClassVar[str]
    """The state of a job that was cancelled (`resubmit --cancelled` brings it back too)."""
    job_word: ClassVar[str]
    """What its jobs are called in a line: `Slurm job`, `JobSet`."""

    @abstractmethod
    def submit(self, job: JobConfig, run_dir: Path) -> str:
        """Queue the run dir's job (its lease passes to it; the script is kept in the run dir); its id."""

    @abstractmethod
    def follow(self, job: JobConfig, run_dir: Path, job_id: str) -> int:
        """Show the queued job's progress until the scheduler says it is over; 0 only if it completed."""

    @abstractmethod
    def states(self, job_ids: Sequence[str], timeout_s: float) -> dict[str, str]:
        """The state of every job of `job_ids` the scheduler has a record of, asked once for all."""

    @abstractmethod
    def cancel(self, job_ids: Sequence[str]) -> dict[str, str]:
        """Cancel the jobs (one call); the ids that could not be, with the scheduler's words."""

    def already_ended(self, why: str) -> bool:
        """Whether `cancel`'s words for an id say that the job had already ended (nothing to cancel)."""
        return False

    @abstractmethod
    def log_path(self, logs: Path, job_id: str, rank: int, *, err: bool = False) -> Path:
        """Where rank `rank` of job `job_id` writes its stdout (stderr: `err`), under the job's log folder."""

    @abstractmethod
    def liveness(self, job_id: str) -> tuple[bool, str]:
        """Whether the job may still run (a lease it holds is live), and what says so."""

    @abstractmethod
    def requeue(self, job_id: str) -> Optional[str]:
        """Requeue the job (this instance ends); None once done, else why not."""

    @abstractmethod
    def exclude(self, job_id: str, nodes: Sequence[str]) -> Optional[str]:
        """Keep the requeued job off `nodes` (its whole exclude list from now on); None once done, else why not."""

    @abstractmethod
    def queue_prepare(self, job: JobConfig, store: Path, logs: Path, tasks: int, at_once: Optional[int]) -> str:
        """Queue a store's prepare as ONE job array of `tasks` tasks, at most `at_once` running together (None:
        no limit), task i running `python -m gpujobs.data.array_task STORE --index i`, its logs in `logs`; the
        array's id."""

    @abstractmethod
    def allocations(self, job_ids: Sequence[str], timeout_s: float) -> dict[str, list[Allocation]]:
        """Every instance of every job of `job_ids` that held an allocation, oldest first (accounting)."""
