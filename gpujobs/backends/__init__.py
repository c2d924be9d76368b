"""Every place a job runs, behind one interface (`base.Backend`, `base.Scheduler`); this registry picks one.

`backend_for(job)` is what callers ask, and their questions are the backend's properties and operations
(does it queue, does the rank run in this process, preflight, start, states, ...): this module is the
only place that compares a cluster's name. `cluster=auto` is resolved here too (`resolve_cluster_name`).
"""

from __future__ import annotations

import functools
import os
import shutil

from gpujobs.backends.base import Backend, Scheduler
from gpujobs.base.errors import ConfigError
from gpujobs.config.load import JobConfig
from gpujobs.rundir import lease

__all__ = ["Backend", "Scheduler", "backend_for", "backend_named", "names", "resolve_cluster_name", "slurm_backend"]


@functools.cache
def _backends() -> dict[str, Backend]:
    # imported here, not above: each backend's package imports `gpujobs.backends.base`, and so this one
    from gpujobs.backends.debug import DebugBackend
    from gpujobs.backends.kubernetes import KubernetesBackend
    from gpujobs.backends.local import LocalBackend
    from gpujobs.backends.slurm import SlurmBackend

    backends: dict[str, Backend] = {
        b.name: b for b in (LocalBackend(), DebugBackend(), SlurmBackend(), KubernetesBackend())}
    return backends


def _register_liveness() -> None:
    """Tell the run dir's lease how to ask a scheduler whether a job that holds a run dir lives."""
    for backend in _backends().values():
        if isinstance(backend, Scheduler):
            lease.register_job_liveness(backend.name, backend.liveness, backend.job_word)


def names() -> tuple[str, ...]:
    """The `cluster=` names of the backends (`auto` picks one of them: `resolve_cluster_name`)."""
    return tuple(_backends())


def backend_named(name: str) -> Backend:
    """The backend that `cluster=name` runs on; ConfigError for a name that none has (`auto` included:
    the submit side resolves it first)."""
    try:
        return _backends()[name]
    except KeyError:
        raise ConfigError("cluster.name", name, f"one of {', '.join(names())}") from None


def backend_for(job: JobConfig) -> Backend:
    """The backend the job runs on: its `cluster.name`. The submit side resolves `auto` before anything
    runs (config.yaml holds the name picked); a config built in code that still says `auto` gets the
    backend this machine would pick (`resolve_cluster_name`)."""
    return backend_named(resolve_cluster_name(job.cluster.name))


def slurm_backend() -> Scheduler:
    """The Slurm backend: the scheduler whose job ids a run dir's `slurm_jobs.jsonl` lists."""
    backend = _backends()["slurm"]
    assert isinstance(backend, Scheduler)
    return backend


def resolve_cluster_name(name: str) -> str:
    """`auto` → slurm when this machine can submit to Slurm, else local."""
    if name != "auto":
        return name
    has_conf = bool(os.environ.get("SLURM_CONF")) or os.path.exists("/etc/slurm/slurm.conf")
    return "slurm" if shutil.which("sbatch") and has_conf else "local"


_register_liveness()
