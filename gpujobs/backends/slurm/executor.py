"""`cluster=slurm`: submitit's Slurm executor, with the script rendered from `sbatch_templates/`.

One task per rank (one per GPU, or a CPU rank with gloo where `gpus_per_node` is 0). Submission
returns as soon as the job is queued; `cluster.wait=true` follows it to its end.

Nothing is pickled here: the script runs `gpujobs.rank.srun`, which builds each task's payload from
its run dir's config.yaml. A single job and a job array (a sweep) go through the same executor, so
there is one renderer: submitit's own array path (`map_array`, `batch()`) would copy a plain
`SlurmExecutor` and bypass it, which is why pickled submissions are refused (`RenderedSlurmExecutor`).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Optional

import submitit

from gpujobs.backends.slurm.sbatch import job_command, render_sbatch, sbatch_request
from gpujobs.backends.submitit_private import FailedJobError, RenderedSlurmExecutor, submission_file
from gpujobs.base.atomic import FsyncBatch, write_text_atomic
from gpujobs.base.errors import SubmitError
from gpujobs.config.load import JobConfig
from gpujobs.rundir import SBATCH_FILE, lease
from gpujobs.rundir.files import record_submission
from gpujobs.rundir.records import read_attempts


class GpujobsSlurmExecutor(RenderedSlurmExecutor):
    """submitit's executor whose submission file is `render_sbatch`'s text, not a second renderer."""

    def __init__(self, folder: Path, job: JobConfig, command: str, *, array: Optional[str] = None) -> None:
        super().__init__(folder)
        self.job = job
        self.command = command
        self.array = array
        # submitit itself reads these: task count (results per rank) and time limit (timeouts). An
        # elastic job's count is its most: `follow.results` reads only the ranks its last attempt ran.
        self.update_parameters(
            nodes=job.resources.nodes,
            ntasks_per_node=job.resources.ranks_per_node,
            time=job.cluster.timeout_min,
        )

    def script(self) -> str:
        """The exact text `sbatch` gets (also what a dry run prints)."""
        return render_sbatch(sbatch_request(self.job, self.folder, self.command, array=self.array))

    def submit_script(self, array_size: int = 1) -> list[submitit.SlurmJob[Any]]:
        """One `sbatch` of the script; with an array, one submitit job per array index (`A_i`)."""
        made = not self.folder.exists()
        self.folder.mkdir(parents=True, exist_ok=True)
        before = set(self.folder.iterdir())
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's refusal: said below, once
                first = self.submit_command(self.command)
        except FailedJobError as err:  # sbatch itself refused
            for leftover in set(self.folder.iterdir()) - before:  # submitit's script, named for the job it never got
                leftover.unlink(missing_ok=True)
            if made:
                with contextlib.suppress(OSError):
                    self.folder.rmdir()
            raise SubmitError(f"sbatch refused the job: {str(err).strip().splitlines()[-1]}") from None
        if self.array is None:
            return [first]  # type: ignore[list-item]
        tasks = list(range(self.num_tasks()))
        return [submitit.SlurmJob(self.folder, f"{first.job_id}_{i}", tasks=tasks) for i in range(array_size)]


def _single(job: JobConfig, run_dir: Path) -> tuple[Path, str]:
    folder = run_dir / job.cluster.folder
    return folder, job_command(folder, run_dir=run_dir)


def single_executor(job: JobConfig, run_dir: Path) -> GpujobsSlurmExecutor:
    """The executor of `run_dir` as one job (what `submit.sbatch` of every Slurm run dir holds)."""
    folder, command = _single(job, run_dir)
    return GpujobsSlurmExecutor(folder, job, command)


def keep_script(run_dir: Path, job: JobConfig, batch: Optional[FsyncBatch] = None) -> None:
    """Write `submit.sbatch`: the script that runs this run dir alone, queued again by hand with sbatch.

    The text `single_executor(job, run_dir).script()` gives, without building an executor per point.
    """
    folder, command = _single(job, run_dir)
    write_text_atomic(run_dir / SBATCH_FILE, render_sbatch(sbatch_request(job, folder, command)), batch)


def submit_slurm(job: JobConfig, run_dir: Path) -> Any:
    """Queue the run dir's job; keep the exact script as `submit.sbatch`; return submitit's job.

    The run dir's lease passes to the new job; LeaseHeld when another live job holds it.
    """
    lease.check_free(run_dir, lease.here())
    executor = single_executor(job, run_dir)
    sjob = executor.submit_script()[0]
    lease.replace(run_dir, lease.here(sjob.job_id))
    write_text_atomic(run_dir / SBATCH_FILE, submission_file(sjob).read_text())
    record_submission(run_dir, sjob.job_id, executor.folder)
    return sjob


def run_slurm(job: JobConfig, run_dir: Path) -> int:
    """Submit; with `cluster.wait`, follow to the end and return 0 only if the job completed."""
    sjob = submit_slurm(job, run_dir)
    print(f"gpujobs: submitted Slurm job {sjob.job_id}; run dir {run_dir}", flush=True)
    if not job.cluster.should_wait:
        return 0
    from gpujobs.launch.follow import JobFollower  # rich: only paid when following

    with JobFollower(run_dir, job) as follower:
        error = follower.follow(sjob)  # till Slurm says it is over: the supervisor's line is written
        if error is None:
            follower.print_result()
            return 0
    print(f"gpujobs: job {sjob.job_id} {_ending(run_dir, str(sjob.job_id), error)}")
    print(f"gpujobs: per-rank logs in {run_dir / job.cluster.folder}")
    return 1


def _ending(run_dir: Path, job_id: str, error: str) -> str:
    """How a followed job ended: its last ledger line's reason and why (srun's line only says that the
    ranks exited, 75 where the job chose not to go again), or srun's line where the job wrote none."""
    last = next((a for a in reversed(read_attempts(run_dir)) if a.job_id == job_id), None)
    if last is None or last.requeue or last.reason == "completed":  # not this ending's line
        return f"failed: {error}"
    return f"ended: {last.reason}, {last.why}" + (f"; last error: {last.error}" if last.error else "")
