"""The health check at start: a sick GPU or a slow link ends the attempt as `unhealthy` before step 1.

This machine has no NVIDIA GPU and no NVML, so the GPUs' answers are faked: in this process by
tests/fake_nvml.py, in the ranks of real runs by tests/fake_pynvml/pynvml.py (through PYTHONPATH).
The probe (2 gloo ranks), the gathered decision, the ledger and the launcher's restarts are real.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import compose_job, read_metrics, read_result, submit
from fake_nvml import FakeGpu, fake_nvml_env, install
from jobctl import attempts

from gpujobs.backends.jobenv import DistInfo, node_name
from gpujobs.base.nvml import gpu_faults, nvml_session
from gpujobs.rank.health import Finding, check, decide, health_record
from gpujobs.rundir.progress import ProgressView, describe
from gpujobs.rundir.records import HealthRecord, metrics_record

TINY = ("+experiment=rec", "+debug=tiny", "cluster=local", "cluster.health_check=true", "trainer.progress=false")
#: 2 CPU ranks that see 2 (fake) GPUs: gloo trains, NVML reports what the fake says
FAKE_GPUS = (*TINY, "resources.gpus_per_node=2")


def test_each_nvml_fault_is_named_and_unsupported_checks_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, [
        FakeGpu(),  # no ECC, no retired pages, no row remapper (NotSupported): nothing to find
        FakeGpu(ecc_uncorrected=2),
        FakeGpu(retired_pending=True),
        FakeGpu(remap_supported=True, remap_pending=True),
        FakeGpu(remap_supported=True, remap_failure=True),
        FakeGpu(temp_c=95),
        FakeGpu(throttle=["hw_thermal", "sw_power_cap", "hw_power_brake"]),
        FakeGpu(ecc_uncorrected=0, retired_pending=False, remap_supported=True, temp_c=90),
    ])
    with nvml_session() as nv:
        found = [gpu_faults(nv, nv.nvmlDeviceGetHandleByIndex(i), 90.0) for i in range(8)]
    assert found == [
        [],
        ["2 uncorrectable ECC errors"],
        ["retired pages pending (the GPU needs a reset)"],
        ["row remaps pending (the GPU needs a reset)"],
        ["row remapping failed"],
        ["95 C, above cluster.health_max_temp_c=90"],
        ["throttled (hw_thermal, hw_power_brake)"],  # a power cap is policy, not a fault
        [],
    ]


def _one_rank(node: str = "n1") -> DistInfo:
    return DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1",
                    master_port=29500, node=node)


def test_an_xid_during_the_check_fails_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, [FakeGpu(), FakeGpu(xids=[79])])
    cluster = compose_job(*TINY).cluster
    ranks = [{"rank": 0, "local_rank": 0, "node": "n1", "cuda_visible_devices": "0,1"}]
    verdict = check(cluster, _one_rank(), torch.device("cpu"), ranks)
    assert not verdict.healthy and verdict.node == "n1" and verdict.culprit_rank == 0, verdict
    assert verdict.error == "unhealthy GPU on n1: GPU 1 (GPU-fake-1): XID 79"
    assert verdict.busbw_gbps is None and verdict.nvml == ["n1: 2 GPUs checked"]  # one rank: no link


def test_the_gpus_checked_are_those_the_ranks_reported_under_slurms_renumbering(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slurm's device cgroup renumbers the job's GPUs 2 and 3 as CUDA_VISIBLE_DEVICES=0,1 in its tasks;
    NVML keeps the node's numbers, where 0 and 1 are another job's (here: one of them sick)."""
    install(monkeypatch, [FakeGpu(), FakeGpu(ecc_uncorrected=3), FakeGpu(), FakeGpu(xids=[48])])
    ranks = [{"rank": 0, "local_rank": 0, "node": "n1", "cuda_visible_devices": "0,1", "gpu_uuid": "GPU-fake-2"},
             {"rank": 1, "local_rank": 1, "node": "n1", "cuda_visible_devices": "0,1", "gpu_uuid": "GPU-fake-3"}]
    verdict = check(compose_job(*TINY).cluster, _one_rank(), torch.device("cpu"), ranks)
    assert verdict.error == "unhealthy GPU on n1: GPU 3 (GPU-fake-3): XID 48", verdict
    assert verdict.nvml == ["n1: 2 GPUs checked"]


def test_a_cpu_job_has_no_gpu_to_check(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, [FakeGpu(ecc_uncorrected=5)])  # the node has a sick GPU, but the job uses none
    ranks = [{"rank": 0, "local_rank": 0, "node": "n1", "cuda_visible_devices": ""}]
    verdict = check(compose_job(*TINY).cluster, _one_rank(), torch.device("cpu"), ranks)
    assert verdict.healthy and verdict.nvml == ["n1: no GPU visible to the ranks here: nothing for NVML to check"]


