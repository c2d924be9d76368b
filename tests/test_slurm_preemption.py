"""Preemption on the live Slurm cluster: a signal, a preempting job and the time limit each stop the
job at an agreed step; it requeues itself, resumes and ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import read_result, sacct_state, slurm_job_id, uninterrupted_digest
from jobctl import RunningJob, attempts, slurm_rank_pids

pytestmark = pytest.mark.slurm

MODEL = ("+experiment=rec", "+debug=tiny", "trainer.max_steps=200", "checkpoint.every_steps=50")
ON_SLURM = (
    *MODEL, "cluster=slurm", "resources.nodes=2", "resources.procs_per_node=1", "cluster.wait=true",
    "telemetry.debug_slow_rank=0",  # only slows the steps down, so there is time to interrupt them
)
#: One node, two ranks: a job that still fits the partition without one of its two nodes.
ONE_NODE = (
    *MODEL, "cluster=slurm", "resources.nodes=1", "resources.procs_per_node=2", "cluster.wait=true",
    "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40",
)


@pytest.fixture(scope="module")
def reference_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same training, uninterrupted, as 2 local ranks (same world size, same numerics)."""
    return uninterrupted_digest(tmp_path_factory, "reference", *MODEL, "cluster=local")


@pytest.fixture(scope="module")
def one_node_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """ONE_NODE's training, uninterrupted, as 2 local ranks."""
    return uninterrupted_digest(tmp_path_factory, "one-node", *MODEL, "resources.procs_per_node=2",
                                "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40", "cluster=local")


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def check_story(run_dir: Path, reason: str) -> list[dict[str, Any]]:
    story = attempts(run_dir)
    assert story[0]["reason"] == reason and story[0]["requeue"] is True, story
    assert story[-1]["reason"] == "completed", story
    for before, after in itertools.pairwise(story):
        assert after["start_step"] == before["steps_done"], story  # zero steps redone
        assert after["resumed_from"] == before["saved"], story
    return story


def test_usr2_requeues_and_resumes_exactly(tmp_path: Path, slurm: dict[str, str], reference_digest: str) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *ON_SLURM, "telemetry.debug_slow_ms=40", env=slurm)
    job.wait_for_step(30)
    job_id = slurm_job_id(job.output())
    env = {**os.environ, **slurm}
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env=env)
    assert job.wait(timeout=180) == 0, job.output()
    story = check_story(run_dir, "preempted")
    assert story[0]["job_id"] == job_id
    assert read_result(run_dir)["param_digest"] == reference_digest
    assert sacct_state(job_id, slurm) == "COMPLETED"


def test_usr2_while_the_ranks_start_is_not_lost(tmp_path: Path, slurm: dict[str, str], reference_digest: str) -> None:
    # Each rank gets USR2 as soon as it has any handler for it, long before torch is loaded and the
    # trainer's watcher exists: the first handler must be gpujobs' own, not submitit's (which would
    # requeue the job outside the budgets, leaving no attempt behind).
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *ON_SLURM, "telemetry.debug_slow_ms=40", env=slurm)
    deadline = time.monotonic() + 120
    while not re.search(r"submitted Slurm job \d+", job.output()):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output()
        time.sleep(0.05)
    job_id = slurm_job_id(job.output())
    signalled: set[int] = set()
    while len(signalled) < 2:
        assert time.monotonic() < deadline, job.output()
        for rank, pid in slurm_rank_pids(job_id).items():
            try:
                if rank not in signalled and catches(pid, signal.SIGUSR2):
                    os.kill(pid, signal.SIGUSR2)
                    signalled.add(rank)
            except OSError:  # the process ended between two looks
                continue
        time.sleep(0.005)
    assert job.wait(timeout=180) == 0, job.output()
    story = check_story(run_dir, "preempted")
    # the first agreed boundary: the vote started at step 10 (stop_check_every) is read, and agreed, at 11
    assert story[0]["start_step"] == 0 and story[0]["steps_done"] <= 11, story
    assert read_result(run_dir)["param_digest"] == reference_digest


def test_preempted_by_a_higher_priority_job(tmp_path: Path, slurm: dict[str, str], reference_digest: str) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *ON_SLURM, "telemetry.debug_slow_ms=40", env=slurm)
    job.wait_for_step(30)
    env = {**os.environ, **slurm}
    urgent = subprocess.run(
        ["sbatch", "--parsable", "-p", "urgent", "-N2", "--exclusive", f"--output={tmp_path}/urgent.out",
         "--wrap", "sleep 2"],
        check=True, capture_output=True, text=True, env=env,
    ).stdout.strip()
    assert job.wait(timeout=240) == 0, job.output()
    check_story(run_dir, "preempted")
    assert read_result(run_dir)["param_digest"] == reference_digest
    assert sacct_state(urgent, slurm) == "COMPLETED"


@pytest.mark.timeout(600)  # two or three 1-minute attempts, each waiting for Slurm's 30 s limit check
def test_time_limit_requeues_until_done(tmp_path: Path, slurm: dict[str, str], reference_digest: str) -> None:
    run_dir = tmp_path / "run"
    # slurmctld checks time limits every 30 s and sends the --signal at the first check that finds less
    # than lead + 30 s left: with a 1-minute limit and a 10 s lead, 20-50 s into each attempt (after
    # startup, so the handler is in place). 200 steps x 260 ms = 52 s of training cannot fit in one attempt.
    job = RunningJob(
        run_dir, *ON_SLURM, "telemetry.debug_slow_ms=260", "cluster.time=1", "cluster.signal_lead_s=10",
        "cluster.max_timeouts=8", env=slurm,
    )
    assert job.wait(timeout=480) == 0, job.output()
    story = check_story(run_dir, "timeout")
    assert {line["reason"] for line in story[:-1]} == {"timeout"}
    assert read_result(run_dir)["param_digest"] == reference_digest


