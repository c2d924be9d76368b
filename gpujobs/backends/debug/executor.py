"""`cluster=debug`: one rank, in this process, so pdb and breakpoints work."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from gpujobs.config.load import JobConfig

#: What a rank runs, built from its run dir: named by a string and imported when the job starts, since the
#: ranks are a layer above the backends (and bring torch, which the submit side never imports before).
RANK_CALLABLE = ("gpujobs.rank.main", "FromRunDir")

_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SUBMITIT_LOCAL_JOB_ID", "SLURM_JOB_ID")


def run_debug(job: JobConfig, run_dir: Path) -> int:
    """Run the job as a single rank here; exceptions propagate (to pdb, if you like)."""
    if job.resources.world_size > 1:
        print(f"gpujobs: cluster=debug runs 1 rank in-process (config asks for {job.resources.world_size})")
    for var in _DIST_VARS:  # one rank, whatever job we may be running inside
        os.environ.pop(var, None)
    module, name = RANK_CALLABLE
    from_run_dir = getattr(importlib.import_module(module), name)
    result = from_run_dir(str(run_dir), show_progress=job.trainer.progress)()
    print(f"gpujobs: {result['status']} in {run_dir}")
    return 0
