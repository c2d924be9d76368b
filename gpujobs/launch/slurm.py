"""`cluster=slurm`: submitit's Slurm executor, one task per GPU."""

from __future__ import annotations

from pathlib import Path

from gpujobs.config import JobConfig
from gpujobs.errors import SubmitError


def run_slurm(job: JobConfig, run_dir: Path) -> int:
    """Not built yet: the real Slurm executor is the next milestone."""
    raise SubmitError("cluster=slurm is not available yet in this version; use cluster=local or cluster=debug")
