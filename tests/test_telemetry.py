"""Straggler detection and the Prometheus endpoint on a real 2-rank gloo job (submitit local executor).

One job serves the module: rank 1 is slowed down by the debug knob, the endpoint picks a free port
on the default address (loopback), and the test scrapes it over HTTP while the job is still up (the
endpoint lingers a few seconds after the last step, so the final values are scrapable too) and reads
the kernel's table of listening sockets to see which address it is bound to.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import compose_job, read_metrics, submit
from prometheus_client.parser import text_string_to_metric_families

from gpujobs.base.errors import ConfigError
from gpujobs.rank.observe.prometheus import PrometheusExporter
from gpujobs.rank.observe.straggler import Peer, StragglerCheck, imbalance
from gpujobs.rundir import PROMETHEUS_FILE
from gpujobs.rundir.gpu_files import gpu_files
from gpujobs.rundir.records import TrainRecord

TINY = ("+experiment=rec", "+debug=tiny", "cluster=local")


@dataclass
class SlowRun:
    run_dir: Path
    returncode: int
    output: str
    scrapes: list[str]
    listening: set[str]
    """The local addresses of the sockets listening on the endpoint's port, seen while the job ran."""


def _listening_addresses(port: int) -> set[str]:
    """Addresses that sockets in LISTEN state are bound to on `port`, from /proc/net/tcp and tcp6."""
    found: set[str] = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            hex_addr, hex_port = local.split(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: TCP_LISTEN
                continue
            raw = bytes.fromhex(hex_addr)
            # the kernel prints each 32-bit word in host (little-endian) order
            words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(socket.inet_ntop(family, words))
    return found


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory: pytest.TempPathFactory) -> SlowRun:
    run_dir = tmp_path_factory.mktemp("telemetry") / "run"
    cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *TINY,
           "telemetry.debug_slow_rank=1", "telemetry.debug_slow_ms=80",
           "telemetry.prometheus_port=0", "telemetry.prometheus_linger_s=4"]
    proc = subprocess.Popen(cmd, cwd=run_dir.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    scrapes: list[str] = []
    listening: set[str] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        info = run_dir / "prometheus.json"
        if info.exists():
            port = json.loads(info.read_text())["port"]
            listening |= _listening_addresses(port)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                    scrapes.append(response.read().decode())
            except OSError:  # the endpoint closed between two polls
                pass
        time.sleep(0.3)
    output, _ = proc.communicate(timeout=60)
    return SlowRun(run_dir, proc.returncode, output, scrapes, listening)


def test_straggler_is_named_in_metrics_and_logs(slow_run: SlowRun) -> None:
    assert slow_run.returncode == 0, slow_run.output
    train = [r for r in read_metrics(slow_run.run_dir) if r["kind"] == "train"]
    assert len(train) == 4
    # DDP equalises step time (rank 0 waits in the all-reduce); the local time shows who is slow
    assert all(r["slowest_rank"] == 1 and r["imbalance"] > 1.25 for r in train[1:])
    assert all(r["local_time_s"][1] >= 0.08 > r["local_time_s"][0] for r in train[1:])
    rank0_log = next((slow_run.run_dir / "submitit").glob("*_0_log.err")).read_text()
    warnings = [line for line in rank0_log.splitlines() if "straggler at step" in line]
    assert len(warnings) >= 3
    assert "rank 1 (node " in warnings[-1] and "CPU)" in warnings[-1]
    # no NVML here: one line per node, and the job carried on
    all_logs = "".join(p.read_text() for p in (slow_run.run_dir / "submitit").glob("*_log.err"))
    assert all_logs.count("no NVML: GPU telemetry off") == 1
    assert gpu_files(slow_run.run_dir) == []


def test_a_rank_slow_in_its_backward_pass_is_the_straggler(tmp_path: Path) -> None:
    """The slow-GPU emulation spends rank 1's extra time where a slower GPU does, backward pass included,
    past the point where a host clock of data + forward stops (there it read ~1.0): what is compared is
    the compute clock's time, as on GPUs, where the host clock holds the wait for the others."""
    run_dir = tmp_path / "run"
    proc = submit(run_dir, *TINY, "trainer.max_steps=6", "trainer.eval_every=0", "checkpoint.every_steps=0",
                  "telemetry.gpu=false", "telemetry.debug_slow_rank=1", "telemetry.debug_slow_factor=8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert len(train) == 2
    # rank 1 spends 8x its own compute: 8 / median(1, 8) = 1.8, and the other rank waits for it
    assert all(r["slowest_rank"] == 1 and r["imbalance"] > 1.4 for r in train), train
    rank0_log = next((run_dir / "submitit").glob("*_0_log.err")).read_text()
    warnings = [line for line in rank0_log.splitlines() if "straggler at step" in line]
    assert warnings and all("rank 1 (node " in line for line in warnings), warnings


def test_prometheus_serves_labelled_job_metrics_while_the_job_runs(slow_run: SlowRun) -> None:
    assert slow_run.returncode == 0, slow_run.output
    assert slow_run.scrapes, "never reached the endpoint"
    samples = {}
    for family in text_string_to_metric_families(slow_run.scrapes[-1]):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert samples[("gpujobs_step", (("job", "rec"),))] == 12
    assert samples[("gpujobs_samples_per_second", (("job", "rec"),))] > 0
    assert samples[("gpujobs_imbalance", (("job", "rec"),))] > 1.25
    assert samples[("gpujobs_eval", (("job", "rec"), ("metric", "auc")))] > 0
    node = json.loads((slow_run.run_dir / "prometheus.json").read_text())["node"]
    for rank in (0, 1):
        labels = (("gpu", "cpu"), ("job", "rec"), ("node", node), ("rank", str(rank)))
        assert samples[("gpujobs_step_time_seconds", labels)] > 0
    slow = (("gpu", "cpu"), ("job", "rec"), ("node", node), ("rank", "1"))
    assert samples[("gpujobs_local_time_seconds", slow)] >= 0.08


def test_prometheus_listens_on_loopback_by_default(slow_run: SlowRun) -> None:
    assert slow_run.returncode == 0, slow_run.output
    info = json.loads((slow_run.run_dir / PROMETHEUS_FILE).read_text())
    assert info["addr"] == "127.0.0.1" and info["url"] == f"http://127.0.0.1:{info['port']}/metrics"
    assert slow_run.listening == {"127.0.0.1"}  # the socket itself, not only what the file says
    rank0_log = next((slow_run.run_dir / "submitit").glob("*_0_log.err")).read_text()
    assert "listens on every interface" not in rank0_log


def test_listening_on_every_interface_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    exporter = PrometheusExporter("rec", [])
    with caplog.at_level(logging.WARNING, logger="gpujobs.rank.observe.prometheus"):
        url = exporter.start(0, "0.0.0.0", tmp_path)
    try:
        info = json.loads((tmp_path / PROMETHEUS_FILE).read_text())
        assert _listening_addresses(info["port"]) == {"0.0.0.0"}
    finally:
        exporter.close()
    assert any("listens on every interface" in r.getMessage() for r in caplog.records)
    # a wildcard is no address to scrape: the URL names the node
    assert info["addr"] == "0.0.0.0" and url == f"http://{socket.gethostname()}:{info['port']}/metrics"


def test_imbalance_is_slowest_over_median() -> None:
    assert imbalance([0.1, 0.1, 0.1, 0.3]) == (pytest.approx(3.0), 3)
    assert imbalance([0.2]) == (1.0, 0)
    check = StragglerCheck(1.5, [Peer(0, "a", "0"), Peer(1, "b", "3")], warn=False)
    record, message = check.check(_train(5, local_time_s=[0.1, 0.4]))
    assert record.imbalance == 1.6 and record.slowest_rank == 1
    assert message is not None and "rank 1 (node b, GPU 3)" in message
    assert check.check(_train(6, local_time_s=[0.1, 0.11]))[1] is None
    # 2x, but a microsecond against a 10 ms step: noise, not a straggler worth a warning
    assert check.check(_train(7, local_time_s=[1e-6, 2e-6], step_time_s=[0.01, 0.01]))[1] is None


def _train(step: int, **times: list[float]) -> TrainRecord:
    """A train record with only the timings the straggler check reads."""
    return TrainRecord(step=step, loss=0.5, samples_per_s=100.0, **times)


@pytest.mark.parametrize(
    "override",
    ["telemetry.imbalance_threshold=0.5", "telemetry.interval_s=0", "telemetry.prometheus_port=70000",
     "telemetry.debug_slow_rank=2", "telemetry.prometheus_linger_s=-1"],
)
def test_bad_telemetry_values_are_refused(override: str) -> None:
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        compose_job(*TINY, override)


def test_peers_bound_one_gpu_each_by_slurm_are_told_apart_by_uuid() -> None:
    """Slurm binds one GPU per task and renumbers it: every rank sees CUDA_VISIBLE_DEVICES=0. By index both
    ranks were "GPU 0" in warnings and Prometheus labels; by the uuid each reported, they are two GPUs."""
    ranks = [{"rank": r, "local_rank": r, "node": "n1", "cuda_visible_devices": "0", "gpu_uuid": uuid}
             for r, uuid in enumerate(["GPU-aaaa", "GPU-bbbb"])]
    peers = [Peer.from_rank(entry, on_gpu=True) for entry in ranks]
    assert [p.where() for p in peers] == ["rank 0 (node n1, GPU-aaaa)", "rank 1 (node n1, GPU-bbbb)"]
    old = {**ranks[1], "gpu_uuid": None}  # a rank that could not say its uuid: its CUDA_VISIBLE_DEVICES entry
    assert Peer.from_rank(old, on_gpu=True).gpu == "0"
