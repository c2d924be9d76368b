"""Submit side (torch-free): check a validated job against where it will run, then run or submit it."""

from __future__ import annotations

from pathlib import Path

from gpujobs.config import JobConfig
from gpujobs.launch.rundir import write_config


def preflight(job: JobConfig) -> None:
    """Refuse, with a ConfigError, what the chosen cluster cannot run; nothing is written before."""
    if job.cluster.name == "local":
        from gpujobs.launch.gpus import local_gpu_count
        from gpujobs.launch.local import check_local_resources

        check_local_resources(job, local_gpu_count())
    elif job.cluster.name == "slurm":
        from gpujobs.launch.preflight import preflight_slurm

        preflight_slurm(job)


def launch(job: JobConfig, run_dir: Path) -> int:
    """Preflight, write the run dir's config, then run or submit the job; returns the exit code."""
    preflight(job)
    write_config(run_dir, job)
    if job.cluster.name == "debug":
        from gpujobs.launch.debug import run_debug

        return run_debug(job, run_dir)
    if job.cluster.name == "slurm":
        from gpujobs.launch.payload import make_payload
        from gpujobs.launch.slurm import run_slurm

        return run_slurm(job, run_dir, make_payload(job, run_dir))
    from gpujobs.launch.local import run_local

    return run_local(job, run_dir)
