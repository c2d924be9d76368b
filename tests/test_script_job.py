"""Bring your own script: a torchrun-style script runs unchanged as a local gpujobs job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import read_result, slurm_job_id, submit
from jobctl import RunningJob, attempts

SCRIPT = Path(__file__).parent / "scripts" / "torchrun_style.py"


def test_torchrun_style_script_runs_on_two_local_ranks(run_dir: Path) -> None:
    proc = submit(
        run_dir, "cluster=local", "resources.procs_per_node=2", f"+script.path={SCRIPT}",
        "+script.args=[--epochs,3]", "nccl=debug",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads((run_dir / f"seen_rank{r}.json").read_text()) for r in (0, 1)]
    assert [s["RANK"] for s in seen] == ["0", "1"]
    assert all(s["WORLD_SIZE"] == "2" and s["LOCAL_WORLD_SIZE"] == "2" for s in seen)
    assert all(s["rank_sum"] == 1.0 for s in seen)  # the all-reduce really crossed ranks
    assert seen[0]["args"] == ["--epochs", "3"]
    result = read_result(run_dir)
    assert result["kind"] == "script" and result["world_size"] == 2


def test_a_rank_that_fails_first_is_the_one_the_ledger_names(run_dir: Path) -> None:
    """Rank 1 raises; rank 0 fails after it, in the all-reduce rank 1 never joins. The attempt's line
    says rank 1's failure, not rank 0's echo of it."""
    proc = submit(run_dir, "cluster=local", "resources.procs_per_node=2", f"+script.path={SCRIPT}",
                  "+script.args=[--fail-rank,1]")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = attempts(run_dir)
    assert line["reason"] == "failed" and line["recorded_by"] == "rank 0", line
    assert line["culprit_rank"] == 1 and line["node"] == os.uname().nodename, line
    assert line["error"] == f"rank 1: {SCRIPT} exited with code 1", line
    assert f"last error: rank 1: {SCRIPT} exited with code 1" in proc.stdout, proc.stdout


def test_a_rank_that_fails_after_rank_0_is_done_fails_the_attempt(run_dir: Path) -> None:
    """Rank 0's script exits 0; rank 1's exits 3 after it. The attempt is failed, naming rank 1, and no
    result says completed: only what sees every rank end (here the launcher) may record it."""
    proc = submit(run_dir, "cluster=local", "resources.procs_per_node=2", f"+script.path={SCRIPT}",
                  "+script.args=[--fail-late,1]", "cluster.max_restarts=0")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert (run_dir / "seen_rank0.json").exists()  # rank 0's script did finish first
    (line,) = attempts(run_dir)
    assert line["reason"] == "failed" and line["recorded_by"] == "launcher", line
    assert line["culprit_rank"] == 1 and line["error"] == f"rank 1: {SCRIPT} exited with code 3", line
    assert not (run_dir / "result.json").exists()


def test_a_script_that_completes_on_every_rank_is_recorded_by_the_launcher(run_dir: Path) -> None:
    proc = submit(run_dir, "cluster=local", "resources.procs_per_node=2", f"+script.path={SCRIPT}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = attempts(run_dir)
    assert line["reason"] == "completed" and line["recorded_by"] == "launcher", line
    assert line["world_size"] == 2 and line["script_exit"] == 0 and line["start"] <= line["end"], line
    assert read_result(run_dir)["world_size"] == 2
    assert "gpujobs: status=completed" in proc.stdout, proc.stdout


def test_missing_script_is_refused(run_dir: Path) -> None:
    proc = submit(run_dir, "cluster=local", "+script.path=/nowhere/train.py")
    assert proc.returncode == 2
    assert "script.path='/nowhere/train.py' is invalid" in proc.stderr
    assert not run_dir.exists()


STOPPABLE = Path(__file__).parent / "scripts" / "stoppable.py"


def _wait_for_progress(run_dir: Path, step: int, timeout: float = 60) -> None:
    state = run_dir / "progress_rank0.json"
    deadline = time.monotonic() + timeout
    while not (state.exists() and json.loads(state.read_text())["step"] >= step):
        assert time.monotonic() < deadline, "the script never got going"
        time.sleep(0.05)


def test_usr2_tells_a_local_script_to_stop_and_it_resumes_within_the_budget(run_dir: Path) -> None:
    job = RunningJob(run_dir, "cluster=local", "resources.procs_per_node=2", f"+script.path={STOPPABLE}",
                     "+script.args=[60]")
    _wait_for_progress(run_dir, 5)
    job.signal_rank(0, signal.SIGUSR2)
    assert job.wait() == 0, job.output()
    first, second = attempts(run_dir)
    assert first["reason"] == "preempted" and first["requeue"] is True and first["script_exit"] == 0
    assert second["reason"] == "completed"
    exits = (run_dir / "exits_rank0.txt").read_text().splitlines()
    assert exits[0].startswith("stopped at") and exits[-1] == "finished at 60"  # told to stop, then resumed
    assert read_result(run_dir)["kind"] == "script"


def test_a_stop_that_comes_after_rank_0_is_done_is_recorded_by_the_launcher(run_dir: Path) -> None:
    """Rank 0's script is done; then rank 1 is told to stop. The attempt is preempted (not completed,
    not failed), within the preemption budget, and the next attempt finishes rank 1's count."""
    job = RunningJob(run_dir, "cluster=local", "resources.procs_per_node=2", f"+script.path={STOPPABLE}",
                     "+script.args=[200,2]", "cluster.max_restarts=0")
    deadline = time.monotonic() + 60
    # rank 1's script counts too: its rank process has its USR2 handler (a rank still starting, under load,
    # would die of the signal as any process without one does)
    while not ((run_dir / "exits_rank0.txt").exists() and (run_dir / "progress_rank1.json").exists()):
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.05)
    job.signal_rank(1, signal.SIGUSR2)
    assert job.wait() == 0, job.output()
    first, second = attempts(run_dir)
    assert first["reason"] == "preempted" and first["recorded_by"] == "launcher" and first["requeue"] is True, first
    assert second["reason"] == "completed" and second["recorded_by"] == "launcher", second
    exits = (run_dir / "exits_rank1.txt").read_text().splitlines()
    assert exits[0].startswith("stopped at") and exits[-1] == "finished at 200", exits


