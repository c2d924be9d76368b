"""`cluster=local`: the same job as processes on this machine, run and followed by the local launcher.

The launcher (`gpujobs.attempt.local`: it supervises the ranks, judges each attempt and restarts from
the last checkpoint) sits a layer above the backends, so this backend names it by a string and imports
it when a job starts, as `debug` names the rank's callable.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Optional

from gpujobs.backends.base import Backend, PreflightCache
from gpujobs.backends.local.container import LOCAL_RUNTIMES, check_local_container
from gpujobs.backends.local.gpus import local_gpu_count
from gpujobs.base.errors import ConfigError
from gpujobs.config.load import JobConfig
from gpujobs.config.nccl import GLOO_ON_CUDA_ENV

#: The local launcher's module; its `run_local(job, run_dir) -> int` runs and follows the job.
LAUNCHER = "gpujobs.attempt.local"


def check_local_resources(job: JobConfig, gpus_here: int) -> None:
    """Refuse what this machine cannot give, before anything starts."""
    res = job.resources
    if res.nodes != 1:
        raise ConfigError("resources.nodes", res.nodes, "1 with cluster=local (use cluster=slurm for more nodes)")
    if res.gpus_per_node > gpus_here and not (gpus_here and os.environ.get(GLOO_ON_CUDA_ENV) == "1"):
        listed = os.environ.get("CUDA_VISIBLE_DEVICES")
        if listed is not None:
            hint = f"0..{gpus_here} (the GPUs CUDA_VISIBLE_DEVICES={listed!r} names here)"
        elif gpus_here == 0:
            hint = ("0: this machine has no NVIDIA GPU "
                    "(use resources.gpus_per_node=0 with resources.procs_per_node=N for CPU ranks)")
        else:
            hint = f"0..{gpus_here} (GPUs on this machine)"
        raise ConfigError("resources.gpus_per_node", res.gpus_per_node, hint)


class LocalBackend(Backend):
    """Ranks as processes here (one per GPU, or CPU ranks with gloo), restarted after a failure."""

    name = "local"
    container_runtimes = frozenset(LOCAL_RUNTIMES)

    def node_cpus(self, job: JobConfig, cache: Optional[PreflightCache] = None) -> Optional[int]:
        return len(os.sched_getaffinity(0))  # this machine's CPUs that the ranks may use

    def preflight(self, job: JobConfig, cache: Optional[PreflightCache] = None) -> None:
        check_local_resources(job, local_gpu_count())
        check_local_container(job, Path.cwd())  # the ranks start in the submit directory

    def start(self, job: JobConfig, run_dir: Path) -> int:
        check_local_container(job, Path.cwd(), run_dir)  # its mount too, now that the run dir is known
        run_local = importlib.import_module(LAUNCHER).run_local
        return int(run_local(job, run_dir))
