"""A store's prepare queued as one Slurm job array: one task per shard that needs work (torch-free).

The array runs `gpujobs.data.array_task` (named by its module path: the data layer's entry point, run by
Slurm), on one CPU task each, with the job's placement (partition, account, qos, constraint, exclude),
time limit and per-task CPUs, and `data.prepare_workers` as the most tasks running at once. The tasks'
logs go to the store's `.prepare/logs/`. The script is rendered from `sbatch_templates/prepare.sbatch.j2`
and sent through the one Slurm command runner.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

from gpujobs.backends.slurm.queue import sbatch_parsable
from gpujobs.backends.slurm.sbatch import placement_flags, template
from gpujobs.config.load import JobConfig
from gpujobs.config.validate import check_slurm_path

PREPARE_TEMPLATE = "prepare.sbatch.j2"
#: The module each task runs (a string: the data layer's entry point, started by Slurm, not imported here).
TASK_MODULE = "gpujobs.data.array_task"


def prepare_flags(job: JobConfig, logs: Path, tasks: int, at_once: Optional[int]) -> list[tuple[str, Optional[str]]]:
    """The #SBATCH flags of the array: `tasks` tasks, at most `at_once` running together."""
    cluster, res = job.cluster, job.resources
    array = f"0-{tasks - 1}" + (f"%{at_once}" if at_once else "")
    flags: list[tuple[str, Optional[str]]] = [
        ("job-name", f"{job.name}-prepare"), ("array", array), ("nodes", "1"), ("ntasks", "1"),
        ("cpus-per-task", str(res.cpus)), ("time", str(cluster.timeout_min)), *placement_flags(cluster),
    ]
    flags += [("requeue", None), ("open-mode", "append"),
              ("output", str(logs / "%A_%a.out")), ("error", str(logs / "%A_%a.err"))]
    return flags


def prepare_script(job: JobConfig, store: Path, logs: Path, tasks: int, at_once: Optional[int]) -> str:
    """The array's script. The store reaches #SBATCH lines (the logs' paths), so it is held to Slurm's
    path rules first (ConfigError naming data.store)."""
    check_slurm_path("data.store", store, slurm=True)
    command = " ".join(shlex.quote(arg) for arg in (sys.executable, "-u", "-m", TASK_MODULE, str(store)))
    return template(PREPARE_TEMPLATE).render(flags=prepare_flags(job, logs, tasks, at_once), command=command)


def queue_prepare(job: JobConfig, store: Path, logs: Path, tasks: int, at_once: Optional[int]) -> str:
    """Queue the array (its script kept as `logs/../prepare.sbatch`); its job id. SubmitError with sbatch's
    reason when it refuses."""
    script = prepare_script(job, store, logs, tasks, at_once)
    logs.mkdir(mode=0o700, parents=True, exist_ok=True)  # Slurm makes no directories for --output
    kept = logs.parent / "prepare.sbatch"
    kept.write_text(script)
    return sbatch_parsable(kept, "the prepare's job array")
