"""Submit side (torch-free): check a validated job against where it will run, then run or submit it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from gpujobs.config import JobConfig
from gpujobs.errors import ConfigError
from gpujobs.launch.rundir import write_config


def _preflight_cluster(job: JobConfig, cache: Optional[dict[Any, Any]]) -> None:
    if job.cluster.name == "local":
        from gpujobs.launch.gpus import local_gpu_count
        from gpujobs.launch.local import check_local_resources

        check_local_resources(job, local_gpu_count())
    elif job.cluster.name == "slurm":
        from gpujobs.launch.preflight import preflight_slurm

        preflight_slurm(job, cache)


def preflight(job: JobConfig, cache: Optional[dict[Any, Any]] = None) -> None:
    """Refuse, with a ConfigError, what the chosen cluster cannot run; nothing is written before.

    `cache` keeps what the cluster said across the points of a sweep (see `preflight_slurm`).
    """
    if job.cluster.dry_run and job.cluster.name != "slurm":
        raise ConfigError("cluster.dry_run", True, "false unless cluster=slurm (a dry run prints the sbatch script)")
    _preflight_cluster(job, cache)


def launch(job: JobConfig, run_dir: Path) -> int:
    """Preflight, then start the job (or, for a dry run, print its script); returns the exit code."""
    preflight(job)
    if job.cluster.dry_run:
        from gpujobs.launch.rundir import discard_if_empty
        from gpujobs.launch.slurm import single_executor

        print(single_executor(job, run_dir).script(), end="")
        discard_if_empty(run_dir)  # a dry run leaves nothing behind, not even the empty run dir
        return 0
    return start(job, run_dir)


def start(job: JobConfig, run_dir: Path) -> int:
    """Write the run dir's config, then run or submit the already checked job; returns the exit code."""
    write_config(run_dir, job)
    if job.cluster.name == "debug":
        from gpujobs.launch.debug import run_debug

        return run_debug(job, run_dir)
    if job.cluster.name == "slurm":
        from gpujobs.launch.slurm import run_slurm

        return run_slurm(job, run_dir)
    from gpujobs.launch.local import run_local

    return run_local(job, run_dir)