@pytest.mark.slurm
def test_usr2_requeues_a_slurm_script_within_max_preemptions(run_dir: Path, slurm: dict[str, str]) -> None:
    job = RunningJob(run_dir, "cluster=slurm", "resources.procs_per_node=2", f"+script.path={STOPPABLE}",
                     "+script.args=[100]", "cluster.wait=true", "cluster.max_preemptions=1", env=slurm)
    _wait_for_progress(run_dir, 5, timeout=120)
    job_id = slurm_job_id(job.output())
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **slurm})
    assert job.wait(timeout=240) == 0, job.output()
    first, second = attempts(run_dir)
    assert first["reason"] == "preempted" and first["requeue"] is True and first["job_id"] == job_id
    assert "1 of at most 1" in first["why"]
    assert second["reason"] == "completed" and second["job_id"] == job_id
    for rank in (0, 1):
        exits = (run_dir / f"exits_rank{rank}.txt").read_text().splitlines()
        assert exits[0].startswith("stopped at") and exits[-1] == "finished at 100", exits


@pytest.mark.slurm
def test_a_stop_after_rank_0_is_done_requeues_the_slurm_script(run_dir: Path, slurm: dict[str, str]) -> None:
    """Rank 0's script is done when Slurm's USR2 comes: rank 1 tells the supervisor, which records the
    attempt as preempted and requeues the job; the next attempt finishes rank 1's count."""
    job = RunningJob(run_dir, "cluster=slurm", "resources.procs_per_node=2", f"+script.path={STOPPABLE}",
                     "+script.args=[300,2]", "cluster.wait=true", "cluster.max_preemptions=1",
                     "cluster.max_restarts=0", env=slurm)
    deadline = time.monotonic() + 120
    while not ((run_dir / "exits_rank0.txt").exists() and (run_dir / "progress_rank1.json").exists()):
        assert time.monotonic() < deadline, job.output()
        time.sleep(0.05)
    job_id = slurm_job_id(job.output())
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **slurm})
    assert job.wait(timeout=240) == 0, job.output()
    first, second = attempts(run_dir)
    assert first["reason"] == "preempted" and first["recorded_by"] == "supervisor" and first["requeue"] is True, first
    assert second["reason"] == "completed" and second["recorded_by"] == "supervisor", second
    exits = (run_dir / "exits_rank1.txt").read_text().splitlines()
    assert exits[0].startswith("stopped at") and exits[-1] == "finished at 300", exits


@pytest.mark.slurm
def test_a_job_whose_every_rank_failed_is_followed_through_its_requeue(run_dir: Path, slurm: dict[str, str]) -> None:
    """Every rank of the first attempt fails, leaving its error in submitit's result file, and the job
    is requeued: those files say done while the job pends and runs again. The follower follows it to
    its real end, and does not report the first attempt's errors as the job's."""
    proc = submit(run_dir, "cluster=slurm", "resources.procs_per_node=2", f"+script.path={SCRIPT}",
                  "+script.args=[--fail-first-attempt]", "cluster.wait=true", "cluster.max_restarts=1", env=slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, second = attempts(run_dir)
    assert first["reason"] == "failed" and first["requeue"] is True, first
    assert "exited with code 4" in first["error"], first
    assert second["reason"] == "completed" and second["job_id"] == first["job_id"], second
    assert "failed" not in proc.stdout.splitlines()[-1], proc.stdout
    assert all(json.loads((run_dir / f"seen_rank{r}.json").read_text())["rank_sum"] == 1.0 for r in (0, 1))


@pytest.mark.slurm
def test_a_sweep_whose_points_failed_first_is_followed_through_their_requeues(
    tmp_path: Path, slurm: dict[str, str]
) -> None:
    """The same as an array: each point's first attempt fails on every rank, and the sweep waits for
    the requeued points' real ends."""
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "gpujobs.submit", "-m", f"hydra.sweep.dir={sweep_dir}", "cluster=slurm",
           "resources.procs_per_node=1,2", f"+script.path={SCRIPT}", "+script.args=[--fail-first-attempt]",
           "cluster.wait=true", "cluster.max_restarts=1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **slurm})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for point in (0, 1):
        first, second = attempts(sweep_dir / str(point))
        assert first["reason"] == "failed" and first["requeue"] is True, first
        assert second["reason"] == "completed", second
