"""`cluster=debug`: one rank, in this process, so pdb and breakpoints work."""

from __future__ import annotations

import os
from pathlib import Path

from gpujobs.config.load import JobConfig
from gpujobs.rank.main import FromRunDir

_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SUBMITIT_LOCAL_JOB_ID", "SLURM_JOB_ID")


def run_debug(job: JobConfig, run_dir: Path) -> int:
    """Run the job as a single rank here; exceptions propagate (to pdb, if you like)."""
    if job.resources.world_size > 1:
        print(f"gpujobs: cluster=debug runs 1 rank in-process (config asks for {job.resources.world_size})")
    for var in _DIST_VARS:  # one rank, whatever job we may be running inside
        os.environ.pop(var, None)
    result = FromRunDir(str(run_dir), show_progress=job.trainer.progress)()
    print(f"gpujobs: {result['status']} in {run_dir}")
    return 0
