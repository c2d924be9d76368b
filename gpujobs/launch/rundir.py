"""The run directory: created by the launcher, shared by every attempt of the job."""

from __future__ import annotations

import contextlib
from pathlib import Path

from omegaconf import OmegaConf

from gpujobs.atomic import write_text_atomic
from gpujobs.config import JobConfig

CONFIG_FILE = "config.yaml"


def write_config(run_dir: Path, job: JobConfig) -> Path:
    """Save the resolved, validated config atomically as `config.yaml`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    write_text_atomic(path, OmegaConf.to_yaml(job.to_dict()))
    return path


def discard_if_empty(run_dir: Path) -> None:
    """Remove a run dir that Hydra created for a config we then rejected."""
    with contextlib.suppress(OSError):  # not empty, or already gone: leave it
        run_dir.rmdir()
