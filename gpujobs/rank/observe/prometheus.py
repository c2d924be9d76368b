"""Rank 0's Prometheus endpoint: job metrics and its node's GPU telemetry, for scraping (torch-free).

Rank 0 has every rank's gathered timings, so one endpoint serves the whole job's step, loss,
throughput, per-rank step time and imbalance. GPU series come from the sampler in the same process,
so they cover rank 0's node; other nodes' GPUs are in their gpu.<node>.jsonl (each node's sampler appends to its own).
With `telemetry.prometheus_port=0` the OS picks the port; the URL is always written to
`<run_dir>/prometheus.json` so a scraper (or a test) can find it. The endpoint listens on
`telemetry.prometheus_addr` (loopback by default: the metrics name nodes and jobs); listening on
every interface is logged as a warning.

With `telemetry.prometheus_sd_dir` set, the endpoint is also announced as a Prometheus file_sd target
(`FileSdTarget`): one JSON file per run in that directory, so a site Prometheus whose
`file_sd_configs` globs over it finds every job without config edits (monitoring/prometheus/ has the
scrape config, the alert rules and their tests; monitoring/grafana/ a dashboard over these series).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from gpujobs.attempt.file_sd import FileSdTarget
from gpujobs.base.atomic import write_text_atomic
from gpujobs.base.nvml import THROTTLE_REASONS
from gpujobs.rank.observe.straggler import Peer
from gpujobs.rundir import PROMETHEUS_FILE
from gpujobs.rundir.records import CheckpointRecord, EvalRecord, MetricsRecord, TrainRecord

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
        # timestamps rather than counters: an alert asks "how long ago", and a stuck job keeps serving them
        self.started = Gauge("gpujobs_start_timestamp_seconds", "When this attempt's endpoint started (Unix time)",
                             ["job"], registry=reg)
        self.progress = Gauge("gpujobs_last_progress_timestamp_seconds",
                              "When the last training record came (every trainer.log_every steps; Unix time)",
                              ["job"], registry=reg)
        self.threshold = Gauge("gpujobs_imbalance_threshold", "telemetry.imbalance_threshold: the straggler line",
                               ["job"], registry=reg)
        self.ckpt_time = Gauge("gpujobs_last_checkpoint_timestamp_seconds",
                               "When the last checkpoint was taken (async: its snapshot; Unix time)", ["job"],
                               registry=reg)
        self.ckpt_step = Gauge("gpujobs_last_checkpoint_step", "Step of the last checkpoint", ["job"], registry=reg)
        self.ckpt_blocking = Gauge("gpujobs_checkpoint_blocking_seconds",
                                   "Seconds the last checkpoint held up training", ["job"], registry=reg)
        self.gpu = {
            key: Gauge(name, doc, _GPU_LABELS, registry=reg) for key, (name, doc, _) in _GPU_FIELDS.items()
        }
        self.gpu_held = Gauge("gpujobs_gpu_held", "1 where a rank of the job uses the GPU, 0 where it is only visible",
                              _GPU_LABELS, registry=reg)
        self.throttle = Gauge("gpujobs_gpu_throttle", "1 while NVML reports the clock event reason, else 0",
                              [*_GPU_LABELS, "reason"], registry=reg)
        self._server: Any = None
        self.target: Optional[FileSdTarget] = None

    def start(
        self,
        port: int,
        addr: str,
        run_dir: Path,
        sd_dir: Optional[Path] = None,
        labels: Optional[dict[str, str]] = None,
        imbalance_threshold: Optional[float] = None,
    ) -> str:
        """Serve on `addr`:`port` (0: a free port); write the URL to prometheus.json; return the URL.

        The URL names the address the socket is bound to ("localhost" becomes 127.0.0.1), or the
        node's host name when it listens on every interface (a wildcard is no address to scrape).
        With `sd_dir`, the endpoint is also written there as a file_sd target until `close`, labelled
        with `labels` (rank 0's node, the Slurm job id) plus the job name (`job`) and the run dir
        (`run_dir`); Prometheus attaches a target's labels to every series scraped from it.
        """
        self.started.labels(self.job_name).set_to_current_time()
        if imbalance_threshold is not None:
            self.threshold.labels(self.job_name).set(imbalance_threshold)
        # "" means every interface, as in socket.bind; prometheus_client cannot resolve it
        try:
            server, _ = start_http_server(port, addr=addr or "0.0.0.0", registry=self.registry)
        except OSError as err:  # in use, no such address here, a name that does not resolve: say whose it is
            raise OSError(err.errno, f"the Prometheus endpoint cannot listen on {addr or '0.0.0.0'}:{port} "
                          f"(telemetry.prometheus_addr, telemetry.prometheus_port): {err.strerror or err}") from None
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
        if sd_dir is not None:
            if bound.startswith("127.") or bound == "::1":
                log.warning("the file_sd target %s:%d is loopback: only a Prometheus on this node can scrape it "
                            "(telemetry.prometheus_addr=0.0.0.0 lets a site Prometheus in)", host, server.server_port)
            self.target = FileSdTarget(sd_dir, self.job_name, run_dir)
            own = {"job": self.job_name, "run_dir": str(Path(run_dir).resolve())}
            if self.target.write(f"{host}:{server.server_port}", {**(labels or {}), **own}):
                # which file it is, for the supervisor to withdraw should this rank be killed (`withdraw_left_target`)
                info["sd_target"] = self.target.identity()
                write_text_atomic(run_dir / PROMETHEUS_FILE, json.dumps(info) + "\n")
        return url

    def observe(self, record: MetricsRecord) -> None:
        """Update the gauges from a metrics record (train, eval or checkpoint; other kinds are not served)."""
        job = self.job_name
        if isinstance(record, EvalRecord):
            for name, value in record.metrics.items():
                self.eval.labels(job, name).set(value)
            return
        if isinstance(record, CheckpointRecord):
            self.ckpt_time.labels(job).set_to_current_time()
            self.ckpt_step.labels(job).set(record.step)
            self.ckpt_blocking.labels(job).set(record.blocking_s)
            return
        if not isinstance(record, TrainRecord):
            return
        self.progress.labels(job).set_to_current_time()
        self.step.labels(job).set(record.step)
        self.loss.labels(job).set(record.loss)
        self.samples.labels(job).set(record.samples_per_s)
        if record.imbalance is not None:
            self.imbalance.labels(job).set(record.imbalance)
        for gauge, per_rank in ((self.step_time, record.step_time_s), (self.data_time, record.data_time_s),
                                (self.local_time, record.local_time_s)):
            for rank, value in enumerate(per_rank):
                gauge.labels(*self._rank_labels(rank)).set(value)

    def observe_gpus(self, samples: list[dict[str, Any]]) -> None:
        """Update the GPU gauges from one sampler sample (called from the sampler's thread)."""
        for sample in samples:
            rank = "" if sample.get("rank") is None else str(sample["rank"])
            labels = (self.job_name, sample["node"], str(sample["gpu"]), sample["uuid"], rank)
            for key, (_, _, scale) in _GPU_FIELDS.items():
                if key in sample:
                    self.gpu[key].labels(*labels).set(sample[key] * scale)
            self.gpu_held.labels(*labels).set(0 if sample.get("rank") is None else 1)
            if "throttle" in sample:
                # every known reason, 0 or 1: a reason that clears reads 0 rather than going stale
                active = set(sample["throttle"])
                for reason in THROTTLE_REASONS.values():
                    self.throttle.labels(*labels, reason).set(1 if reason in active else 0)

    def close(self, linger_s: float = 0.0) -> None:
        """Stop serving, after `linger_s` seconds so a last scrape sees the final values; withdraw the target."""
        if self._server is None:
            return
        if linger_s > 0:
            time.sleep(linger_s)
        if self.target is not None:  # first: a Prometheus that still finds the target would scrape a closed port
            self.target.remove()
            self.target = None
        self._server.shutdown()
        self._server.server_close()
        self._server = None

    def _rank_labels(self, rank: int) -> tuple[str, str, str, str]:
        peer = self.peers[rank] if rank < len(self.peers) else Peer(rank, "?", "?")
        return self.job_name, str(rank), peer.node, peer.gpu
