"""What every rank runs: the gpujobs trainer or the user's own script, built from the run dir's config.

Local, debug and Slurm runs all start the job side from the `config.yaml` that the submit side wrote
(`FromRunDir` here, which the local launcher names by a string: `gpujobs.attempt.program`;
`gpujobs.rank.srun` on Slurm), so the local tests exercise the path that Slurm runs and hand-run
`sbatch submit.sbatch` depend on. Building a payload is torch-free: the ranks import torch when they
run it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from gpujobs.attempt.orphan import watch_launcher
from gpujobs.attempt.preemption import catch_early
from gpujobs.base.nvml import CUDA_ORDER_ENV
from gpujobs.config.load import JobConfig
from gpujobs.rank.script import ScriptJob
from gpujobs.rank.train import TrainJob
from gpujobs.rundir.files import read_config
from gpujobs.rundir.trust import check_run_dir


def make_payload(
    job: JobConfig, run_dir: Path, master_port: Optional[int] = None, show_progress: bool = False
) -> Union[TrainJob, ScriptJob]:
    """The callable that runs `job` as one rank in `run_dir`."""
    if job.script is not None:
        return ScriptJob(job, str(run_dir), master_port)
    return TrainJob(job, str(run_dir), master_port, show_progress)


@dataclass
class FromRunDir:
    """A local or debug rank: reads the run dir's config.yaml in the rank, then runs it."""

    run_dir: str
    master_port: Optional[int] = None
    """Rendezvous port chosen by the launcher (Slurm jobs derive theirs from the job id)."""
    show_progress: bool = False
    """Draw progress in this process (the in-process debug executor)."""
    launcher: Optional[tuple[int, Optional[str]]] = None
    """The local launcher's pid and start time: the rank ends once it is gone (`gpujobs.attempt.orphan`)."""

    def __call__(self) -> dict[str, Any]:
        catch_early()  # before reading the config: a USR2 from now on is kept for the rank's watcher
        os.environ.update(CUDA_ORDER_ENV)  # before CUDA starts in this rank (the sbatch script exports it)
        if self.launcher is not None:
            watch_launcher(*self.launcher)
        check_run_dir(Path(self.run_dir))  # before this rank reads or writes anything in it
        job = read_config(Path(self.run_dir))
        return make_payload(job, Path(self.run_dir), self.master_port, self.show_progress)()
