"""Rank 0's Prometheus endpoint: job metrics and its node's GPU telemetry, for scraping (torch-free).

Rank 0 has every rank's gathered timings, so one endpoint serves the whole job's step, loss,
throughput, per-rank step time and imbalance. GPU series come from the sampler in the same process,
so they cover rank 0's node; other nodes' GPUs are in gpu.jsonl (every node's sampler appends there).
With `telemetry.prometheus_port=0` the OS picks the port; the URL is always written to
`<run_dir>/prometheus.json` so a scraper (or a test) can find it. The endpoint listens on
`telemetry.prometheus_addr` (loopback by default: the metrics name nodes and jobs); listening on
every interface is logged as a warning.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from gpujobs.atomic import write_text_atomic
from gpujobs.run.straggler import Peer
from gpujobs.rundir import PROMETHEUS_FILE

log = logging.getLogger(__name__)

_ALL_INTERFACES = ("0.0.0.0", "::", "")
_RANK_LABELS = ("job", "rank", "node", "gpu")
_GPU_LABELS = ("job", "node", "gpu", "uuid", "rank")
# gpu.jsonl field -> (metric name, help, scale to the metric's unit)
_GPU_FIELDS: dict[str, tuple[str, str, float]] = {
    "util_pct": ("gpujobs_gpu_utilization_percent", "GPU utilization", 1.0),
    "mem_util_pct": ("gpujobs_gpu_memory_utilization_percent", "GPU memory bandwidth utilization", 1.0),
    "mem_used_mib": ("gpujobs_gpu_memory_used_bytes", "GPU memory used", 2**20),
    "mem_total_mib": ("gpujobs_gpu_memory_total_bytes", "GPU memory total", 2**20),
    "temp_c": ("gpujobs_gpu_temperature_celsius", "GPU temperature", 1.0),
    "power_w": ("gpujobs_gpu_power_watts", "GPU power draw", 1.0),
    "power_limit_w": ("gpujobs_gpu_power_limit_watts", "GPU power limit", 1.0),
    "sm_clock_mhz": ("gpujobs_gpu_sm_clock_mhz", "GPU SM clock", 1.0),
    "ecc_uncorrected": ("gpujobs_gpu_ecc_uncorrected_errors", "Uncorrected ECC errors (volatile)", 1.0),
}


class PrometheusExporter:
    """Gauges in a registry of their own, served over HTTP from a daemon thread."""

    def __init__(self, job_name: str, peers: list[Peer]) -> None:
        self.job_name = job_name
        self.peers = peers
        self.registry = CollectorRegistry()
        reg = self.registry
        self.step = Gauge("gpujobs_step", "Optimizer steps done", ["job"], registry=reg)
        self.loss = Gauge("gpujobs_loss", "Training loss (mean over ranks, last log window)", ["job"], registry=reg)
        self.samples = Gauge("gpujobs_samples_per_second", "Training throughput, all ranks", ["job"], registry=reg)
        self.imbalance = Gauge("gpujobs_imbalance", "Slowest rank's local step time / median", ["job"], registry=reg)
        self.step_time = Gauge("gpujobs_step_time_seconds", "Mean step time per rank", _RANK_LABELS, registry=reg)
        self.data_time = Gauge("gpujobs_data_time_seconds", "Mean data wait per step", _RANK_LABELS, registry=reg)
        self.local_time = Gauge(
            "gpujobs_local_time_seconds", "Mean data wait + forward per step (before the gradient sync)",
            _RANK_LABELS, registry=reg,
        )
        self.eval = Gauge("gpujobs_eval", "Last evaluation result", ["job", "metric"], registry=reg)
        self.gpu = {
            key: Gauge(name, doc, _GPU_LABELS, registry=reg) for key, (name, doc, _) in _GPU_FIELDS.items()
        }
        self._server: Any = None

    def start(self, port: int, addr: str, run_dir: Path) -> str:
        """Serve on `addr`:`port` (0: a free port); write the URL to prometheus.json; return the URL.

        The URL names the address the socket is bound to ("localhost" becomes 127.0.0.1), or the
        node's host name when it listens on every interface (a wildcard is no address to scrape).
        """
        # "" means every interface, as in socket.bind; prometheus_client cannot resolve it
        server, _ = start_http_server(port, addr=addr or "0.0.0.0", registry=self.registry)
        self._server = server
        bound = str(server.server_address[0])
        if bound in _ALL_INTERFACES:
            # anyone who can reach the node can read the job's metrics: say so where the user looks
            log.warning("Prometheus endpoint listens on every interface (%r); set telemetry.prometheus_addr="
                        "127.0.0.1 to keep it on this node", addr)
            host = socket.gethostname()
        else:
            host = f"[{bound}]" if ":" in bound else bound
        url = f"http://{host}:{server.server_port}/metrics"
        info = {"url": url, "addr": bound, "port": server.server_port, "node": socket.gethostname(),
                "job": self.job_name}
        write_text_atomic(run_dir / PROMETHEUS_FILE, json.dumps(info) + "\n")
        log.info("Prometheus metrics at %s", url)
        return url

    def observe(self, record: dict[str, Any]) -> None:
        """Update the gauges from a metrics record (train or eval)."""
        job = self.job_name
        if record.get("kind") == "eval":
            for key, value in record.items():
                if key not in ("kind", "step", "time") and isinstance(value, (int, float)):
                    self.eval.labels(job, key).set(value)
            return
        self.step.labels(job).set(record["step"])
        self.loss.labels(job).set(record["loss"])
        self.samples.labels(job).set(record["samples_per_s"])
        if "imbalance" in record:
            self.imbalance.labels(job).set(record["imbalance"])
        for gauge, key in ((self.step_time, "step_time_s"), (self.data_time, "data_time_s"),
                           (self.local_time, "local_time_s")):
            for rank, value in enumerate(record.get(key) or []):
                gauge.labels(*self._rank_labels(rank)).set(value)

    def observe_gpus(self, samples: list[dict[str, Any]]) -> None:
        """Update the GPU gauges from one sampler sample (called from the sampler's thread)."""
        for sample in samples:
            rank = "" if sample.get("rank") is None else str(sample["rank"])
            labels = (self.job_name, sample["node"], str(sample["gpu"]), sample["uuid"], rank)
            for key, (_, _, scale) in _GPU_FIELDS.items():
                if key in sample:
                    self.gpu[key].labels(*labels).set(sample[key] * scale)

    def close(self, linger_s: float = 0.0) -> None:
        """Stop serving, after `linger_s` seconds so a last scrape sees the final values."""
        if self._server is None:
            return
        if linger_s > 0:
            time.sleep(linger_s)
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    def _rank_labels(self, rank: int) -> tuple[str, str, str, str]:
        peer = self.peers[rank] if rank < len(self.peers) else Peer(rank, "?", "?")
        return self.job_name, str(rank), peer.node, peer.gpu
