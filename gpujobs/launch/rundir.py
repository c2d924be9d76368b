"""The run directory: created by the launcher, shared by every attempt of the job."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf._utils import get_omega_conf_dumper

from gpujobs.atomic import FsyncBatch, write_text_atomic
from gpujobs.config import JobConfig, load_config

CONFIG_FILE = "config.yaml"
#: One line per Slurm submission of the run dir: its job id and where its logs go (status, logs, cancel).
SUBMISSIONS_FILE = "slurm_jobs.jsonl"


class _Dumper(getattr(yaml, "CDumper", yaml.Dumper)):  # type: ignore[misc]
    """OmegaConf's YAML dumper (quotes strings that would read back as bool or number), on libyaml if built."""


_Dumper.add_representer(str, get_omega_conf_dumper().str_representer)


def _plain(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return value is None or type(value) in (str, int, float, bool)


def config_yaml(values: dict[str, Any]) -> str:
    """`OmegaConf.to_yaml(values)`; plain values are dumped without building a DictConfig first.

    Building it is most of the cost, and a sweep writes one config per point, whose sections mostly
    repeat the other points': each top-level entry's text is dumped once per distinct value (a block
    mapping's text is its entries' texts, one after another). Anything else (an enum, a tuple, a path)
    takes OmegaConf's own conversion.
    """
    if not values or not _plain(values):
        return OmegaConf.to_yaml(values)
    return "".join(_entry_yaml(key, value) for key, value in values.items())


_entries: dict[tuple[str, str], str] = {}


def _entry_yaml(key: str, value: Any) -> str:
    """One top-level entry's YAML; kept by its `repr` (which tells 1, 1.0, True and "1" apart)."""
    memo = (key, repr(value))
    text = _entries.get(memo)
    if text is None:
        text = yaml.dump({key: value}, Dumper=_Dumper, default_flow_style=False, allow_unicode=True, sort_keys=False)
        if len(_entries) < 1024:
            _entries[memo] = text
    return text


def write_config(run_dir: Path, job: JobConfig, batch: Optional[FsyncBatch] = None) -> Path:
    """Save the resolved, validated config atomically as `config.yaml` (durable now, or with `batch`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    write_text_atomic(path, config_yaml(job.to_dict()), batch)
    return path


def read_config(run_dir: Path) -> JobConfig:
    """The validated config that `write_config` saved in `run_dir`."""
    return load_config(OmegaConf.load(run_dir / CONFIG_FILE))  # type: ignore[arg-type]


def discard_if_empty(run_dir: Path) -> None:
    """Remove a run dir that Hydra created for a config we then rejected."""
    with contextlib.suppress(OSError):  # not empty, or already gone: leave it
        run_dir.rmdir()


def record_submission(run_dir: Path, job_id: str, log_folder: Path) -> None:
    """Append the job id that now runs `run_dir` (the last line is the current one)."""
    _append_submission(run_dir, {"job_id": job_id, "logs": str(log_folder), "submitted": round(time.time(), 3)})


def record_cancel(run_dir: Path, job_id: str) -> None:
    """Note that `gpujobs cancel` cancelled `job_id`: Slurm keeps no record of an array task cancelled
    while it was pending, so without this note its state would be unknown."""
    _append_submission(run_dir, {"job_id": job_id, "cancelled": round(time.time(), 3)})


def _append_submission(run_dir: Path, record: dict[str, Any]) -> None:
    with open(run_dir / SUBMISSIONS_FILE, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def read_submissions(run_dir: Path) -> list[dict[str, Any]]:
    """Every Slurm submission of `run_dir`, oldest first (empty for local runs)."""
    path = run_dir / SUBMISSIONS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
