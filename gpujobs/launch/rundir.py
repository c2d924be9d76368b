"""The run directory: created by the launcher, shared by every attempt of the job."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from gpujobs.atomic import write_text_atomic
from gpujobs.config import JobConfig

CONFIG_FILE = "config.yaml"
#: One line per Slurm submission of the run dir: its job id and where its logs go (status, logs, cancel).
SUBMISSIONS_FILE = "slurm_jobs.jsonl"


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


def record_submission(run_dir: Path, job_id: str, log_folder: Path) -> None:
    """Append the job id that now runs `run_dir` (the last line is the current one)."""
    line = json.dumps({"job_id": job_id, "logs": str(log_folder), "submitted": round(time.time(), 3)})
    with open(run_dir / SUBMISSIONS_FILE, "a") as handle:
        handle.write(line + "\n")


def record_cancel(run_dir: Path, job_id: str) -> None:
    """Note that `gpujobs cancel` cancelled `job_id`: Slurm keeps no record of an array task cancelled
    while it was pending, so without this note its state would be unknown."""
    line = json.dumps({"job_id": job_id, "cancelled": round(time.time(), 3)})
    with open(run_dir / SUBMISSIONS_FILE, "a") as handle:
        handle.write(line + "\n")


def read_submissions(run_dir: Path) -> list[dict[str, Any]]:
    """Every Slurm submission of `run_dir`, oldest first (empty for local runs)."""
    path = run_dir / SUBMISSIONS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
