"""Straggler detection: which rank holds the others back, from the timings the trainer gathers (torch-free).

Synchronous DDP makes every rank's step time equal: the fast ranks wait inside the gradient
all-reduce for the slowest one. So the signal is each rank's *local* time, its own part of the step
before it waits for the others; imbalance = slowest / median. The trainer measures it with the compute
clock (`compute_clock`: data, forward and backward up to the rank's last gradient bucket) where that
runs: always on GPUs, where the host clock would include the wait (a blocking copy to the GPU waits
for the last all-reduce), and on the CPU with dynamic balancing or the slow-GPU emulation. Elsewhere,
to spare the clock's hook, it is the host clock's data wait + forward pass, before any collective.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from dataclasses import dataclass
from typing import Any, Optional

from gpujobs.rundir.records import TrainRecord

log = logging.getLogger(__name__)

#: Warn only when the straggler also costs something: the others wait at least this share of a step.
#: Without it, sub-millisecond noise between fast ranks would read as a 1.3x "imbalance".
MIN_WAIT_SHARE = 0.10


@dataclass(frozen=True)
class Peer:
    """Where one rank runs: gathered from every rank once, at start."""

    rank: int
    node: str
    gpu: str
    """The GPU by the uuid its rank reported (the one name that holds in every process, whatever Slurm's
    device cgroup renumbered), else its entry in CUDA_VISIBLE_DEVICES; "cpu" on CPU ranks."""

    @classmethod
    def from_rank(cls, entry: dict[str, Any], on_gpu: bool) -> Peer:
        """From one entry of `distributed.gather_ranks`."""
        if not on_gpu:
            return cls(int(entry["rank"]), str(entry["node"]), "cpu")
        if entry.get("gpu_uuid"):
            return cls(int(entry["rank"]), str(entry["node"]), str(entry["gpu_uuid"]))
        listed = entry.get("cuda_visible_devices")
        visible = [e.strip() for e in (listed or "").split(",") if e.strip()]
        local_rank = int(entry["local_rank"])
        return cls(int(entry["rank"]), str(entry["node"]), visible[local_rank % len(visible)] if visible
                   else str(local_rank))

    def where(self) -> str:
        """`rank 1 (node n1, GPU-8f3c...)` (`GPU 3` where no uuid was reported), for log lines."""
        named = self.gpu.startswith(("GPU-", "MIG-"))  # a uuid says what it is
        device = "CPU" if self.gpu == "cpu" else self.gpu if named else f"GPU {self.gpu}"
        return f"rank {self.rank} (node {self.node}, {device})"


def _counts_text(record: TrainRecord) -> str:
    return f" (rows per rank now {record.counts})" if record.counts else ""


def imbalance(local_times: list[float]) -> tuple[float, int]:
    """(slowest / median, the slowest rank); (1.0, 0) when there is nothing to compare."""
    median = statistics.median(local_times) if local_times else 0.0
    if len(local_times) < 2 or median <= 0:
        return 1.0, 0
    slowest = max(range(len(local_times)), key=local_times.__getitem__)
    return local_times[slowest] / median, slowest


class StragglerCheck:
    """Adds `imbalance` and `slowest_rank` to each train record; warns (on rank 0) above the threshold."""

    def __init__(self, threshold: float, peers: list[Peer], warn: bool, balance: str = "off") -> None:
        self.threshold = threshold
        self.peers = peers
        self.warn = warn
        self.balance = balance
        """trainer.balance: the warning says whether balancing is on."""

    def check(self, record: TrainRecord) -> tuple[TrainRecord, Optional[str]]:
        """`record` with its `imbalance` and `slowest_rank`, and the warning text when the slowest rank is
        over the threshold (else None)."""
        times = record.local_time_s
        ratio, slowest = imbalance(times)
        record = dataclasses.replace(record, imbalance=round(ratio, 3), slowest_rank=slowest)
        if ratio <= self.threshold:
            return record, None
        step_s = statistics.median(record.step_time_s or times)
        wait_share = (times[slowest] - statistics.median(times)) / step_s if step_s > 0 else 0.0
        if wait_share < MIN_WAIT_SHARE:
            return record, None
        peer = self.peers[slowest] if slowest < len(self.peers) else Peer(slowest, "?", "?")
        message = (
            f"straggler at step {record.step}: {peer.where()} is {ratio:.2f}x the median local step time "
            f"({times[slowest]:.4f} s vs {statistics.median(times):.4f} s; threshold {self.threshold:g}); "
            f"the others wait {wait_share:.0%} of each step for it; {self._balancing(record)}"
        )
        if self.warn:
            log.warning(message)
        return record, message

    def _balancing(self, record: TrainRecord) -> str:
        if self.balance == "off":
            return "balancing is off (trainer.balance=dynamic would give it fewer rows)"
        if self.balance == "dynamic":
            return f"balancing is dynamic{_counts_text(record)}: its share shrinks at the next updates"
        return f"balancing is {self.balance}{_counts_text(record)}, which does not follow measured speed"
