"""Render, then send: the one sbatch script of a job, from `sbatch_templates/` (pure functions).

What is queued, what a dry run prints and the `submit.sbatch` kept in the run dir are all the text
`render_sbatch` returns for the job's `SbatchRequest`: there is no second renderer to drift.
"""

from __future__ import annotations

import dataclasses
import functools
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import jinja2

from gpujobs.backends.slurm.container_step import ContainerStep, container_step, in_container
from gpujobs.base.errors import ConfigError
from gpujobs.base.nvml import CUDA_ORDER_ENV
from gpujobs.config.load import ClusterConfig, JobConfig, ResourcesConfig
from gpujobs.config.packaged import TEMPLATE_DIR_ENV, template_dir

#: sbatch_templates/ (the checkout's or the wheel's copy); GPUJOBS_SBATCH_TEMPLATES points elsewhere.
TEMPLATE_DIR = template_dir()
TEMPLATE = "job.sbatch.j2"


@dataclass(frozen=True)
class SbatchRequest:
    """Everything the script says, already decided: flags, environment, logs, command."""

    flags: tuple[tuple[str, Optional[str]], ...]
    env: tuple[tuple[str, str], ...]
    stdout: str
    stderr: str
    command: str
    signal_lead_s: int
    supervisor: str = ""
    """What the batch step runs the srun line under (`gpujobs.attempt.supervise`): it records the attempts
    that the ranks could not."""
    elastic: bool = False
    """`--nodes=MIN-MAX`: the script says that the world size is the allocation's."""
    container: ContainerStep = field(default_factory=ContainerStep)
    """The image the ranks' step runs in (`container=`), its words before `command`; empty: no container."""

    def __repr__(self) -> str:
        return render_sbatch(self)


def sbatch_request(job: JobConfig, folder: Path, command: str, *, array: Optional[str] = None,
                   submit_dir: Optional[Path] = None) -> SbatchRequest:
    """The request for `job`, whose submitit files live in `folder`, running `command` on every task.

    With a container, `command` (the submitting Python's) runs in it with the image's interpreter; `folder`'s
    parent (the run dir, or the sweep dir holding an array's points) and `submit_dir` (default: here, where
    sbatch is run) are mounted at their own paths.
    """
    cluster, res = job.cluster, job.resources
    log_stem = str(Path(folder) / ("%A_%a" if array else "%j"))
    elastic = res.least_nodes < res.nodes
    flags: list[tuple[str, Optional[str]]] = [("job-name", job.name), ("nodes", nodes_flag(res))]
    # Per node, so it holds for any node count of a range; no total (--ntasks) may fix the world size.
    # An elastic job with one rank per node says nothing: Slurm's default is one task per node, while an
    # explicit `--ntasks-per-node=1` keeps it at MIN nodes even when MAX are free (seen, Slurm 22.05).
    if not (elastic and res.ranks_per_node == 1):
        flags.append(("ntasks-per-node", str(res.ranks_per_node)))
    flags.append(("cpus-per-task", str(res.cpus)))
    if res.gpus_per_node:
        flags.append(("gpus-per-node", str(res.gpus_per_node)))
    if res.mem_gb is not None:
        flags.append(("mem", f"{int(res.mem_gb * 1024)}M"))
    flags.append(("time", str(cluster.timeout_min)))
    flags += placement_flags(cluster)
    if array is not None:
        flags.append(("array", array))
    flags += [
        ("signal", f"USR2@{cluster.signal_lead_s}"),
        ("requeue", None),
        ("open-mode", "append"),
        ("output", f"{log_stem}_0_log.out"),
        ("error", f"{log_stem}_0_log.err"),
    ]
    step = container_step(job, Path(folder).parent, Path.cwd() if submit_dir is None else submit_dir,
                          python=(shlex.split(command) or [sys.executable])[0])
    return SbatchRequest(
        flags=tuple(flags),
        # no run dir: one script serves every point of an array (and a rerun dir), so each rank sets the
        # files NCCL writes under its own run dir (`NcclSettings.export_env`), and the script names none
        env=tuple(sorted({**job.nccl.to_env(), **CUDA_ORDER_ENV, **dict(step.env)}.items())),
        stdout=f"{log_stem}_%t_log.out",
        stderr=f"{log_stem}_%t_log.err",
        command=in_container(command) if step.runtime else command,
        signal_lead_s=cluster.signal_lead_s,
        supervisor=supervisor_command(command),  # outside: the submitting Python
        elastic=elastic,
        container=step,
    )


def placement_flags(cluster: ClusterConfig) -> list[tuple[str, Optional[str]]]:
    """Where the cluster config places a job: partition, account, qos, constraint, exclude (those set)."""
    keys = ("partition", "account", "qos", "constraint", "exclude")
    return [(key, getattr(cluster, key)) for key in keys if getattr(cluster, key) is not None]


def nodes_flag(res: ResourcesConfig) -> str:
    """`--nodes`' value: `MIN-MAX` for an elastic job (it starts, and restarts after a requeue, on as few
    as MIN nodes), else the one count."""
    return f"{res.least_nodes}-{res.nodes}" if res.least_nodes < res.nodes else str(res.nodes)


def supervisor_command(command: str) -> str:
    """The batch step's supervisor, run by the interpreter that runs the ranks (the command's first word)."""
    words = shlex.split(command)
    python = words[0] if words else sys.executable
    return " ".join(shlex.quote(arg) for arg in (python, "-u", "-m", "gpujobs.attempt.supervise", "--"))


def job_command(folder: Path, *, run_dir: Optional[Path] = None, points: Optional[Path] = None) -> str:
    """What every task runs: the job-side entry, told where its run dir (or array's list of them) is.

    The script names the run dir, never a pickle named by job id, so the kept `submit.sbatch` can be
    queued again by hand (`gpujobs.rank.srun` builds the payload from the run dir's config.yaml).
    """
    if (run_dir is None) == (points is None):
        raise ValueError("job_command needs exactly one of run_dir and points")
    target = ["--points", str(points)] if points is not None else [str(run_dir)]
    args = [sys.executable, "-u", "-m", "gpujobs.rank.srun", "--folder", str(folder), *target]
    return " ".join(shlex.quote(arg) for arg in args)


@functools.cache
def template(name: str = TEMPLATE) -> jinja2.Template:
    """The script template `name` of sbatch_templates/ (each value from config goes through its `q` filter)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # a shell script, not HTML: every value goes through the `q` filter instead
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    try:
        return env.get_template(name)
    except jinja2.TemplateNotFound:  # $GPUJOBS_SBATCH_TEMPLATES names a directory without it
        raise ConfigError(TEMPLATE_DIR_ENV, str(TEMPLATE_DIR), f"a directory that holds {name}") from None


def render_sbatch(request: SbatchRequest) -> str:
    """The script's text. Every value from config is shell-quoted."""
    return template().render(**dataclasses.asdict(request))


def run_dir_script(job: JobConfig, run_dir: Path) -> str:
    """The script that runs `run_dir` alone: what is queued, what a dry run prints and `submit.sbatch`."""
    folder = run_dir / job.cluster.folder
    return render_sbatch(sbatch_request(job, folder, job_command(folder, run_dir=run_dir)))
