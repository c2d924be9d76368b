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

from gpujobs.backends.slurm.sbatch import render_sbatch, run_dir_script, sbatch_request
from gpujobs.backends.submitit_private import FailedJobError, RenderedSlurmExecutor
from gpujobs.base.atomic import FsyncBatch, write_text_atomic
from gpujobs.base.errors import SubmitError
from gpujobs.config.load import JobConfig
from gpujobs.rundir import SBATCH_FILE
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


def keep_script(run_dir: Path, job: JobConfig, batch: Optional[FsyncBatch] = None) -> None:
    """Write `submit.sbatch`: the script that runs this run dir alone, queued again by hand with sbatch.

    The text that a single submission of it queues (`run_dir_script`).
    """
    write_text_atomic(run_dir / SBATCH_FILE, run_dir_script(job, run_dir), batch)


def follow_slurm(job: JobConfig, run_dir: Path, job_id: str) -> int:
    """Show the queued job's progress until Slurm says it is over; 0 only if it completed."""
    from gpujobs.backends.follow import JobFollower  # rich: only paid when following
    from gpujobs.backends.slurm.jobs import SlurmEnd

    folder = run_dir / job.cluster.folder
    sjob: submitit.SlurmJob[Any] = submitit.SlurmJob(folder, job_id, tasks=list(range(job.resources.world_size)))
    with JobFollower(run_dir, job) as follower:
        error = follower.follow(sjob, over=SlurmEnd(sjob).over)  # till Slurm says so: the supervisor's line is written
        if error is None:
            follower.print_result()
            return 0
    print(f"gpujobs: job {job_id} {_ending(run_dir, job_id, error)}")
    print(f"gpujobs: per-rank logs in {folder}")
    return 1


def _ending(run_dir: Path, job_id: str, error: str) -> str:
    """How a followed job ended: its last ledger line's reason and why (srun's line only says that the
    ranks exited, 75 where the job chose not to go again), or srun's line where the job wrote none."""
    last = next((a for a in reversed(read_attempts(run_dir)) if a.job_id == job_id), None)
    if last is None or last.requeue or last.reason == "completed":  # not this ending's line
        return f"failed: {error}"
    return f"ended: {last.reason}, {last.why}" + (f"; last error: {last.error}" if last.error else "")
