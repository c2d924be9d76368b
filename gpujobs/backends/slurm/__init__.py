"""`cluster=slurm`: jobs queued with sbatch, known by their ids afterwards (a `Scheduler`).

The class only dispatches: the rendering is `sbatch.py`'s, the queueing `executor.py`'s, the checks
`preflight.py`'s, the jobs' states and accounting `sacct.py`'s, everything else asked of a queued job
`jobs.py`'s and node exclusion `quarantine.py`'s; every command runs through `commands.py`. Heavy
modules (submitit, jinja2) are imported by the operations that need them, not by this one.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from gpujobs.backends.base import Allocation, PreflightCache, Scheduler
from gpujobs.backends.slurm import control, jobs, preflight, quarantine, sacct
from gpujobs.backends.slurm.commands import SlurmCommandError
from gpujobs.backends.slurm.container_step import SLURM_RUNTIMES
from gpujobs.config.load import JobConfig

#: scancel's reasons for a job that had already ended (one purged after MinJobAge is "invalid").
_ALREADY_ENDED = ("already completing or completed", "Invalid job id specified")


class SlurmBackend(Scheduler):
    """Slurm, through its commands (sbatch, squeue, sacct, scontrol, scancel, sinfo, sacctmgr)."""

    name = "slurm"
    shares_nodes = True
    parses_paths = True
    renders = True
    container_runtimes = SLURM_RUNTIMES
    final_states = sacct.FINAL
    failed_states = sacct.FAILED
    cancelled_state = "CANCELLED"
    job_word = "Slurm job"
    queues_arrays = True

    def preflight(self, job: JobConfig, cache: Optional[PreflightCache] = None) -> None:
        preflight.preflight_slurm(job, cache)

    def node_cpus(self, job: JobConfig, cache: Optional[PreflightCache] = None) -> Optional[int]:
        if shutil.which("sbatch") is None:
            return None  # preflight says why, in one line
        return preflight.node_cpus(job, preflight.cluster_info(job, cache))

    def render(self, job: JobConfig, run_dir: Path) -> str:
        from gpujobs.backends.slurm.sbatch import run_dir_script

        return run_dir_script(job, run_dir)

    def start(self, job: JobConfig, run_dir: Path) -> int:
        job_id = self.submit(job, run_dir)
        print(f"gpujobs: submitted Slurm job {job_id}; run dir {run_dir}", flush=True)
        return self.follow(job, run_dir, job_id) if self.follows(job) else 0

    def submit(self, job: JobConfig, run_dir: Path) -> str:
        from gpujobs.backends.slurm.queue import queue_single  # sbatch alone: submitit's import is a tenth of a submit

        return queue_single(job, run_dir)

    def follow(self, job: JobConfig, run_dir: Path, job_id: str) -> int:
        from gpujobs.backends.slurm.executor import follow_slurm

        return follow_slurm(job, run_dir, job_id)

    def states(self, job_ids: Sequence[str], timeout_s: float) -> dict[str, str]:
        return sacct.job_states(job_ids, timeout_s)

    def cancel(self, job_ids: Sequence[str]) -> dict[str, str]:
        return jobs.cancel(job_ids)

    def already_ended(self, why: str) -> bool:
        return any(words in why for words in _ALREADY_ENDED)

    def log_path(self, logs: Path, job_id: str, rank: int, *, err: bool = False) -> Path:
        return logs / f"{job_id}_{rank}_log.{'err' if err else 'out'}"  # the script's --output/--error

    def liveness(self, job_id: str) -> tuple[bool, str]:
        return jobs.job_liveness(job_id)

    def requeue(self, job_id: str) -> Optional[str]:
        try:
            control.requeue(job_id)
        except SlurmCommandError as err:
            return str(err)
        return None

    def exclude(self, job_id: str, nodes: Sequence[str]) -> Optional[str]:
        return quarantine.exclude(job_id, nodes)

    def queue_prepare(self, job: JobConfig, store: Path, logs: Path, tasks: int, at_once: Optional[int]) -> str:
        from gpujobs.backends.slurm.prepare_array import queue_prepare

        return queue_prepare(job, store, logs, tasks, at_once)

    def allocations(self, job_ids: Sequence[str], timeout_s: float) -> dict[str, list[Allocation]]:
        return sacct.allocations(job_ids, timeout_s)
