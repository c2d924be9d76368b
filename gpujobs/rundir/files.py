"""The run directory: created by the launcher, shared by every attempt of the job."""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gpujobs.base.atomic import FsyncBatch, append_jsonl, read_jsonl, write_text_atomic
from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.config.hydra_private import omegaconf_str_representer
from gpujobs.config.load import JobConfig, load_config
from gpujobs.rundir import CONFIG_FILE, SUBMISSIONS_FILE


class _Dumper(getattr(yaml, "CDumper", yaml.Dumper)):  # type: ignore[misc]
    """OmegaConf's YAML dumper (quotes strings that would read back as bool or number), on libyaml if built."""


_Dumper.add_representer(str, omegaconf_str_representer())


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
    """The validated config that `write_config` saved in `run_dir`.

    It was written whole (atomically) and validated, so a file that cannot be read, is no YAML mapping,
    is empty or no longer validates was made or changed by hand (or by another gpujobs version): a
    GpujobsError naming the file says which, one line, instead of a traceback or a bare key error.
    """
    path = run_dir / CONFIG_FILE
    try:
        values = OmegaConf.load(path)
    except OSError as err:  # missing, a directory in its place, no permission
        raise GpujobsError(f"{path} cannot be read: {err.strerror}") from None
    except (yaml.YAMLError, ValueError, OmegaConfBaseException) as err:  # ValueError: not UTF-8
        raise GpujobsError(f"{path} is damaged: not YAML ({_first_problem(err)})") from None
    if not isinstance(values, DictConfig):
        raise GpujobsError(f"{path} is damaged: a YAML list, not the mapping of a config")
    if not values:
        raise GpujobsError(f"{path} is damaged: it is empty")
    try:
        return load_config(values)
    except ConfigError as err:
        raise GpujobsError(f"{path} is not a config this gpujobs can run: {err}") from None


def _first_problem(err: Exception) -> str:
    """A YAML error in one line: what is wrong, and where."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        return f"{err.problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(err).splitlines()[0] if str(err) else type(err).__name__


def discard_if_empty(run_dir: Path) -> None:
    """Remove a run dir that Hydra created for a config we then rejected (never another user's)."""
    with contextlib.suppress(OSError):  # not empty, or already gone: leave it
        if run_dir.stat().st_uid == os.geteuid():
            run_dir.rmdir()


@dataclass(frozen=True)
class Submission:
    """One line of `slurm_jobs.jsonl`: a job queued for the run dir (`logs` set), or a note that
    `gpujobs cancel` cancelled one (`cancelled` set)."""

    job_id: str
    logs: Optional[Path] = None
    """The job's log folder (its tasks' or pods' rank logs); None on a cancel note."""
    submitted: Optional[float] = None
    cancelled: Optional[float] = None
    cluster: str = "slurm"
    """The scheduler that knows `job_id` (the file is named for the first: a line without it, of an older
    gpujobs, is Slurm's)."""


#: The job ids of each scheduler as gpujobs records them. Slurm: `JOBID`, or `ARRAYID_TASK` for a task of a
#: job array. Kubernetes: `NAMESPACE/NAME` of a JobSet (two DNS-1123 labels).
_JOB_IDS = {"slurm": re.compile(r"^\d+(_\d+)?$"),
            "kubernetes": re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9]*[a-z0-9])?$")}


def record_submission(run_dir: Path, job_id: str, log_folder: Path, *, cluster: str = "slurm") -> None:
    """Append the job id that now runs `run_dir` (the last submission is the current one), known to `cluster`.

    Not fsynced: a sweep records hundreds at once, after the files the jobs need are durable; a line
    lost to a crash leaves a job that status cannot name, never a run dir that cannot run.
    """
    append_jsonl(run_dir / SUBMISSIONS_FILE, {"job_id": job_id, "logs": str(log_folder),
                                              "submitted": round(time.time(), 3), "cluster": cluster})


def record_cancel(run_dir: Path, job_id: str, *, cluster: str = "slurm") -> None:
    """Note that `gpujobs cancel` cancelled `job_id`: Slurm keeps no record of an array task cancelled
    while it was pending, and a cancelled JobSet is deleted, so without this note its state would be unknown."""
    append_jsonl(run_dir / SUBMISSIONS_FILE, {"job_id": job_id, "cancelled": round(time.time(), 3), "cluster": cluster})


def read_submissions(run_dir: Path) -> list[Submission]:
    """Every submission and cancel note of `run_dir`, oldest first (empty for local runs).

    Lines that are torn, garbage, or name no job id of their scheduler are skipped.
    """
    submissions = []
    for line in read_jsonl(run_dir / SUBMISSIONS_FILE):
        job_id, logs, cluster = line.get("job_id"), line.get("logs"), line.get("cluster", "slurm")
        pattern = _JOB_IDS.get(cluster) if isinstance(cluster, str) else None
        if not isinstance(job_id, str) or pattern is None or not pattern.match(job_id):
            continue
        submissions.append(Submission(
            job_id, Path(logs) if isinstance(logs, str) else None, _number(line.get("submitted")),
            _number(line.get("cancelled")), cluster,
        ))
    return submissions


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
