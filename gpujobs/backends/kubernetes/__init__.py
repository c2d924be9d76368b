"""`cluster=kubernetes`: one JobSet a job, optionally queued by Kueue (`jobset.py` renders it).

A submit creates the JobSet through the API client (`jobs.py`, over the one client module `api.py`: the
`kubernetes` extra and the user's kubeconfig), keeps its YAML as the run dir's `jobset.yaml` and records its
id `NAMESPACE/NAME`; `gpujobs status|logs|cancel|resubmit` then work on it as on a Slurm job.
`cluster.dry_run=true` prints the JobSet (for `kubectl apply -f`) and creates nothing. Before either, where
the kubeconfig's cluster can be asked (`preflight.py`), a job it can never run is refused (`fit.py`). The
image is `container.image` alone (an OCI image reference, which the kubelet pulls and runs: no runtime to
pick; `container=podman` with it is taken as well), and the run dir lies on the shared volume
(`cluster.volume`). What the config loader cannot know (where the run dir is, the container) is checked
here, before anything is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from gpujobs.backends.base import Allocation, PreflightCache, Scheduler
from gpujobs.backends.kubernetes import jobs
from gpujobs.backends.kubernetes.jobs import LEASE_HOLDER
from gpujobs.base.errors import ConfigError, SubmitError
from gpujobs.config.load import JobConfig
from gpujobs.config.modes import Runtime
from gpujobs.rundir import lease

__all__ = ["LEASE_HOLDER", "KubernetesBackend"]

IMAGE_NEEDED = ("an OCI image reference the nodes pull (e.g. container.image=registry.example.com/team/rec:1): "
                "cluster=kubernetes runs the ranks in it")


class KubernetesBackend(Scheduler):
    """A JobSet on a Kubernetes cluster, created and read through the official client."""

    name = "kubernetes"
    renders = True
    container_runtimes = frozenset({Runtime.podman.value})
    runs_images = True
    final_states = jobs.FINAL
    failed_states = jobs.FAILED
    cancelled_state = jobs.CANCELLED
    job_word = "JobSet"

    def preflight(self, job: JobConfig, cache: Optional[PreflightCache] = None) -> None:
        from gpujobs.backends.kubernetes.preflight import preflight_kubernetes, why_not_asked

        check_kubernetes_job(job)
        why = why_not_asked()
        if why is not None and not job.cluster.dry_run:
            raise ConfigError("cluster.dry_run", False, f"true: a JobSet is created through the API client, and "
                              f"{why} (a dry run prints it for kubectl apply -f)")
        preflight_kubernetes(job, cache)

    def render(self, job: JobConfig, run_dir: Path) -> str:
        from gpujobs.backends.kubernetes.jobset import render_jobset
        from gpujobs.backends.kubernetes.preflight import say_if_not_asked

        check_on_volume(job, "hydra.run.dir", run_dir.absolute())
        text = render_jobset(job, run_dir.absolute())
        say_if_not_asked()  # here, not at preflight: only a JobSet printed goes with the line (one line a refusal)
        return text

    def start(self, job: JobConfig, run_dir: Path) -> int:
        job_id = self.submit(job, run_dir)
        print(f"gpujobs: submitted JobSet {job_id}; run dir {run_dir}", flush=True)
        return self.follow(job, run_dir, job_id) if self.follows(job) else 0

    def submit(self, job: JobConfig, run_dir: Path) -> str:
        check_on_volume(job, "hydra.run.dir", run_dir.absolute())
        return jobs.submit_jobset(job, run_dir)

    def follow(self, job: JobConfig, run_dir: Path, job_id: str) -> int:
        return jobs.follow(job_id)

    def states(self, job_ids: Sequence[str], timeout_s: float) -> dict[str, str]:
        return jobs.states(job_ids)

    def cancel(self, job_ids: Sequence[str]) -> dict[str, str]:
        return jobs.cancel(job_ids)

    def already_ended(self, why: str) -> bool:
        return why == jobs.GONE

    def log_path(self, logs: Path, job_id: str, rank: int, *, err: bool = False) -> Path:
        return jobs.rank_log_path(logs, jobs.split_id(job_id)[1], rank, err=err)

    def liveness(self, job_id: str) -> tuple[bool, str]:
        return jobs.liveness(job_id)

    def requeue(self, job_id: str) -> Optional[str]:
        return "a JobSet restarts by its failurePolicy (cluster.max_restarts), not on request"

    def exclude(self, job_id: str, nodes: Sequence[str]) -> Optional[str]:
        return f"a JobSet keeps off nodes by cluster.node_selector and taints: cordon {', '.join(nodes)} by hand"

    def queue_prepare(self, job: JobConfig, store: Path, logs: Path, tasks: int, at_once: Optional[int]) -> str:
        raise SubmitError("gpujobs prepare runs here or on Slurm, not as a JobSet: prepare the store with "
                          "cluster=local on a machine that mounts the volume")

    def allocations(self, job_ids: Sequence[str], timeout_s: float) -> dict[str, list[Allocation]]:
        return {}  # no accounting is asked of the cluster: `gpujobs cost` counts from the run dir's records


lease.register_job_liveness(LEASE_HOLDER, jobs.liveness, KubernetesBackend.job_word)


def check_kubernetes_job(job: JobConfig) -> None:
    """Refuse what the JobSet cannot say (ConfigError naming the key): no volume for the run dir, no image,
    container keys that mean nothing in a pod, an elastic node range, a data store off the volume."""
    volume = job.cluster.volume
    if volume.claim is None or volume.mount_path is None:
        key = "cluster.volume.claim" if volume.claim is None else "cluster.volume.mount_path"
        raise ConfigError(key, None, "a value with cluster=kubernetes (the run dir lies on a ReadWriteMany PVC: "
                                     "cluster.volume.claim=NAME cluster.volume.mount_path=/PATH)")
    container = job.container
    if not container.image:
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
