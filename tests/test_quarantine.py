"""Sick nodes leave the job: the exclusion decision, what `status` shows, and on the live Slurm cluster a
node that fails its health check is excluded from the requeued job (or, when the job cannot spare it,
the job stops with one line).

The GPUs are faked (no NVIDIA GPU here): tests/fake_pynvml/pynvml.py, reached by every rank through
PYTHONPATH, reports a sick GPU on node1 only (the cluster's two nodes are this machine, told apart by
SLURMD_NODENAME). Slurm, its requeue and exclude list, the ranks and the ledger are real.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import compose_job, read_result, sacct_state, slurm_job_id, submit
from fake_nvml import FakeGpu, fake_nvml_env
from jobctl import attempts
from rich.console import Console

from gpujobs.backends.slurm.quarantine import plan
from gpujobs.launch.manage import PointState
from gpujobs.launch.status_table import attempts_text, status_table
from gpujobs.rundir.attempts import AttemptLog

TINY = ("+experiment=rec", "+debug=tiny", "cluster=slurm", "cluster.health_check=true", "cluster.health_probe_mb=1")


def test_a_node_joins_the_earlier_exclusions() -> None:
    decided = plan("node3", "hung", "gpu", ["node1", "node2", "node3", "node4"], ["node4", "node1"], 1)
    assert decided.excluded == ["node4", "node1", "node3"] and decided.refused is None
    again = plan("node1", "unhealthy", "gpu", ["node1", "node2"], ["node1"], 1)  # already out: once in the list
    assert again.excluded == ["node1"] and again.refused is None


def test_it_never_leaves_the_job_fewer_nodes_than_it_needs() -> None:
    refused = plan("node1", "hung", "debug", ["node1", "node2"], [], 2)
    assert refused.refused == (
        "node1 excluded after a hang: only node2 is left in partition debug, the job needs 2 nodes"
    )
    assert refused.excluded == []  # nothing changes
    none_left = plan("node2", "unhealthy", "short", ["node1", "node2"], ["node1"], 1)
    assert none_left.refused == (
        "node2 excluded after a failed health check: no node is left in partition short, the job needs 1 node"
    )
    assert none_left.excluded == ["node1"]
    several = plan("a", "hung", "p", ["a", "b", "c", "d"], ["d"], 3)
    assert several.refused == "a excluded after a hang: only b, c are left in partition p, the job needs 3 nodes"
    elastic = plan("node1", "hung", "debug", ["node1", "node2"], [], 1)  # --nodes=1-2 still fits on node2
    assert elastic.excluded == ["node1"] and elastic.refused is None


def test_status_names_the_excluded_nodes_of_the_current_job_within_80_columns(tmp_path: Path) -> None:
    cluster = compose_job("+experiment=rec", "cluster=slurm").cluster
    runs = []
    for num, job_id in ((0, "41"), (1, "42")):
        run_dir = tmp_path / f"point{num}"
        ledger = AttemptLog(run_dir)
        run_dir.mkdir()
        ledger.record(cluster, "unhealthy", job_id="40", node="node9", excluded=["node9"])  # an earlier job's
        ledger.record(cluster, "unhealthy", job_id=job_id, node="node1", excluded=["node1"], world_size=2)
        if num == 1:
            ledger.record(cluster, "hung", job_id=job_id, node="node3", excluded=["node1", "node3"], world_size=2)
            ledger.record(cluster, "preempted", job_id=job_id, world_size=2)  # the list stays
        runs.append(PointState(num, [f"optim.lr={num}"], run_dir, job_id, None, state="RUNNING"))
    out = io.StringIO()
    Console(file=out, width=80).print(status_table(runs))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80, out.getvalue()
    assert lines[-1].rstrip() == "excluded nodes: #0 node1; #1 node1, node3", out.getvalue()
    assert attempts_text(runs[1].run_dir) == "4 (preempted) world ?→2→2→2"


@pytest.fixture
def node2_busy(slurm: dict[str, str], tmp_path: Path) -> Iterator[Callable[[], None]]:
    """node2 held by a job of its own, so the next job starts on node1; yields what frees node2."""
    env = {**os.environ, **slurm}
    blocker = subprocess.run(
        ["sbatch", "--parsable", "-w", "node2", "--exclusive", f"--output={tmp_path}/blocker.out",
         "--wrap", "sleep 600"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout.strip()

    def release() -> None:
        subprocess.run(["scancel", blocker], check=False, env=env)

    try:
        deadline = time.monotonic() + 120
        while _squeue_state(blocker, env) != "RUNNING":
            assert time.monotonic() < deadline, f"the blocker job {blocker} never ran on node2"
            time.sleep(0.5)
        yield release
    finally:
        release()


def _squeue_state(job_id: str, env: dict[str, str]) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                          env=env, check=False).stdout.strip()


def _sick_node1(tmp_path: Path) -> dict[str, str]:
    return fake_nvml_env(tmp_path / "nvml.json", [FakeGpu(), FakeGpu()],
                         {"node1": [FakeGpu(), FakeGpu(ecc_uncorrected=3)]})


@pytest.mark.slurm
def test_a_sick_node_leaves_the_job_which_completes_on_the_other(
    tmp_path: Path, slurm: dict[str, str], node2_busy: Callable[[], None]
) -> None:
    run_dir = tmp_path / "run"
    env = {**slurm, **_sick_node1(tmp_path)}
    proc = submit(run_dir, *TINY, "resources.nodes=1", "resources.procs_per_node=2", "cluster.wait=false", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = slurm_job_id(proc.stdout)
    deadline = time.monotonic() + 120
    while not (run_dir / "attempts.jsonl").exists() or not (run_dir / "attempts.jsonl").read_text():
        assert time.monotonic() < deadline, "the first attempt recorded nothing"
        time.sleep(0.5)
    node2_busy()  # the requeued job may start once node1 is excluded
    assert sacct_state(job_id, slurm, timeout=180) == "COMPLETED"
    runs = subprocess.run(
        ["sacct", "--duplicates", "-X", "-n", "-P", "-o", "State,NodeList", "-j", job_id],
        capture_output=True, text=True, check=True, env={**os.environ, **slurm},
    ).stdout.split()
    assert runs == ["REQUEUED|node1", "COMPLETED|node2"], runs
    sick, completed = attempts(run_dir)
    assert (sick["reason"], sick["requeue"], sick["node"], sick["excluded"]) == ("unhealthy", True, "node1", ["node1"])
    assert sick["error"] == "unhealthy GPU on node1: GPU 1 (GPU-fake-1): 3 uncorrectable ECC errors", sick
    assert sick["steps_done"] == 0 and sick["job_id"] == job_id and sick["health_s"] > 0, sick
    assert completed["reason"] == "completed" and completed["start_step"] == 0, completed
    assert read_result(run_dir)["status"] == "completed"
    status = subprocess.run([sys.executable, "-m", "gpujobs", "status", str(run_dir)], capture_output=True,
                            text=True, env={**os.environ, **slurm}, timeout=60)
    assert status.returncode == 0 and "excluded nodes: node1" in status.stdout, status.stdout + status.stderr


@pytest.mark.slurm
def test_a_node_the_job_cannot_spare_stops_it_with_one_line(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    env = {**slurm, **_sick_node1(tmp_path)}
    proc = submit(run_dir, *TINY, "resources.nodes=2", "resources.procs_per_node=1", "cluster.wait=true", env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = attempts(run_dir)
    assert (line["reason"], line["requeue"], line["node"]) == ("unhealthy", False, "node1"), line
    assert line["why"] == ("not requeued: node1 excluded after a failed health check: only node2 is left in "
                           "partition debug, the job needs 2 nodes"), line
    assert "excluded" not in line, line
    job_id = slurm_job_id(proc.stdout)
    assert sacct_state(job_id, slurm) == "FAILED"
    assert f"gpujobs: job {job_id} ended: unhealthy, {line['why']}" in proc.stdout, proc.stdout  # not srun's 75
