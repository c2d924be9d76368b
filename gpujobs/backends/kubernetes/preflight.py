"""Ask the cluster, once a sweep, whether the job can ever run there (`fit.py` decides from the answers).

Only where it can be asked: the `kubernetes` package installed (the `kubernetes` extra) and a kubeconfig
found as kubectl finds one. Otherwise the dry run goes on without asking and says so on stderr, in one line,
when it prints the JobSet (stdout stays the YAML alone). An API server that cannot be reached, or refuses
a read, refuses the submit in one line (exit 2): a check that silently did not happen would look like a pass.

What is asked, with the RBAC each read needs: the namespace (get namespaces), `cluster.queue`'s LocalQueue
(get localqueues, kueue.x-k8s.io) and its ClusterQueue (get clusterqueues), and the nodes with the
`cluster.node_selector` labels (list nodes).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from typing import Optional, TypeVar

from gpujobs.backends.base import PreflightCache, asked_once
from gpujobs.backends.kubernetes.fit import ClusterView, check_fit
from gpujobs.config.load import JobConfig

T = TypeVar("T")
#: The reasons for not asking that were said already: a sweep's points say theirs once.
_said: set[str] = set()


def why_not_asked() -> Optional[str]:
    """Why the cluster cannot be asked here (no client package, no kubeconfig); None when it can."""
    if importlib.util.find_spec("kubernetes") is None:
        return "the kubernetes package is not installed (pip install 'gpujobs[kubernetes]')"
    from gpujobs.backends.kubernetes.api import kubeconfig_files

    if not kubeconfig_files():
        return "no kubeconfig found (KUBECONFIG, else ~/.kube/config)"
    return None


def say_if_not_asked() -> None:
    """One stderr line, once a process, when the cluster could not be asked (what a dry run did not check)."""
    why = why_not_asked()
    if why is not None and why not in _said:
        _said.add(why)
        print(f"gpujobs: the cluster was not asked whether the job can ever fit: {why}", file=sys.stderr, flush=True)


def preflight_kubernetes(job: JobConfig, cache: Optional[PreflightCache] = None) -> None:
    """Refuse (ConfigError; KubernetesApiError when the API cannot answer) a job that can never run on the
    kubeconfig's cluster. A sweep passes one `cache`: its points that share a namespace, queue and node
    labels ask once."""
    if why_not_asked() is not None:
        return
    cluster = job.cluster
    key = ("kubernetes", cluster.namespace, cluster.queue, tuple(sorted((cluster.node_selector or {}).items())))
    check_fit(job, asked_once(cache, key, lambda: read_cluster(job)))


def read_cluster(job: JobConfig) -> ClusterView:
    """What the preflight needs from the API server, asked in order and no further than the first absence."""
    from gpujobs.backends.kubernetes.api import ClusterApi

    cluster = job.cluster
    api = ClusterApi()
    try:
        namespace = asking("cluster.namespace", cluster.namespace, lambda: api.namespace(cluster.namespace))
        if namespace is None:
            return ClusterView(api.host)
        local_queue = cluster_queue = None
        queue = cluster.queue
        if queue is not None:
            local_queue = asking("cluster.queue", queue, lambda: api.local_queue(cluster.namespace, queue))
            if local_queue is None:
                return ClusterView(api.host, namespace)
            target = str(local_queue.get("spec", {}).get("clusterQueue", ""))
            # a LocalQueue may name none (the CRD does not require it): then there is none to ask for
            cluster_queue = asking("cluster.queue", queue, lambda: api.cluster_queue(target)) if target else None
            if cluster_queue is None:
                return ClusterView(api.host, namespace, local_queue)
        nodes = asking("resources.gpus_per_node", job.resources.gpus_per_node,
                       lambda: api.nodes(dict(cluster.node_selector or {})))
        return ClusterView(api.host, namespace, local_queue, cluster_queue, nodes)
    finally:
        api.close()


def asking(key: str, value: object, read: Callable[[], T]) -> T:
    """`read()`, its failure's one line naming the key it was to check (KubernetesApiError)."""
    from gpujobs.backends.kubernetes.api import KubernetesApiError

    try:
        return read()
    except KubernetesApiError as err:
        raise KubernetesApiError(f"cannot check {key}={value!r} against the cluster: {err}") from None
