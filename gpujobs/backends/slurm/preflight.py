"""Slurm preflight: refuse, before anything is queued, a job the cluster could never run.

A job asking for a partition that does not exist, more nodes or GPUs than the partition has, or more
time than it allows would otherwise sit in the queue (reason PartitionNodeLimit, PartitionTimeLimit,
...) and be found out hours later. `query_cluster` asks Slurm once; `check` is a pure function.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass, field
from typing import Optional

from gpujobs.backends.base import PreflightCache, asked_once
from gpujobs.backends.slurm.commands import slurm_output
from gpujobs.base.errors import ConfigError, SubmitError
from gpujobs.config.load import JobConfig, parse_time_minutes
from gpujobs.config.modes import Runtime


@dataclass
class PartitionInfo:
    """What one partition can ever give."""

    name: str
    default: bool = False
    max_nodes: Optional[int] = None
    """None: unlimited."""
    max_time_min: Optional[int] = None
    """None: unlimited."""
    nodes: dict[str, tuple[int, int]] = field(default_factory=dict)
    """node name → (CPUs, GPUs)."""


@dataclass
class ClusterInfo:
    """Partitions, and the accounts and QOS names accounting knows (None where it could not say)."""

    partitions: dict[str, PartitionInfo]
    accounts: Optional[set[str]] = None
    qos: Optional[set[str]] = None


def gpu_count(gres: str) -> int:
    """GPUs in a GRES string such as `gpu:2`, `gpu:a100:4(S:0-1)` or `(null)`."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):
        parts = item.strip().split(":")
        if parts[0] == "gpu" and len(parts) > 1 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _limit(text: str, parse: type[int] | None = None) -> Optional[int]:
    if text in ("UNLIMITED", "INFINITE", ""):
        return None
    return int(text) if parse is int else parse_time_minutes(text)


def parse_partitions(scontrol: str, sinfo: str) -> dict[str, PartitionInfo]:
    """Partitions from `scontrol show partition --oneliner` and `sinfo -h -N -o %N|%P|%c|%G`."""
    partitions: dict[str, PartitionInfo] = {}
    for line in scontrol.splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if "PartitionName" not in fields:
            continue
        partitions[fields["PartitionName"]] = PartitionInfo(
            name=fields["PartitionName"],
            default=fields.get("Default") == "YES",
            max_nodes=_limit(fields.get("MaxNodes", ""), int),
            max_time_min=_limit(fields.get("MaxTime", "")),
        )
    for line in sinfo.splitlines():
        if line.count("|") != 3:
            continue
        node, partition, cpus, gres = line.split("|")
        part = partitions.get(partition.rstrip("*"))
        if part is not None:
            part.nodes[node] = (int(cpus), gpu_count(gres))
    return partitions


