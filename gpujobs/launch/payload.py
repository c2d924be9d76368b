"""What every rank runs: the gpujobs trainer, or the user's own torchrun-style script."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from gpujobs.config import JobConfig
from gpujobs.run.entry import TrainJob
from gpujobs.run.script import ScriptJob


def make_payload(job: JobConfig, run_dir: Path, master_port: Optional[int] = None) -> Union[TrainJob, ScriptJob]:
    """The picklable callable for `job` (torch-free to build: the ranks import torch, not us)."""
    if job.script is not None:
        return ScriptJob(job, str(run_dir), master_port)
    return TrainJob(job, str(run_dir), master_port)
