"""Will the job ever fit? Pure checks of what the cluster said (no client here: `api.py` asks, this decides).

Kueue admits a workload's pod set into one flavor of the ClusterQueue's resourceGroup that covers each
resource it asks for, so the job (`resources.nodes` pods of `resources.gpus_per_node` of
`cluster.gpu_resource`) can ever be admitted only if one flavor's quota of that resource can hold it all. The
most a ClusterQueue can ever use of a flavor's resource is its `nominalQuota` plus its `borrowingLimit` (the
Kueue v0.19.2 ClusterQueue CRD's description of `borrowingLimit`: "Workloads in a ClusterQueue can consume a
quantity of quota equal to nominalQuota+borrowingLimit ... If null, it means that there is no borrowing
limit", and it "must be null if spec.cohort is empty"). Outside a cohort there is nothing to borrow: the
nominal quota is all. In a cohort without a borrowing limit the bound is the cohort's unused quota, which the
other queues' objects would tell and which changes: the job is given the benefit of the doubt.

Then the scheduler must place each pod on one node: some node that has the `cluster.node_selector` labels
(the API filtered by them) must have at least `resources.gpus_per_node` of the resource allocatable.
Every refusal is a ConfigError naming the key to change, its value, and what the cluster allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Optional

from gpujobs.base.errors import ConfigError
from gpujobs.config.kube_names import quantity_value
from gpujobs.config.load import JobConfig

Object = dict[str, Any]


@dataclass(frozen=True)
class ClusterView:
    """What the API server said (None: the object does not exist, or was not asked for after one that did not)."""

    host: str
    """The API server asked (the kubeconfig's current context)."""
    namespace: Optional[Object] = None
    local_queue: Optional[Object] = None
    """`cluster.queue`'s LocalQueue in the namespace (not asked for without `cluster.queue`)."""
    cluster_queue: Optional[Object] = None
    """The ClusterQueue the LocalQueue points at."""
    nodes: list[Object] = field(default_factory=list)
    """The nodes with every `cluster.node_selector` label."""


@dataclass(frozen=True)
class FlavorQuota:
    """One flavor's quota of one resource in a ClusterQueue."""

    cluster_queue: str
    flavor: str
    nominal: Decimal
    borrowing: Optional[Decimal]
    """`borrowingLimit`; None: no limit (or, outside a cohort, nothing to borrow: see `cohort`)."""
    cohort: Optional[str]

    @property
    def most(self) -> Optional[Decimal]:
        """The most the queue can ever use of it; None: no bound known here (a cohort without a limit)."""
        if not self.cohort:
            return self.nominal
        return None if self.borrowing is None else self.nominal + self.borrowing

    def describe(self) -> str:
        """`ClusterQueue team-cq, flavor a100: nominal 8 + borrowing 0`."""
        borrowing = (f" + borrowing {number(self.borrowing)} from cohort {self.cohort}" if self.cohort and
                     self.borrowing is not None else ", in no cohort to borrow from")
        return f"ClusterQueue {self.cluster_queue}, flavor {self.flavor}: nominal {number(self.nominal)}{borrowing}"


def number(value: Decimal) -> str:
    """`8`, not `8.000` or `8E+0`."""
    return format(value.normalize(), "f")


def name_of(obj: Object) -> str:
    """An object's `metadata.name`."""
    return str(obj.get("metadata", {}).get("name", ""))


def gpu_quotas(cluster_queue: Object, resource: str) -> list[FlavorQuota]:
    """The flavors' quotas of `resource` in the ClusterQueue's resourceGroup that covers it (none: no group)."""
    spec, name = cluster_queue.get("spec", {}), name_of(cluster_queue)
    quotas = []
    for group in spec.get("resourceGroups") or []:
        if resource not in (group.get("coveredResources") or []):
            continue
        for flavor in group.get("flavors") or []:
            for quota in flavor.get("resources") or []:
                if quota.get("name") != resource:
                    continue
                where = f"ClusterQueue {name} flavor {flavor.get('name')} {resource}"
                borrowing = quota.get("borrowingLimit")
                quotas.append(FlavorQuota(
                    name, str(flavor.get("name")), quantity_value(f"{where} nominalQuota", quota.get("nominalQuota")),
                    None if borrowing is None else quantity_value(f"{where} borrowingLimit", borrowing),
                    spec.get("cohort") or None))
    return quotas


def check_fit(job: JobConfig, view: ClusterView) -> None:
    """Refuse (ConfigError) a job the cluster in `view` can never run: no namespace, no LocalQueue or
    ClusterQueue, a quota too small for all its GPUs, no node for one pod's."""
    cluster = job.cluster
    if view.namespace is None:
        raise ConfigError("cluster.namespace", cluster.namespace, f"a namespace that exists at {view.host} "
                          f"(kubectl get namespaces; the kubeconfig's current context asked)")
    if cluster.queue is not None:
        if view.local_queue is None:
            raise ConfigError("cluster.queue", cluster.queue, f"a Kueue LocalQueue of namespace {cluster.namespace} "
                              f"(kubectl get localqueues -n {cluster.namespace}), or null for no Kueue")
        check_quota(job, view.local_queue, view.cluster_queue)
    check_nodes(job, view.nodes)


def check_quota(job: JobConfig, local_queue: Object, cluster_queue: Optional[Object]) -> None:
    """The LocalQueue's ClusterQueue exists and one flavor can ever hold all the job's GPUs."""
    resources, resource = job.resources, job.cluster.gpu_resource
    behind = f"LocalQueue {job.cluster.namespace}/{name_of(local_queue)}"
    if cluster_queue is None:
        target = local_queue.get("spec", {}).get("clusterQueue")
        points = f"points at ClusterQueue {target}, which does not" if target else "names no ClusterQueue"
        raise ConfigError("cluster.queue", job.cluster.queue, f"a LocalQueue whose ClusterQueue exists ({behind} "
                          f"{points})")
    if resources.gpus_per_node == 0:
        return
    quotas = gpu_quotas(cluster_queue, resource)
    if not quotas:
        raise ConfigError("resources.gpus_per_node", resources.gpus_per_node, f"0 {resource} through {behind}: "
                          f"ClusterQueue {name_of(cluster_queue)} has no quota of it")
    bounded = [(q.most, q) for q in quotas if q.most is not None]
    if len(bounded) < len(quotas):  # a flavor whose bound only the cohort's other queues would tell
        return
    most, best = max(bounded, key=lambda pair: pair[0])
    asked = resources.nodes * resources.gpus_per_node
    if asked <= most:
        return
    if resources.gpus_per_node > most:
        raise ConfigError("resources.gpus_per_node", resources.gpus_per_node,
                          f"at most {number(most)} {resource} in all ({best.describe()})")
    raise ConfigError("resources.nodes", resources.nodes,
                      f"at most {int(most // resources.gpus_per_node)} nodes of {resources.gpus_per_node} {resource} "
                      f"(at most {number(most)} in all: {best.describe()})")


def check_nodes(job: JobConfig, nodes: list[Object]) -> None:
    """Some node (of those with the `cluster.node_selector` labels) can hold one pod's GPUs."""
    selector, resource = job.cluster.node_selector, job.cluster.gpu_resource
    if not nodes and selector:
        raise ConfigError("cluster.node_selector", selector, "labels that some node has (no node has them all)")
    gpus = job.resources.gpus_per_node
    if gpus == 0:
        return
    allocatable = [quantity_value(f"node {name_of(node)} allocatable {resource}",
                                  node.get("status", {}).get("allocatable", {}).get(resource, 0))
                   for node in nodes]
    most = max(allocatable, default=Decimal(0))
    if most < gpus:
        having = f" with the labels {selector}" if selector else ""
        raise ConfigError("resources.gpus_per_node", gpus, f"at most {number(most)} {resource} per node (the most "
                          f"allocatable on any of the {len(nodes)} nodes{having})")
