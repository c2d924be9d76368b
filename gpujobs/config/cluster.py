"""Where a job runs and what it asks for: `cluster` and `resources`, declared like every section of
`gpujobs.config.schema` (which builds `JobConfig` from them and re-exports these names), with the Slurm limits
their bounds come from: names sbatch reads, time strings, the --signal lead, --mem (torch-free); the
`cluster=kubernetes` keys take names as Kubernetes does (`gpujobs.config.kube_names`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from gpujobs.base.errors import ConfigError
from gpujobs.config import kube_names as kube
from gpujobs.config.validate import NAME_MAX, Checked, bounds

CLUSTERS = ("auto", "local", "debug", "slurm", "kubernetes")
NAME = re.compile(r"[A-Za-z0-9_.-]+")
NAME_TEXT = "letters, digits and _.- (no spaces or shell characters)"
#: A name that becomes one directory level (`cluster.folder`, `name` in the default run dir): `.` and `..`
#: would put what goes under it in the run dir itself or in its parent; Linux takes at most NAME_MAX bytes.
DIR_NAME = re.compile(rf"(?!\.\.?\Z)[A-Za-z0-9_.-]{{1,{NAME_MAX}}}")
DIR_NAME_TEXT = ("letters, digits and _.- (no spaces or shell characters), but not . or .., at most "
                 f"{NAME_MAX} of them (a directory name)")
_NAME_LIST = re.compile(r"[A-Za-z0-9_.,\[\]-]+")
_NAME_LIST_TEXT = "letters, digits and _.,[]- (no spaces or shell characters)"
_CONTROL_OR_SPACE = re.compile(r"[\s\x00-\x1f\x7f]")
_MM_SS = re.compile(r"\s*\d+:\d{1,2}\s*")
_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d{1,2}))?(?::(\d{1,2}))?")
#: slurmctld checks time limits every 30 s and sends a job's --signal at the first check that finds
#: less than the lead + 30 s left, so the signal may come up to 30 s before the lead.
SLURM_LIMIT_CHECK_S = 30
#: Slurm's --signal takes a lead of at most 65535 s (a 16-bit field).
SLURM_MAX_SIGNAL_LEAD_S = 65535
DEFAULT_SIGNAL_LEAD_S = 120
#: Slurm keeps --ntasks-per-node and --cpus-per-task in 16 bits, 65534 and 65535 meaning "unset" and "infinite".
SLURM_MAX_PER_NODE = 65533
_PER_NODE = "Slurm's --ntasks-per-node is 16-bit"
#: torch.distributed numbers ranks, and counts them, in a C int.
MAX_WORLD_SIZE = 2**31 - 1
#: The most CPUs a GPU rank gets where `resources.cpus_per_task` is null: its own threads (autograd, NCCL's
#: proxy and watchdog, gloo, the heartbeat, NVML, checkpoint writes) and torch's intra-op pool are busy
#: with 8; more buys a GPU rank little and takes CPUs from the node's other jobs.
GPU_RANK_CPUS_CAP = 8
#: `--mem` is rendered in whole MiB (`--mem=0` would ask for the whole node), and sbatch reads the MiB
#: count as a signed 64-bit integer.
_MEM_GB = bounds(ge=1 / 1024, le=2**53, note="GB: at least 1 MiB, as --mem counts whole MiB")


def parse_time_minutes(text: str) -> int:
    """Slurm time string (`MM`, `HH:MM:SS`, `D-HH[:MM[:SS]]`) to whole minutes, rounded up."""
    match = _TIME.fullmatch(text.strip())
    if not match:
        raise ConfigError("cluster.time", text, "minutes, HH:MM:SS or D-HH:MM:SS")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
    elif third is not None:  # HH:MM:SS
        hours, minutes, seconds = int(first), int(second), int(third)
    elif second is not None:  # MM:SS
        hours, minutes, seconds = 0, int(first), int(second)
    else:  # MM
        hours, minutes, seconds = 0, int(first), 0
    if (minutes >= 60 and (days is not None or third is not None)) or seconds >= 60:
        raise ConfigError("cluster.time", text, "minutes and seconds below 60 in HH:MM:SS")
    total_s = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    if total_s <= 0:
        raise ConfigError("cluster.time", text, "a positive duration")
    return -(-total_s // 60)


@dataclass
class VolumeConfig:
    """`cluster=kubernetes`: the shared volume the run dir lies on."""

    claim: Optional[str] = None
    """The ReadWriteMany PersistentVolumeClaim every pod mounts (required with cluster=kubernetes)."""
    mount_path: Optional[str] = None
    """Where the pods mount it: an absolute path under which the run dir must lie (required with
    cluster=kubernetes; mount the volume at the same path on the submit host)."""


#: The keys only conf/cluster/kubernetes.yaml sets: with another cluster the composed config has none of them, so
#: Hydra refuses `cluster.namespace=...` there as an unknown key rather than let it be ignored.
KUBERNETES_KEYS = frozenset({"namespace", "queue", "priority_class", "node_selector", "tolerations",
                             "service_account", "gpu_resource", "volume"})


@dataclass
class ClusterConfig(Checked):
    """Where the job runs and how long it may take."""

    name: str = field(default="auto", metadata=bounds(one_of=CLUSTERS))
    """local | debug | slurm | kubernetes (renders a JobSet: docs/guides/kubernetes.md); auto picks slurm when
    sbatch and a Slurm config are found, else local
    (on the submit side: `gpujobs.backends.resolve_cluster_name`; config.yaml holds the name it picked)."""
    partition: Optional[str] = field(default=None, metadata=bounds(pattern=NAME, allowed=NAME_TEXT))
    """Slurm partition (default: the cluster's default partition)."""
    account: Optional[str] = field(default=None, metadata=bounds(pattern=NAME, allowed=NAME_TEXT))
    """Slurm account to charge."""
    qos: Optional[str] = field(default=None, metadata=bounds(pattern=NAME, allowed=NAME_TEXT))
    """Slurm quality of service."""
    constraint: Optional[str] = field(default=None, metadata=bounds(pattern=_NAME_LIST, allowed=_NAME_LIST_TEXT))
    """Slurm node features the job needs (--constraint)."""
    exclude: Optional[str] = field(default=None, metadata=bounds(pattern=_NAME_LIST, allowed=_NAME_LIST_TEXT))
    """Slurm nodes to avoid (--exclude), e.g. node[3-4]."""
    time: str = "01:00:00"
    """Time limit: minutes, HH:MM:SS or D-HH:MM:SS."""
    signal_lead_s: int = field(
        default=DEFAULT_SIGNAL_LEAD_S,
        metadata=bounds(ge=0, le=SLURM_MAX_SIGNAL_LEAD_S, note="Slurm's --signal takes at most 65535 s"),
    )
    """Seconds before the time limit at which the job gets USR2 to checkpoint (below the limit less 30 s)."""
    wait: Optional[bool] = None
    """Follow the job to its end and exit with its status (default: true where the job runs here, false where a
    scheduler queues it: it may wait hours for its nodes)."""
    max_restarts: int = field(default=0, metadata=bounds(ge=0))
    """Failure budget: attempts that failed by themselves (exit code != 0, no signal) that may be retried."""
    max_preemptions: int = field(default=20, metadata=bounds(ge=0))
    """Preemption budget: times the job may be preempted (USR2 well before its time limit) and requeued."""
    max_timeouts: int = field(default=5, metadata=bounds(ge=0))
    """Time-limit budget: times the job may hit its time limit (USR2 near it) and be requeued."""
    max_unhealthy: int = field(default=3, metadata=bounds(ge=0))
    """Health budget: attempts that a failed health check ended (its node is excluded) before the job gives up."""
    health_check: bool = False
    """Before training, check every node's GPUs through NVML (uncorrectable ECC errors, pending retired
    pages or row remaps, XID events, temperature, thermal or power throttling) and time an all-reduce
    across the ranks; a failing node ends the attempt as `unhealthy`, is excluded, and the job is requeued."""
    health_min_busbw_gbps: float = field(default=0.0, metadata=bounds(ge=0, le=1e6))
    """Health check: the least all-reduce bus bandwidth (GB/s) the probe must reach (0: measured and
    recorded, never failed)."""
    health_probe_mb: float = field(default=16.0, metadata=bounds(gt=0, le=4096))
    """Health check: the size of the probe's all-reduce tensor, in MiB."""
    health_max_temp_c: float = field(default=90.0, metadata=bounds(gt=0, le=200))
    """Health check: the hottest a GPU may be at start (degrees C)."""
    folder: str = field(default="submitit", metadata=bounds(pattern=DIR_NAME, allowed=DIR_NAME_TEXT))
    """Sub-directory of the run dir for submitit's pickles and per-rank logs."""
    dry_run: bool = False
    """Slurm: print the exact sbatch script that would be queued (Kubernetes: the JobSet, for kubectl apply -f),
    and write and queue nothing."""
    array_parallelism: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Slurm sweeps (`-m`): at most this many points of the job array run at once (null: no limit)."""
    namespace: str = field(default="default", metadata=bounds(pattern=kube.DNS_LABEL, allowed=kube.DNS_LABEL_TEXT))
    """Kubernetes: the namespace of the JobSet."""
    queue: Optional[str] = field(default=None, metadata=bounds(pattern=kube.QUEUE_NAME, allowed=kube.QUEUE_NAME_TEXT))
    """Kubernetes: the Kueue LocalQueue (the `kueue.x-k8s.io/queue-name` label; null: no Kueue)."""
    priority_class: Optional[str] = field(
        default=None, metadata=bounds(pattern=kube.DNS_SUBDOMAIN, allowed=kube.DNS_SUBDOMAIN_TEXT))
    """Kubernetes: the pods' PriorityClass (priorityClassName; null: the cluster's default)."""
    node_selector: Optional[dict[str, str]] = None
    """Kubernetes: the labels a node must have (nodeSelector), label key -> value (null: any node)."""
    tolerations: list[dict[str, str]] = field(default_factory=list)
    """Kubernetes: taints the pods tolerate, each {key, operator (Equal | Exists), value, effect (NoSchedule |
    PreferNoSchedule | NoExecute)}."""
    service_account: Optional[str] = field(
        default=None, metadata=bounds(pattern=kube.DNS_SUBDOMAIN, allowed=kube.DNS_SUBDOMAIN_TEXT))
    """Kubernetes: the pods' ServiceAccount (null: the namespace's default)."""
    gpu_resource: str = field(
        default="nvidia.com/gpu", metadata=bounds(pattern=kube.EXTENDED_RESOURCE, allowed=kube.EXTENDED_RESOURCE_TEXT))
    """Kubernetes: the extended resource each pod asks `resources.gpus_per_node` of (a MIG profile's, an MPS or
    vGPU scheduler's name where the site shares GPUs that way)."""
    volume: VolumeConfig = field(default_factory=VolumeConfig)
    """Kubernetes: the shared volume of the run dir (`claim`, `mount_path`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_kubernetes()
        try:
            limit_s = parse_time_minutes(self.time) * 60
        except ConfigError as err:
            raise ConfigError("time", self.time, err.allowed) from None
        if self.signal_lead_s + SLURM_LIMIT_CHECK_S >= limit_s:
            # slurmctld sends --signal at its first limit check with less than lead + 30 s left: a longer
            # lead would stop every attempt as it starts and spend the time-limit budget on nothing. The
            # lead left at its default is not what the user set: the time is.
            if self.signal_lead_s == DEFAULT_SIGNAL_LEAD_S:
                least = self.signal_lead_s + SLURM_LIMIT_CHECK_S
                slurm_reads = (f"; {self.time} is minutes:seconds to Slurm, {limit_s // 60} whole minutes"
                               if _MM_SS.fullmatch(self.time) else "")
                raise ConfigError(
                    "time", self.time,
                    f"more than {least} s (cluster.signal_lead_s={self.signal_lead_s} plus the "
                    f"{SLURM_LIMIT_CHECK_S} s by which Slurm may send the signal early{slurm_reads}), "
                    "or a smaller cluster.signal_lead_s",
                )
            raise ConfigError(
                "signal_lead_s", self.signal_lead_s,
                f"below {limit_s - SLURM_LIMIT_CHECK_S} s with time={self.time} (the time limit less the "
                f"{SLURM_LIMIT_CHECK_S} s by which Slurm may send the signal early)",
            )

    def _check_kubernetes(self) -> None:
        """The Kubernetes keys that are more than one name: node labels, tolerations, the volume."""
        kube.check_node_selector("node_selector", self.node_selector or {})
        for index, toleration in enumerate(self.tolerations):
            kube.check_toleration(f"tolerations[{index}]", toleration)
        claim, mount = self.volume.claim, self.volume.mount_path
        if claim is not None and not kube.DNS_SUBDOMAIN.fullmatch(claim):
            raise ConfigError("volume.claim", claim, f"a PersistentVolumeClaim name: {kube.DNS_SUBDOMAIN_TEXT}")
        if mount is not None and (not mount.startswith("/") or ":" in mount or _CONTROL_OR_SPACE.search(mount)):
            raise ConfigError("volume.mount_path", mount, "an absolute path without ':' or whitespace")

    @property
    def timeout_min(self) -> int:
        """The time limit in minutes."""
        return parse_time_minutes(self.time)


@dataclass
class ResourcesConfig(Checked):
    """What one job asks for. One rank per GPU; CPU ranks (gloo) where there is no GPU."""

    nodes: int = field(default=1, metadata=bounds(ge=1))
    """Number of nodes (their ranks, at most 2,147,483,647 in all: torch counts ranks in a C int; Slurm's
    partition bounds them at submit)."""
    gpus_per_node: int = field(default=0, metadata=bounds(ge=0, le=SLURM_MAX_PER_NODE, note=_PER_NODE))
    """GPUs per node; each gets one rank."""
    procs_per_node: Optional[int] = field(default=None, metadata=bounds(ge=1, le=SLURM_MAX_PER_NODE, note=_PER_NODE))
    """Ranks per node when gpus_per_node is 0 (CPU ranks with gloo); default 1. With GPUs, at most
    gpus_per_node (one rank per GPU: more would not run)."""
    cpus_per_task: Optional[int] = field(
        default=None, metadata=bounds(ge=1, le=SLURM_MAX_PER_NODE, note="Slurm keeps it in 16 bits")
    )
    """CPU cores per rank (also the torch thread count). null: derived at submit (`derived_cpus`): 1 for CPU
    ranks; for GPU ranks a node's CPUs / its ranks, at most 8, from the nodes as the preflight sees them (the
    partition's for Slurm, this machine's for a local run); the value is printed and kept in config.yaml."""
    mem_gb: Optional[float] = field(default=None, metadata=_MEM_GB)
    """Memory per node in GB (default: the cluster's default); at least 1/1024 (1 MiB: Slurm's --mem counts whole
    MiB)."""
    pick_gpus: bool = False
    """Local runs: false uses GPUs 0..gpus_per_node-1; true picks the least-loaded GPUs (NVML)."""
    min_free_gpu_mem_gb: float = field(default=0.0, metadata=bounds(ge=0))
    """Local runs with pick_gpus: a GPU needs at least this much free memory to be picked."""
    gpu_mem_gib: Optional[float] = field(default=None, metadata=bounds(gt=0, le=2**40))
    """Memory of one GPU in GiB, for the memory plan (`gpujobs plan`, checked at submit): null reads it from
    NVML where the job's GPUs are this machine's; elsewhere the plan needs it to tell whether a model fits."""
    host_mem_gib: Optional[float] = field(default=None, metadata=bounds(gt=0, le=2**40))
    """Host memory of one node in GiB that the ranks may use, for the memory plan (null: resources.mem_gb
    where set, else this machine's for a local job; unknown elsewhere)."""
    min_nodes: Optional[int] = field(default=None, metadata=bounds(ge=1))
    """Elastic Slurm jobs: start (and come back after a requeue) on as few as this many nodes,
    `--nodes=MIN-MAX` with MAX = nodes; the world size is read from the allocation at start (default:
    nodes, a fixed allocation)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ConfigError("min_nodes", self.min_nodes, f"1..{self.nodes} (resources.nodes is the most)")
        if self.world_size > MAX_WORLD_SIZE:  # ranks per node stop at 65533: only nodes take the world past it
            most = MAX_WORLD_SIZE // self.ranks_per_node
            raise ConfigError("nodes", self.nodes, f"at most {most} with {self.ranks_per_node} ranks a node "
                                                   f"(torch.distributed counts ranks in a C int: {MAX_WORLD_SIZE})")
        gpus, procs = self.gpus_per_node, self.procs_per_node
        if gpus and procs is not None and procs > gpus:
            raise ConfigError(
                "gpus_per_node", gpus,
                f"0 for resources.procs_per_node={procs} CPU ranks, or at least {procs} for as many GPU ranks "
                f"(one rank per GPU: {gpus} GPUs run {gpus} ranks; for that, set resources.procs_per_node={gpus})",
            )

    @property
    def cpus(self) -> int:
        """CPUs per rank: `cpus_per_task`, which the submit side derives where null; 1 where no submit did (a
        config a benchmark builds itself)."""
        return self.cpus_per_task if self.cpus_per_task is not None else 1

    def derived_cpus(self, node_cpus: Optional[int]) -> tuple[int, str]:
        """The CPUs per rank that `cpus_per_task: null` means on nodes of `node_cpus` CPUs (None: unknown),
        and why, in words: GPU ranks share the node's CPUs, at most `GPU_RANK_CPUS_CAP` each; CPU ranks get 1."""
        if not self.gpus_per_node:
            return 1, "CPU ranks"
        if node_cpus is None:
            return 1, "the nodes' CPUs are unknown here: set resources.cpus_per_task"
        cpus = max(1, min(GPU_RANK_CPUS_CAP, node_cpus // self.ranks_per_node))
        return cpus, f"{node_cpus} CPUs a node / {self.ranks_per_node} GPU ranks, at most {GPU_RANK_CPUS_CAP}"

    @property
    def least_nodes(self) -> int:
        """The fewest nodes the job runs on (min_nodes, else nodes)."""
        return self.min_nodes if self.min_nodes is not None else self.nodes

    @property
    def ranks_per_node(self) -> int:
        """One rank per GPU, else procs_per_node CPU ranks."""
        if self.gpus_per_node > 0:
            return self.gpus_per_node
        return self.procs_per_node or 1

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.ranks_per_node

    @property
    def held_per_rank(self) -> dict[str, Any]:
        """What each rank holds, as an attempt's line says it for the GPU-hour ledger: one GPU, or
        `cpus_per_task` CPUs for CPU ranks (`unit`, `per_rank`)."""
        return {"unit": "gpu", "per_rank": 1} if self.gpus_per_node else {"unit": "cpu", "per_rank": self.cpus}
