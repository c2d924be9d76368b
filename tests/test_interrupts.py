"""A local launcher that is interrupted takes its job with it, and says so in the ledger.

Ctrl-C, SIGTERM (a `kill`, systemd) and SIGHUP (a closed terminal) to the launcher kill the local job and
record its attempt as `cancelled`; the same command resumes. A launcher killed outright (SIGKILL) cannot
record anything, but its ranks end within a second of it (`gpujobs.attempt.orphan`), rank 0 recording the
attempt as `interrupted` first: the next submission of the run dir, which takes over the dead launcher's
lease, never trains beside them, and the ledger keeps every attempt.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import SLOW, read_result, submit
from jobctl import RunningJob, attempts

from gpujobs.attempt.evidence import descendants
from gpujobs.base.process import alive

STOPPABLE = Path(__file__).parent / "scripts" / "stoppable.py"


def _gone(pids: list[int], timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("how", ["ctrl-c", "SIGTERM"])
def test_an_interrupted_launcher_kills_its_job_and_records_it_cancelled(tmp_path: Path, how: str) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW)
    job.wait_for_step(21)  # checkpoint 20 is on disk
    ranks = list(job.local_rank_pids().values())
    tree = [*descendants(job.proc.pid), job.proc.pid]
    if how == "ctrl-c":  # the terminal sends SIGINT to the whole foreground group: launcher, controller, ranks
        for pid in tree:
            os.kill(pid, signal.SIGINT)
        signum = signal.SIGINT
    else:
        os.kill(job.proc.pid, signal.SIGTERM)
        signum = signal.SIGTERM
    assert job.wait(timeout=60) == 128 + signum, job.output()
    assert _gone(tree, timeout=10), [pid for pid in tree if alive(pid)]
    (line,) = attempts(run_dir)
    assert line["reason"] == "cancelled" and line["requeue"] is False and line["recorded_by"] == "launcher", line
    assert line["error"] == f"the launcher got {signal.Signals(signum).name}", line
    assert "Traceback" not in job.output().split("interrupted (")[-1], job.output()
    assert ranks and not (run_dir / "result.json").exists()
    again = submit(run_dir, *SLOW)  # the same command resumes
    assert again.returncode == 0, again.stdout + again.stderr
    cancelled, completed = attempts(run_dir)
    assert cancelled == line and completed["reason"] == "completed" and completed["resumed_from"], completed
    assert read_result(run_dir)["steps"] == 60


def test_the_ranks_of_a_launcher_killed_outright_end_with_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW)
    job.wait_for_step(12)
    ranks = list(job.local_rank_pids().values())
    os.kill(job.proc.pid, signal.SIGKILL)  # the launcher cannot record this attempt: rank 0 does
    assert _gone(ranks), [pid for pid in ranks if alive(pid)]
    (interrupted,) = attempts(run_dir)
    assert interrupted["reason"] == "interrupted" and interrupted["requeue"] is False, interrupted
    assert f"its launcher (pid {job.proc.pid}) was gone" in interrupted["error"], interrupted
    assert interrupted["steps_done"] >= 12 and interrupted["start_step"] == 0 and interrupted["start"], interrupted
    again = submit(run_dir, *SLOW)  # takes the dead launcher's lease over, and trains alone
    assert again.returncode == 0, again.stdout + again.stderr
    assert "taking over the stale lease" in again.stdout + again.stderr
    first, completed = attempts(run_dir)
    assert first == interrupted and completed["reason"] == "completed" and read_result(run_dir)["steps"] == 60
    assert completed["resumed_from"] == interrupted["saved"], (interrupted, completed)


def test_a_script_job_whose_launcher_is_killed_outright_is_recorded_interrupted(tmp_path: Path) -> None:
    """A script's rank 0 has no trainer, but it records the attempt its launcher no longer can all the same."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, "cluster=local", "resources.procs_per_node=2", f"+script.path={STOPPABLE}",
                     "+script.args=[400]")
    deadline = time.monotonic() + 120
    while not all((run_dir / f"progress_rank{rank}.json").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output()
        time.sleep(0.05)
    ranks = list(job.local_rank_pids().values())
    ranks += [pid for rank in ranks for pid in descendants(rank)]  # the scripts, too
    os.kill(job.proc.pid, signal.SIGKILL)
    assert _gone(ranks), [pid for pid in ranks if alive(pid)]
    (interrupted,) = attempts(run_dir)
    assert interrupted["reason"] == "interrupted" and interrupted["requeue"] is False, interrupted
    assert f"its launcher (pid {job.proc.pid}) was gone" in interrupted["error"], interrupted
    assert interrupted["world_size"] == 2 and interrupted["start"] < interrupted["end"], interrupted


def test_a_second_sigterm_while_the_first_is_handled_records_the_attempt_once(tmp_path: Path) -> None:
    """`kill` twice, 30 ms apart (systemd's stop and a user's, say): the second comes while the first
    kills the job; it must not cut that short, leaving two tracebacks and no line."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW)
    job.wait_for_step(12)
    os.kill(job.proc.pid, signal.SIGTERM)
    time.sleep(0.03)
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait(timeout=60) == 128 + signal.SIGTERM, job.output()
    (line,) = attempts(run_dir)
    assert line["reason"] == "cancelled" and line["error"] == "the launcher got SIGTERM", line
    assert "Traceback" not in job.output() and job.output().count("interrupted (SIGTERM)") == 1, job.output()


def test_usr2_to_the_local_launcher_stops_and_restarts_the_job_as_slurm_requeues_it(
    tmp_path: Path, straight_digest: str
) -> None:
    """USR2 to the launcher means what it means on Slurm: the ranks save an agreed checkpoint and stop,
    recorded `preempted`, and the next attempt resumes from it, losing nothing."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW)
    job.wait_for_step(15)
    os.kill(job.proc.pid, signal.SIGUSR2)
    assert job.wait() == 0, job.output()
    preempted, completed = attempts(run_dir)
    assert preempted["reason"] == "preempted" and preempted["requeue"] is True, preempted
    assert preempted["recorded_by"] == "rank 0" and preempted["why"] == "preempted 1 of at most 20", preempted
    assert completed["reason"] == "completed" and completed["resumed_from"] == preempted["saved"], completed
    assert completed["start_step"] == preempted["steps_done"]  # zero steps redone
    assert read_result(run_dir)["param_digest"] == straight_digest