def query_cluster(job: JobConfig) -> ClusterInfo:
    """Ask Slurm (two or three quick commands) what it can give; SlurmCommandError when it cannot say."""
    partitions = parse_partitions(
        slurm_output(["scontrol", "show", "partition", "--oneliner"]),
        slurm_output(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%G"]),
    )
    info = ClusterInfo(partitions)
    if shutil.which("sacctmgr") is not None:
        if job.cluster.account is not None:
            info.accounts = set(slurm_output(["sacctmgr", "-n", "-P", "show", "account", "format=account"]).split())
        if job.cluster.qos is not None:
            info.qos = set(slurm_output(["sacctmgr", "-n", "-P", "show", "qos", "format=name"]).split())
    return info


def partition_of(job: JobConfig, info: ClusterInfo) -> PartitionInfo:
    """The partition `job` goes to (cluster.partition, else the default); ConfigError where there is none."""
    names = ", ".join(sorted(info.partitions)) or "none"
    if job.cluster.partition is None:
        defaults = [p for p in info.partitions.values() if p.default]
        if not defaults:
            raise ConfigError("cluster.partition", None, f"one of {names} (the cluster has no default partition)")
        return defaults[0]
    if job.cluster.partition in info.partitions:
        return info.partitions[job.cluster.partition]
    raise ConfigError("cluster.partition", job.cluster.partition, f"one of {names}")


def node_cpus(job: JobConfig, info: ClusterInfo) -> Optional[int]:
    """The fewest CPUs of a node of the job's partition that has its GPUs (any of them may run it)."""
    part = partition_of(job, info)
    cpus = [cpus for cpus, gpus in part.nodes.values() if gpus >= job.resources.gpus_per_node]
    return min(cpus) if cpus else None


def check(job: JobConfig, info: ClusterInfo) -> None:
    """Raise ConfigError for the first thing `info`'s cluster could never give `job`."""
    cluster, res = job.cluster, job.resources
    part = partition_of(job, info)

    # An elastic job (--nodes=MIN-MAX) needs only MIN nodes that can run it: Slurm starts it on what is
    # there, up to MAX. But a partition's MaxNodes holds the whole range (seen, Slurm 22.05: --nodes=1-2
    # in a MaxNodes=1 partition pends forever with reason PartitionNodeLimit), so MAX must stay within it.
    least, key = res.least_nodes, "resources.nodes" if res.min_nodes is None else "resources.min_nodes"
    node_limit = len(part.nodes) if part.max_nodes is None else min(part.max_nodes, len(part.nodes))
    if least > node_limit:
        raise ConfigError(key, least, f"at most {node_limit} in partition {part.name}")
    if part.max_nodes is not None and res.nodes > part.max_nodes:
        raise ConfigError(
            "resources.nodes", res.nodes,
            f"at most {part.max_nodes} in partition {part.name} (its MaxNodes holds for the most of a --nodes range)",
        )
    with_gpus = [n for n, (_, gpus) in part.nodes.items() if gpus >= res.gpus_per_node]
    if len(with_gpus) < least:
        most = max((gpus for _, gpus in part.nodes.values()), default=0)
        raise ConfigError(
            "resources.gpus_per_node", res.gpus_per_node,
            f"at most {most} on {least} node(s) of partition {part.name}",
        )
    cpus_needed = res.ranks_per_node * res.cpus
    with_cpus = [n for n in with_gpus if part.nodes[n][0] >= cpus_needed]
    if len(with_cpus) < least:
        most = max((cpus for cpus, _ in part.nodes.values()), default=0)
        raise ConfigError(
            "resources.cpus_per_task", res.cpus,
            f"ranks per node ({res.ranks_per_node}) x cpus_per_task <= {most} CPUs per node in partition {part.name}",
        )
    if part.max_time_min is not None and cluster.timeout_min > part.max_time_min:
        raise ConfigError("cluster.time", cluster.time, f"at most {part.max_time_min} minutes in partition {part.name}")
    if cluster.account is not None and info.accounts is not None and cluster.account not in info.accounts:
        raise ConfigError("cluster.account", cluster.account, f"one of {', '.join(sorted(info.accounts)) or 'none'}")
    if cluster.qos is not None and info.qos is not None and cluster.qos not in info.qos:
        raise ConfigError("cluster.qos", cluster.qos, f"one of {', '.join(sorted(info.qos)) or 'none'}")


def cluster_info(job: JobConfig, cache: Optional[PreflightCache] = None) -> ClusterInfo:
    """What the cluster says of itself, asked once a sweep (`cache`)."""
    key = (job.cluster.account is not None, job.cluster.qos is not None)  # what query_cluster asks depends on these
    info: ClusterInfo = asked_once(cache, key, lambda: query_cluster(job))
    return info


#: The preflight cache's note that a sweep's dry run has said it skips the cluster's checks (once a sweep).
_OFFLINE_SAID = "dry run without sbatch: said"


def preflight_slurm(job: JobConfig, cache: Optional[PreflightCache] = None) -> None:
    """Query the cluster and check the job against it.

    A sweep passes one `cache` for all its points, so a 100-point sweep asks Slurm once, not 100 times.
    A dry run where no Slurm is installed (a laptop) only prints the script: the cluster's questions are
    skipped, and one line on stderr says so (once a sweep, through `cache`).
    """
    if shutil.which("sbatch") is None:
        if not job.cluster.dry_run:
            raise SubmitError("cluster=slurm but `sbatch` is not on PATH (use cluster=local on this machine)")
        if cache is None or not cache.get(_OFFLINE_SAID):
            print("gpujobs: no `sbatch` on PATH: the dry run skips the cluster's checks (partition, nodes, GPUs, "
                  "time, account, qos)", file=sys.stderr, flush=True)
            if cache is not None:
                cache[_OFFLINE_SAID] = True
        return
    check(job, cluster_info(job, cache))
    if job.container.runtime == Runtime.oci and job.resources.ranks_per_node > 1:
        check_oci_tasks(job, slurm_output(["srun", "--version"]).strip())


#: The last Slurm series whose `srun --container` runs one task per node (its slurmstepd writes one
#: config.json per node, before the task's own variables exist: read in 22.05's slurmstepd/container.c).
OCI_ONE_TASK_UNTIL = (22, 5)


def check_oci_tasks(job: JobConfig, version: str) -> None:
    """Refuse a container=oci job of more than one rank a node where `version` (`srun --version`:
    "slurm 22.05.8") runs one task per node in a container."""
    found = re.search(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) > OCI_ONE_TASK_UNTIL:
        return
    res = job.resources
    key, value = ("resources.gpus_per_node", res.gpus_per_node) if res.gpus_per_node else \
        ("resources.procs_per_node", res.procs_per_node)
    raise ConfigError(key, value, f"1 with container=oci on {version} (its srun --container runs one task a "
                      "node: give each node one rank, or use container=pyxis, apptainer or charliecloud)")


def max_array_size() -> int:
    """The cluster's MaxArraySize: array indices must stay below it (Slurm's default is 1001)."""
    for line in slurm_output(["scontrol", "show", "config"]).splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize" and value.strip().isdigit():
            return int(value.strip())
    return 1001