def test_the_decision_names_the_first_sick_node_and_the_slowest_rank_of_a_slow_link() -> None:
    mib16 = 16 * 2**20
    findings = [
        Finding(0, "a", "2 GPUs checked", 2, [], 0.010), Finding(1, "a", None, 0, [], 0.011),
        Finding(2, "b", "2 GPUs checked", 2, ["GPU 0 (GPU-x): row remapping failed"], 0.012),
        Finding(3, "b", None, 0, [], 0.020),
        Finding(4, "c", "1 GPU checked", 1, ["GPU 1 (GPU-y): 1 uncorrectable ECC error"], 0.010),
    ]
    sick = decide(findings, 0.0, mib16)
    assert (sick.healthy, sick.node, sick.culprit_rank) == (False, "b", 2)
    assert sick.error == "unhealthy GPU on b: GPU 0 (GPU-x): row remapping failed (and on c)"
    assert sick.busbw_gbps == pytest.approx(2 * 4 / 5 * mib16 / 0.020 / 1e9)  # the slowest rank's round
    healthy = [Finding(f.rank, f.node, f.nvml, f.gpus_checked, [], f.probe_s) for f in findings]
    assert decide(healthy, 0.0, mib16).healthy  # 0: recorded, never failed
    slow = decide(healthy, 1e6, mib16)
    assert (slow.healthy, slow.node, slow.culprit_rank) == (False, "b", 3)
    assert slow.error is not None and slow.error.startswith("slow link: all-reduce bus bandwidth 1.34 GB/s across 5 ")
    assert slow.error.endswith("on a, b, c, below cluster.health_min_busbw_gbps=1e+06 (slowest: rank 3 on b)")
    assert decide([Finding(0, "a", None, 0, [], 0.5)], 1e6, mib16).healthy  # one rank: no link to judge


def test_the_health_record_is_typed_and_the_progress_view_passes_it_over() -> None:
    verdict = decide([Finding(0, "a", "1 GPU checked", 1, [], 0.01), Finding(1, "a", None, 0, [], 0.02)], 0, 2**20)
    line: dict[str, Any] = {"kind": "health", **asdict(health_record(verdict, compose_job(*TINY).cluster, 2))}
    record = metrics_record(json.loads(json.dumps(line)))
    assert isinstance(record, HealthRecord) and record.healthy and record.nvml == ["a: 1 GPU checked"], record
    assert record.busbw_gbps == pytest.approx(2**20 / 0.02 / 1e9, rel=1e-3) and record.world_size == 2
    assert describe(record).startswith("health check passed in ")
    out = io.StringIO()
    view = ProgressView(12, "rec", stream=out)
    view.update(line)
    view.update({"kind": "train", "step": 3, "loss": 0.5, "samples_per_s": 100.0})
    assert out.getvalue() == "[rec] step 3 loss 0.5000 100 samples/s\n"  # the health line printed nothing


def test_a_sick_gpu_ends_each_attempt_before_step_1_and_the_budget_stops_the_job(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = fake_nvml_env(tmp_path / "nvml.json", [FakeGpu(), FakeGpu(ecc_uncorrected=2)])
    proc = submit(run_dir, *FAKE_GPUS, "cluster.max_unhealthy=1", env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "gpujobs: attempt 1 unhealthy (unhealthy 1 of at most 1); restarting from the last checkpoint" in out
    stop = [line for line in out.splitlines() if line.startswith("gpujobs: job ended:")]
    assert stop == ["gpujobs: job ended: unhealthy, unhealthy budget exhausted (1 unhealthy attempts allowed); "
                    f"last error: unhealthy GPU on {node_name()}: GPU 1 (GPU-fake-1): 2 uncorrectable ECC errors"]
    story = attempts(run_dir)
    assert [(a["reason"], a["requeue"]) for a in story] == [("unhealthy", True), ("unhealthy", False)], story
    for line in story:
        assert line["node"] == node_name() and line["culprit_rank"] == 0 and line["steps_done"] == 0, line
        assert "GPU 1 (GPU-fake-1)" in line["error"] and line["health_s"] > 0 and "excluded" not in line, line
    records = read_metrics(run_dir)
    assert [r["kind"] for r in records] == ["health", "health"], records  # no step was trained
    assert all(r["faults"] == [f"{node_name()}: GPU 1 (GPU-fake-1): 2 uncorrectable ECC errors"] for r in records)
    assert not any((run_dir / "checkpoints").glob("step_*")) and not (run_dir / "result.json").exists()


def test_a_healthy_run_records_its_check_and_completes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = fake_nvml_env(tmp_path / "nvml.json", [FakeGpu(ecc_uncorrected=0), FakeGpu(temp_c=60)])
    proc = submit(run_dir, *FAKE_GPUS, "cluster.health_probe_mb=4", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert read_result(run_dir)["status"] == "completed"
    records = read_metrics(run_dir)
    health = [r for r in records if r["kind"] == "health"]
    assert records[0] == health[0] and len(health) == 1, records  # before any step
    assert health[0]["healthy"] is True and health[0]["nvml"] == [f"{node_name()}: 2 GPUs checked"], health
    assert health[0]["busbw_gbps"] > 0 and health[0]["probe_mb"] == 4 and health[0]["world_size"] == 2
    (completed,) = attempts(run_dir)
    assert completed["reason"] == "completed" and 0 < completed["health_s"] == health[0]["health_s"], completed


def test_a_probe_threshold_that_cannot_be_met_names_the_link(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # no fake NVML: the NVML part finds no library, says so and passes; the probe fails the attempt
    proc = submit(run_dir, *TINY, "resources.procs_per_node=2", "cluster.health_min_busbw_gbps=1e6",
                  "cluster.health_probe_mb=1", "cluster.max_unhealthy=0", env={"GPUJOBS_FAKE_NVML": ""})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    (line,) = attempts(run_dir)
    assert line["reason"] == "unhealthy" and line["requeue"] is False and line["node"] == node_name(), line
    assert line["error"].startswith("slow link: all-reduce bus bandwidth "), line
    assert line["error"].endswith(f"across 2 ranks on {node_name()}, below cluster.health_min_busbw_gbps=1e+06 "
                                  f"(slowest: rank {line['culprit_rank']} on {node_name()})"), line
    assert f"last error: {line['error']}" in out
    logs = "".join(p.read_text() for p in (run_dir / "submitit").glob("*_0_log.*"))
    assert "health: NVML on " in logs and "NVML unavailable (" in logs and "GPU checks skipped" in logs
