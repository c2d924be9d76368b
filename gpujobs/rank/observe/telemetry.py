"""The training loop's one telemetry hook: straggler check, Prometheus, the node's GPU sampler.

The trainer calls `before_step()` and `step(record)`; everything else (who samples, who serves,
when to warn) is decided here. Torch-free: it learns each rank's node and GPU from the table that
the entry gathers once at start.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional

from gpujobs.attempt.preemption import slurm_job_id
from gpujobs.backends import backend_for
from gpujobs.backends.jobenv import DistInfo
from gpujobs.config.load import JobConfig, TelemetryConfig
from gpujobs.rank.observe.gpu_sampler import GpuSampler, SampleSink
from gpujobs.rank.observe.prometheus import PrometheusExporter
from gpujobs.rank.observe.straggler import Peer, StragglerCheck
from gpujobs.rundir.gpu_files import GpuFilesTail, gpu_file
from gpujobs.rundir.records import MetricsRecord, TrainRecord

log = logging.getLogger(__name__)

class Telemetry:
    """Per-rank telemetry state; `Telemetry()` alone is the quiet default (straggler check only)."""

    def __init__(
        self,
        cfg: Optional[TelemetryConfig] = None,
        info: Optional[DistInfo] = None,
        peers: Optional[list[Peer]] = None,
        balance: str = "off",
    ) -> None:
        self.cfg = cfg or TelemetryConfig()
        rank = info.rank if info is not None else 0
        self.slow_s = self.cfg.debug_slow_ms / 1000 if self.cfg.debug_slow_rank == rank else 0.0
        self.straggler = StragglerCheck(self.cfg.imbalance_threshold, peers or [], warn=rank == 0, balance=balance)
        self.exporter: Optional[PrometheusExporter] = None
        self.sampler: Optional[GpuSampler] = None
        self.other_nodes: Optional[OtherNodesGpus] = None

    @classmethod
    def start(
        cls, job: JobConfig, info: DistInfo, ranks: list[dict[str, Any]], on_gpu: bool, run_dir: Path
    ) -> Telemetry:
        """Start the endpoint (rank 0) and the node's sampler (local rank 0).

        `ranks` is every rank's place, from `distributed.gather_ranks`; `on_gpu`: ranks use CUDA.
        """
        cfg = job.telemetry
        peers = [Peer.from_rank(entry, on_gpu) for entry in ranks]
        self = cls(cfg, info, peers, job.trainer.balance)
        if info.is_main and cfg.prometheus_port is not None:
            self.exporter = PrometheusExporter(job.name, peers)
            sd_dir = Path(cfg.prometheus_sd_dir) if cfg.prometheus_sd_dir is not None else None
            # the Slurm id only under Slurm: a local run inside an allocation is no Slurm job of its own
            labels = {"node": info.node, "slurm_job_id": (slurm_job_id() or "") if backend_for(job).queues else ""}
            self.exporter.start(cfg.prometheus_port, cfg.prometheus_addr, run_dir, sd_dir, labels,
                                cfg.imbalance_threshold)
        if info.local_rank == 0 and cfg.gpu:
            # by uuid: a rank's CUDA index is its own process's (Slurm binding one GPU per task makes every
            # rank's GPU its cuda:0), and NVML's index is the node's
            on_node = {e["gpu_uuid"]: int(e["rank"]) for e in ranks if e["node"] == info.node and e.get("gpu_uuid")}
            sink = self.exporter.observe_gpus if self.exporter is not None else None
            self.sampler = GpuSampler(gpu_file(run_dir, info.node), cfg.interval_s, info.node, on_node, sink)
            if not self.sampler.start():
                self.sampler = None
        if self.exporter is not None and cfg.gpu and len({p.node for p in peers}) > 1:
            self.other_nodes = OtherNodesGpus(run_dir, info.node, self.exporter.observe_gpus, cfg.interval_s)
        if self.slow_s:
            log.warning("debug: rank %d sleeps %.0f ms every step (telemetry.debug_slow_rank)", info.rank,
                        cfg.debug_slow_ms)
        if cfg.debug_slow_rank == info.rank and cfg.debug_slow_factor > 1:
            log.warning("debug: rank %d computes %gx slower (telemetry.debug_slow_factor)", info.rank,
                        cfg.debug_slow_factor)
        return self

    def before_step(self) -> None:
        """Called where the step waits for data: the debug straggler sleeps here, like a slow input pipeline."""
        if self.slow_s:
            time.sleep(self.slow_s)

    def step(self, record: MetricsRecord) -> MetricsRecord:
        """A metrics record is about to be written: returns it as written (a train record annotated by the
        straggler check); feeds the endpoint (train, eval and checkpoint records: the alerts ask how long
        ago the last step and the last checkpoint were)."""
        if isinstance(record, TrainRecord):
            record, _ = self.straggler.check(record)
        if self.exporter is not None:
            self.exporter.observe(record)
        return record

    def close(self) -> None:
        """Stop the samplers and the endpoint (after `prometheus_linger_s`)."""
        if self.other_nodes is not None:
            self.other_nodes.stop()
            self.other_nodes = None
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
        if self.exporter is not None:
            self.exporter.close(self.cfg.prometheus_linger_s)
            self.exporter = None


class OtherNodesGpus:
    """Rank 0's endpoint serves every node's GPUs: the other nodes' samplers append to their files in the run
    dir (`gpu.<node>.jsonl`), which a thread here follows (every `interval_s`), passing their samples to `sink`.

    Rank 0's own node reaches the endpoint straight from its sampler; the others' samples arrive within
    one interval of being written. Only samples written from now on count (an earlier attempt's are stale).
    """

    def __init__(self, run_dir: Path, own_node: str, sink: SampleSink, interval_s: float) -> None:
        self._tail = GpuFilesTail(run_dir, skip=frozenset({gpu_file(run_dir, own_node)}))
        self._own_node = own_node
        self._sink = sink
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), name="gpujobs-gpu-nodes", daemon=True)
        self._thread.start()

    def poll(self) -> None:
        """Pass on the other nodes' samples written since the last poll."""
        samples = [r for r in self._tail.poll() if r.get("node") != self._own_node and "uuid" in r and "gpu" in r]
        if samples:
            self._sink(samples)

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.poll()
            except Exception:  # telemetry must never take the job down
                log.exception("reading the other nodes' GPU samples failed; their series stop here")
                return

    def stop(self) -> None:
        """Stop following (at most one poll in progress is waited for)."""
        self._stop.set()
        self._thread.join(timeout=5)
