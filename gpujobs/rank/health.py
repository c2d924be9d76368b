"""The health check at start (`cluster.health_check`): a sick node ends the attempt before training does.

Before the task is built and before any checkpoint is restored, so a sick node costs seconds, not a
restore and a step:

1. local rank 0 of each node asks NVML about the node's GPUs (those its ranks see): uncorrectable ECC
   errors, pending retired pages or row remaps, a failed remap, the temperature against
   `cluster.health_max_temp_c`, hardware or thermal throttling (`nvml.gpu_faults`), and XID events
   that come while the probe runs (NVML reports XIDs only as events, from registration on);
2. every rank takes part in an all-reduce bandwidth probe: `cluster.health_probe_mb` MiB, a warm-up,
   then timed rounds; bus bandwidth = 2(n-1)/n x bytes / seconds per round (nccl-tests' definition:
   what each link carries), held against `cluster.health_min_busbw_gbps` (0: recorded, never failed);
3. the ranks gather their findings and each decides from the same list (`decide`), so they all end
   the attempt, or all go on, together.

A failing check ends the attempt as `unhealthy`: rank 0 records it, naming the GPU (index and uuid) or
the link, the node (which `record_attempt` excludes on Slurm) and a rank on it; every rank then exits
as a preempted rank does. Where there is no NVML the NVML part says so in the log and passes; the
probe and the decision run for real (gloo on the CPU). Rank 0 writes the outcome to metrics.jsonl (a
`health` record) either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from gpujobs.backends.jobenv import DistInfo
from gpujobs.base.nvml import (
    NvmlUnavailable,
    VisibleGpu,
    XidWatcher,
    gpu_faults,
    gpus_by_uuid,
    listed_gpus,
    nvml_session,
)
from gpujobs.config.load import ClusterConfig, JobConfig
from gpujobs.rank import collectives
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rundir.records import HealthRecord

log = logging.getLogger(__name__)

#: Probe rounds: the first ones set up the transport (NCCL's channels, gloo's pairs) and are not timed.
WARMUP_ROUNDS, TIMED_ROUNDS = 2, 5


@dataclass(frozen=True)
class Finding:
    """What one rank found: its NVML look at the node (local rank 0 only) and its probe time."""

    rank: int
    node: str
    nvml: Optional[str] = None
    """Local rank 0: what NVML could check ("2 GPUs checked", "NVML unavailable: ..."); else None."""
    gpus_checked: int = 0
    faults: list[str] = field(default_factory=list)
    """One entry per sick GPU: "GPU 1 (GPU-...): 2 uncorrectable ECC errors"."""
    probe_s: Optional[float] = None
    """Seconds per timed probe round; None without a process group."""


@dataclass(frozen=True)
class Verdict:
    """The decision every rank reaches from the same findings."""

    healthy: bool
    busbw_gbps: Optional[float]
    """The probe's bus bandwidth (GB/s) over the slowest rank's round time; None with one rank."""
    health_s: float = 0.0
    """Seconds the check took, gathering included (so the slowest rank's time)."""
    error: Optional[str] = None
    """What failed, naming the GPU (index and uuid) or the link, and the node."""
    node: Optional[str] = None
    culprit_rank: Optional[int] = None
    nvml: list[str] = field(default_factory=list)
    """Per node: what NVML could check there."""
    faults: list[str] = field(default_factory=list)
    """Every sick GPU, "node: GPU i (uuid): ...", in rank order."""


def decide(findings: list[Finding], min_busbw_gbps: float, probe_bytes: int) -> Verdict:
    """The verdict of the gathered `findings` (rank order): sick GPUs first, then the probe's threshold.

    A pure function of its arguments, so every rank reaches the same one. The attempt's line has one
    node: the first sick one (the error names them all). A slow link has no one node to blame: the
    slowest rank's is named (with one node, that node).
    """
    world = len(findings)
    times = [f.probe_s for f in findings if f.probe_s is not None]
    slowest_s = max(times) if times else None
    busbw = (2 * (world - 1) / world * probe_bytes / slowest_s / 1e9) if world > 1 and slowest_s else None
    nvml = [f"{f.node}: {f.nvml}" for f in findings if f.nvml is not None]
    sick = [f for f in findings if f.faults]
    faults = [f"{f.node}: {fault}" for f in sick for fault in f.faults]
    base = Verdict(True, busbw, nvml=nvml, faults=faults)
    if sick:
        first = sick[0]
        error = f"unhealthy GPU on {first.node}: {'; '.join(first.faults)}"
        others = sorted({f.node for f in sick[1:]} - {first.node})
        if others:
            error += f" (and on {', '.join(others)})"
        return dataclasses.replace(base, healthy=False, error=error, node=first.node, culprit_rank=first.rank)
    if busbw is not None and min_busbw_gbps > 0 and busbw < min_busbw_gbps:
        slow = max(findings, key=lambda f: (f.probe_s or 0.0, -f.rank))
        nodes = sorted({f.node for f in findings})
        error = (
            f"slow link: all-reduce bus bandwidth {busbw:.3g} GB/s across {world} ranks on {', '.join(nodes)}, "
            f"below cluster.health_min_busbw_gbps={min_busbw_gbps:g} (slowest: rank {slow.rank} on {slow.node})"
        )
        return dataclasses.replace(base, healthy=False, error=error, node=slow.node, culprit_rank=slow.rank)
    return base


def gate(
    job: JobConfig, run_dir: str, info: DistInfo, device: torch.device, ranks: list[dict[str, Any]],
    metrics: MetricsLog, attempt_started: float,
) -> float:
    """Run the check on every rank; returns its seconds when the ranks may train. When it fails, rank 0
    records the attempt as `unhealthy` (and `record_attempt` excludes the node and requeues within
    `cluster.max_unhealthy`), and every rank raises SystemExit(EXIT_REQUEUED), as a preempted rank does."""
    from gpujobs.attempt.preemption import EXIT_REQUEUED, record_attempt

    verdict = check(job.cluster, info, device, ranks)
    if info.is_main:
        metrics.write(health_record(verdict, job.cluster, info.world_size))
    if verdict.healthy:
        return verdict.health_s
    if info.is_main:
        record_attempt(
            run_dir, job, "unhealthy", start=round(attempt_started, 3), error=verdict.error, node=verdict.node,
            culprit_rank=verdict.culprit_rank, health_s=round(verdict.health_s, 3), world_size=info.world_size,
            steps_done=0,
        )
    log.error("health check failed: %s; this attempt ends before training", verdict.error)
    raise SystemExit(EXIT_REQUEUED)


def check(cluster: ClusterConfig, info: DistInfo, device: torch.device, ranks: list[dict[str, Any]]) -> Verdict:
    """This rank's part of the check, then the gathered decision (a collective: call it on every rank)."""
    started = time.monotonic()
    probe_bytes = _probe_numel(cluster.health_probe_mb) * 4
    with contextlib.ExitStack() as stack:
        look = None
        if info.local_rank == 0:  # one look per node
            look = _NodeLook.open(stack, cluster.health_max_temp_c, ranks, info.node)
        probe_s = _probe(cluster.health_probe_mb, device)  # XIDs that come meanwhile are seen below
        nvml, checked, faults = look.finish() if look is not None else (None, 0, [])
    if nvml is not None:
        log.info("health: NVML on %s: %s%s", info.node, nvml, f"; faults: {'; '.join(faults)}" if faults else "")
    mine = Finding(info.rank, info.node, nvml, checked, faults, probe_s)
    findings = [Finding(**entry) for entry in collectives.all_gather_objects(dataclasses.asdict(mine))]
    verdict = dataclasses.replace(decide(findings, cluster.health_min_busbw_gbps, probe_bytes),
                                  health_s=time.monotonic() - started)
    if info.is_main:
        bandwidth = f"{verdict.busbw_gbps:.3g} GB/s" if verdict.busbw_gbps is not None else "not measured (one rank)"
        log.info("health: all-reduce bus bandwidth %s (%g MiB x %d rounds); check took %.2f s; %s",
                 bandwidth, cluster.health_probe_mb, TIMED_ROUNDS, verdict.health_s,
                 "healthy" if verdict.healthy else verdict.error)
    return verdict


def health_record(verdict: Verdict, cluster: ClusterConfig, world_size: int) -> HealthRecord:
    """The `health` record of metrics.jsonl that says how the check went."""
    return HealthRecord(
        healthy=verdict.healthy, health_s=round(verdict.health_s, 3),
        busbw_gbps=None if verdict.busbw_gbps is None else round(verdict.busbw_gbps, 4),
        min_busbw_gbps=cluster.health_min_busbw_gbps, probe_mb=cluster.health_probe_mb, world_size=world_size,
        nvml=verdict.nvml, faults=verdict.faults, error=verdict.error, node=verdict.node,
    )


def _probe_numel(probe_mb: float) -> int:
    return max(1, int(probe_mb * 2**20) // 4)  # float32 elements


def _probe(probe_mb: float, device: torch.device) -> Optional[float]:
    """Seconds per all-reduce round of `probe_mb` MiB on the training device; None without a group."""
    if not collectives.active():
        return None
    # zeros: the sum never grows, and the links carry the same bytes whatever the values
    tensor = torch.zeros(_probe_numel(probe_mb), dtype=torch.float32, device=device)
    for _ in range(WARMUP_ROUNDS):
        collectives.sum_in_place(tensor)
    _sync(device)
    collectives.barrier()  # every rank starts the timed rounds together
    started = time.perf_counter()
    for _ in range(TIMED_ROUNDS):
        collectives.sum_in_place(tensor)
    _sync(device)  # NCCL returns before the GPU is done
    return (time.perf_counter() - started) / TIMED_ROUNDS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _node_gpus(nv: Any, ranks: list[dict[str, Any]], node: str) -> list[VisibleGpu]:
    """The GPUs of the ranks on `node`: by the uuids they reported (a rank's CUDA index is its own
    process's; Slurm's device cgroups renumber from 0 while NVML keeps the node's numbers), else (CPU
    ranks) those their CUDA_VISIBLE_DEVICES names."""
    uuids = [entry["gpu_uuid"] for entry in ranks if entry["node"] == node and entry.get("gpu_uuid")]
    return gpus_by_uuid(nv, uuids) if uuids else listed_gpus(nv, _node_visible(ranks, node))


def _node_visible(ranks: list[dict[str, Any]], node: str) -> Optional[str]:
    """The GPUs the ranks on `node` see, as one CUDA_VISIBLE_DEVICES value (None: every GPU)."""
    entries: list[str] = []
    for entry in ranks:
        if entry["node"] != node:
            continue
        listed = entry.get("cuda_visible_devices")
        if listed is None:
            return None
        entries += [e.strip() for e in listed.split(",") if e.strip() and e.strip() not in entries]
    return ",".join(entries)


class _NodeLook:
    """NVML's part, on local rank 0: opened before the probe (so XIDs during it are seen), read after."""

    def __init__(self, nv: Any, gpus: list[VisibleGpu], max_temp_c: float, xids: Optional[XidWatcher],
                 unavailable: Optional[str] = None) -> None:
        self.nv, self.gpus, self.max_temp_c, self.xids, self.unavailable = nv, gpus, max_temp_c, xids, unavailable

    @classmethod
    def open(cls, stack: contextlib.ExitStack, max_temp_c: float, ranks: list[dict[str, Any]], node: str) -> _NodeLook:
        """Open NVML (closed with `stack`) and watch the GPUs of the ranks on `node` for XID events."""
        try:
            nv = stack.enter_context(nvml_session())
        except NvmlUnavailable as err:
            return cls(None, [], max_temp_c, None, f"NVML unavailable ({err}): GPU checks skipped")
        gpus = _node_gpus(nv, ranks, node)
        xids = XidWatcher(nv, gpus)
        stack.callback(xids.close)
        return cls(nv, gpus, max_temp_c, xids)

    def finish(self) -> tuple[str, int, list[str]]:
        """(what was checked, GPUs checked, one fault line per sick GPU)."""
        if self.unavailable is not None:
            return self.unavailable, 0, []
        if not self.gpus:
            return "no GPU visible to the ranks here: nothing for NVML to check", 0, []
        xids = self.xids.poll() if self.xids is not None else {}
        faults = []
        for gpu in self.gpus:
            found = gpu_faults(self.nv, gpu.handle, self.max_temp_c)
            if xids.get(gpu.uuid):
                found.append(f"XID {', '.join(str(x) for x in xids[gpu.uuid])}")
            if found:
                faults.append(f"GPU {gpu.index} ({gpu.uuid}): {', '.join(found)}")
        return f"{len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''} checked", len(self.gpus), faults