def test_rank_0_killed_is_recorded_by_the_supervisor_and_requeued(
    tmp_path: Path, slurm: dict[str, str], reference_digest: str
) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *ON_SLURM, "telemetry.debug_slow_ms=40", "cluster.max_restarts=1", env=slurm)
    job.wait_for_step(60)  # checkpoint 50 is published
    job_id = slurm_job_id(job.output())
    os.kill(slurm_rank_pids(job_id)[0], signal.SIGKILL)  # rank 0 can record nothing
    assert job.wait(timeout=240) == 0, job.output()
    failed, completed = attempts(run_dir)
    assert failed["reason"] == "failed" and failed["recorded_by"] == "supervisor", failed
    assert "rank 0 on " in failed["error"] and "Killed" in failed["error"], failed
    assert failed["start"] < failed["end"], failed  # the attempt's span, for the GPU-hour ledger
    assert failed["requeue"] is True and failed["job_id"] == job_id
    # the crash is attributed to its node, which stays: the 2-node job needs both nodes of the partition
    assert failed["node"] in failed["error"] and "excluded" not in failed, failed
    assert f"{failed['node']} kept after the crash: only " in failed["why"], failed
    assert completed["reason"] == "completed" and completed["resumed_from"].endswith("step_00000050")
    assert read_result(run_dir)["param_digest"] == reference_digest


def test_a_node_where_a_rank_crashed_leaves_a_job_that_fits_without_it(
    tmp_path: Path, slurm: dict[str, str], one_node_digest: str
) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *ONE_NODE, "cluster.max_restarts=1", env=slurm)
    job.wait_for_step(60)  # checkpoint 50 is published
    job_id = slurm_job_id(job.output())
    os.kill(slurm_rank_pids(job_id)[0], signal.SIGKILL)  # rank 0 dies: the supervisor records the crash
    assert job.wait(timeout=240) == 0, job.output()
    failed, completed = attempts(run_dir)
    assert failed["reason"] == "failed" and failed["recorded_by"] == "supervisor", failed
    crashed = failed["node"]
    assert failed["excluded"] == [crashed] and failed["requeue"] is True, failed
    runs = subprocess.run(["sacct", "-X", "--duplicates", "-n", "-P", "-j", job_id, "-o", "NodeList"],
                          capture_output=True, text=True, check=True, env={**os.environ, **slurm}).stdout.split()
    assert runs[0] == crashed and runs[-1] != crashed, runs  # the requeued run went to the other node
    assert completed["reason"] == "completed" and read_result(run_dir)["param_digest"] == one_node_digest


def test_a_requeue_that_fails_once_is_retried_with_one_attempt_line(
    tmp_path: Path, slurm: dict[str, str], reference_digest: str
) -> None:
    failed_once = tmp_path / "scontrol-failed-once"
    wrapper = tmp_path / "bin" / "scontrol"  # a busy controller: the first `scontrol requeue` fails
    wrapper.parent.mkdir()
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = requeue ] && [ ! -e {failed_once} ]; then\n'
        f"  : > {failed_once}; echo 'slurm_requeue error: Socket timed out on send/recv operation' >&2; exit 1\n"
        "fi\n"
        "exec /usr/bin/scontrol \"$@\"\n"
    )
    wrapper.chmod(0o755)
    run_dir = tmp_path / "run"
    path = f"{wrapper.parent}:{os.environ['PATH']}"
    job = RunningJob(run_dir, *ON_SLURM, "telemetry.debug_slow_ms=40", env={**slurm, "PATH": path})
    job.wait_for_step(30)
    job_id = slurm_job_id(job.output())
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **slurm})
    assert job.wait(timeout=180) == 0, job.output()
    assert failed_once.exists()  # the first requeue really failed
    story = check_story(run_dir, "preempted")
    assert [line["reason"] for line in story] == ["preempted", "completed"]
    assert read_result(run_dir)["param_digest"] == reference_digest


def test_a_sigterm_to_the_batch_step_leaves_the_ranks_to_finish(tmp_path: Path, slurm: dict[str, str]) -> None:
    """Slurm's SIGTERM (a time limit, a scancel) reaches the batch step too. The supervisor must not die
    of it: the batch step's end would end the job and its ranks, which may be saving, before KillWait."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *ONE_NODE, env=slurm)
    job.wait_for_step(10)
    job_id = slurm_job_id(job.output())
    subprocess.run(["scancel", "--batch", "--signal=TERM", job_id], check=True, env={**os.environ, **slurm})
    assert job.wait(timeout=240) == 0, job.output()
    (completed,) = attempts(run_dir)
    assert completed["reason"] == "completed" and completed["job_id"] == job_id, completed
    assert sacct_state(job_id, slurm) == "COMPLETED"
    logs = "".join(path.read_text(errors="replace") for path in (run_dir / "submitit").glob(f"{job_id}*"))
    assert "the supervisor got SIGTERM" in logs
