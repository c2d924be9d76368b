"""`cluster=slurm`: submitit's Slurm executor, with the script rendered from `sbatch_templates/`.

One task per rank (one per GPU, or a CPU rank with gloo where `gpus_per_node` is 0). Submission
returns as soon as the job is queued; `cluster.wait=true` follows it to its end.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import submitit

from gpujobs.config import JobConfig
from gpujobs.errors import SubmitError
from gpujobs.launch.sbatch import render_sbatch, sbatch_request

SBATCH_FILE = "submit.sbatch"


class GpujobsSlurmExecutor(submitit.SlurmExecutor):
    """submitit's executor whose submission file is `render_sbatch`'s text, not a second renderer."""

    def __init__(self, folder: Path, job: JobConfig) -> None:
        super().__init__(folder)
        self.job = job
        # submitit itself reads these: task count (results per rank) and time limit (timeouts)
        self.update_parameters(
            nodes=job.resources.nodes,
            ntasks_per_node=job.resources.ranks_per_node,
            time=job.cluster.timeout_min,
        )

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return render_sbatch(sbatch_request(self.job, self.folder, command))


def submit_slurm(job: JobConfig, run_dir: Path, payload: Any) -> Any:
    """Queue `payload` as the job; keep the exact script as `submit.sbatch`; return submitit's job."""
    executor = GpujobsSlurmExecutor(run_dir / job.cluster.folder, job)
    try:
        sjob = executor.submit(payload)
    except submitit.core.utils.FailedJobError as err:  # sbatch itself refused
        raise SubmitError(f"sbatch refused the job: {str(err).strip().splitlines()[-1]}") from None
    shutil.copyfile(sjob.paths.submission_file, run_dir / SBATCH_FILE)
    return sjob


def run_slurm(job: JobConfig, run_dir: Path, payload: Any) -> int:
    """Submit; with `cluster.wait`, follow to the end and return 0 only if the job completed."""
    sjob = submit_slurm(job, run_dir, payload)
    print(f"gpujobs: submitted Slurm job {sjob.job_id}; run dir {run_dir}", flush=True)
    if not job.cluster.should_wait:
        return 0
    from gpujobs.launch.follow import JobFollower  # rich: only paid when following

    with JobFollower(run_dir, job) as follower:
        error = follower.follow(sjob)
    if error is not None:
        print(f"gpujobs: job {sjob.job_id} failed: {error}\ngpujobs: per-rank logs in {run_dir / job.cluster.folder}")
        return 1
    return 0
