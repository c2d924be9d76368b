"""`cluster=kubernetes`: one JobSet a job, optionally queued by Kueue (`jobset.py` renders it).

This version renders only: `cluster.dry_run=true` prints the JobSet for `kubectl apply -f`, and a submit
without it is refused. Before, where the kubeconfig's cluster can be asked (`preflight.py`, through the
one client module `api.py`), a job it can never run is refused (`fit.py`). The image is `container.image`
with `container=podman` (an OCI image reference, which the nodes pull as podman would), and the run dir
lies on the shared volume (`cluster.volume`). What the config loader cannot know (where the run dir is,
the container) is checked here, before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from gpujobs.backends.base import Backend, PreflightCache
from gpujobs.base.errors import ConfigError
from gpujobs.config.load import JobConfig
from gpujobs.config.modes import Runtime
from gpujobs.rundir import lease

#: Why a submit without `cluster.dry_run` is refused in this version.
RENDER_ONLY = ("true: this version renders the JobSet (cluster.dry_run=true > jobset.yaml; "
               "kubectl apply -f jobset.yaml)")
IMAGE_NEEDED = ("an OCI image reference the nodes pull, with container=podman (e.g. container=podman "
                "container.image=registry.example.com/team/rec:1): cluster=kubernetes runs the ranks in it")


#: The lease holder's word for a JobSet (its job id: the JobSet's name, the same for every pod and restart).
LEASE_HOLDER = "kubernetes"


def jobset_liveness(name: str) -> tuple[bool, str]:
    """Whether JobSet `name`, which holds a run dir's lease, may still run: a pod cannot ask the API server
    (no client, no rights), so another JobSet's lease holds until someone who can look removes it."""
    return True, (f"a pod cannot ask whether it still runs: once `kubectl get jobset {name}` finds none, "
                  f"remove the run dir's lease.json")


lease.register_job_liveness(LEASE_HOLDER, jobset_liveness)


class KubernetesBackend(Backend):
    """A JobSet on a Kubernetes cluster: rendered here, applied with kubectl."""

    name = "kubernetes"
    renders = True
    container_runtimes = frozenset({Runtime.podman.value})

    def preflight(self, job: JobConfig, cache: Optional[PreflightCache] = None) -> None:
        from gpujobs.backends.kubernetes.preflight import preflight_kubernetes

        check_kubernetes_job(job)
        preflight_kubernetes(job, cache)

    def render(self, job: JobConfig, run_dir: Path) -> str:
        from gpujobs.backends.kubernetes.jobset import render_jobset
        from gpujobs.backends.kubernetes.preflight import say_if_not_asked

        check_on_volume(job, "hydra.run.dir", run_dir.absolute())
        text = render_jobset(job, run_dir.absolute())
        say_if_not_asked()  # here, not at preflight: only a JobSet printed goes with the line (one line a refusal)
        return text

    def start(self, job: JobConfig, run_dir: Path) -> int:
        raise ConfigError("cluster.dry_run", job.cluster.dry_run, RENDER_ONLY)


def check_kubernetes_job(job: JobConfig) -> None:
    """Refuse what the JobSet cannot say (ConfigError naming the key): a submit that is no dry run, no image,
    container keys that mean nothing in a pod, an elastic node range, a data store off the volume."""
    if not job.cluster.dry_run:
        raise ConfigError("cluster.dry_run", False, RENDER_ONLY)
    container = job.container
    if container.runtime == Runtime.none or not container.image:
        raise ConfigError("container.image", container.image, IMAGE_NEEDED)
    for key, value in (("mounts", container.mounts), ("env", container.env), ("gpus", container.gpus)):
        if value:
            raise ConfigError(f"container.{key}", value, "nothing with cluster=kubernetes (the pod mounts "
                              "cluster.volume and /dev/shm, and gets resources.gpus_per_node GPUs)")
    if job.resources.least_nodes < job.resources.nodes:
        raise ConfigError("resources.min_nodes", job.resources.min_nodes,
                          f"null with cluster=kubernetes (the JobSet runs all {job.resources.nodes} nodes)")
    store = getattr(job.data, "store", None)
    if store:
        check_on_volume(job, "data.store", Path(str(store)).absolute())


def check_on_volume(job: JobConfig, key: str, path: Path) -> None:
    """`path` (the run dir, the data store) lies under `cluster.volume.mount_path`, where every pod sees it."""
    mount = job.cluster.volume.mount_path
    if mount is None or not (path == Path(mount) or Path(mount) in path.parents):
        raise ConfigError(key, str(path), f"a path under cluster.volume.mount_path={mount} (the pods see the run "
                                          f"dir and the data on the volume {job.cluster.volume.claim} only)")
