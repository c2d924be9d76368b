"""Preemption and failure on a local job: the agreed stop, restarts within budgets, bounded failure.

Each interrupted run must end with parameters bit-identical to an uninterrupted run of the same
config (CPU, deterministic settings).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import SLOW, read_metrics, read_result, submit, uninterrupted_digest
from jobctl import RunningJob, attempts
from rec_store import store_from_arrays

from gpujobs.attempt.preemption import catch_early
from gpujobs.rank.stop import PreemptionWatcher
from jobs.rec.config import CriteoConfig


def test_usr2_to_one_rank_stops_all_at_the_same_step_and_loses_nothing(tmp_path: Path, straight_digest: str) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW)
    job.wait_for_step(15)
    job.signal_rank(1, signal.SIGUSR2)  # the other rank learns of it through the agreement
    assert job.wait() == 0, job.output()
    first, second = attempts(run_dir)
    assert first["reason"] == "preempted" and first["requeue"] is True
    # the ranks vote every stop_check_every (10) steps and read the vote one step later
    assert first["steps_done"] % 10 == 1, first
    assert first["saved"].endswith(f"step_{first['steps_done']:08d}")
    assert second["reason"] == "completed"
    assert second["start_step"] == first["steps_done"]  # zero steps redone
    assert second["resumed_from"] == first["saved"]
    assert read_result(run_dir)["param_digest"] == straight_digest
    # a train line is written a step after its log step (its gather runs meanwhile): the stop still
    # writes the one in flight, and each log step (every 3) of both attempts has exactly one line
    train = [record["step"] for record in read_metrics(run_dir) if record["kind"] == "train"]
    assert train == list(range(3, 61, 3)), train


def test_usr2_to_the_pid_the_submit_printed_preempts_and_gpujobs_logs_follows_both_attempts(
    tmp_path: Path, straight_digest: str
) -> None:
    """The pid a local submit prints takes `kill -USR2 PID` as a preemption (an agreed checkpoint, `preempted`
    in the ledger), and the run completes; `gpujobs logs RUN --rank 0` prints a local rank's log, and with
    --follow, started before the stop, goes on into the next attempt's file until the run is over."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW)
    job.wait_for_step(15)
    printed = re.search(r"^gpujobs: local job (\d+): `kill -USR2 (\d+)` preempts it", job.output(), re.M)
    assert printed and printed[1] == printed[2] == str(job.proc.pid), job.output()
    follow = subprocess.Popen([sys.executable, "-m", "gpujobs", "logs", str(run_dir), "--rank", "0", "--err",
                               "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        os.kill(int(printed[1]), signal.SIGUSR2)
        assert job.wait() == 0, job.output()
        followed, said = follow.communicate(timeout=60)
    finally:
        follow.kill()
    first, second = attempts(run_dir)
    assert first["reason"] == "preempted" and first["saved"].endswith(f"step_{first['steps_done']:08d}"), first
    assert second["reason"] == "completed" and second["resumed_from"] == first["saved"], second
    assert read_result(run_dir)["param_digest"] == straight_digest
    assert follow.returncode == 0, said
    ended = followed.index("[rank 0] attempt 1 ended: preempted")
    assert followed.index(f"[rank 0] resumed from {first['saved']}") > ended, followed
    assert "[rank 0] attempt 2 ended: completed" in followed, followed
    assert followed.rstrip().endswith("Exiting after successful completion"), followed  # to its end
    logs = subprocess.run([sys.executable, "-m", "gpujobs", "logs", str(run_dir), "--rank", "0"], capture_output=True,
                          text=True, timeout=60)
    assert logs.returncode == 0 and "global_rank=0(2)" in logs.stdout, logs.stdout + logs.stderr
    attempt_2 = re.findall(r"\(attempt 2, submitit job (\d+)\)", job.output())
    assert attempt_2 and f"job_id={attempt_2[0]}," in logs.stdout, logs.stdout  # the last attempt's log


def test_three_ranks_stopped_and_resumed_end_bit_identical_to_the_straight_run(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """3 ranks (a 3-GPU box): a ring sums 3 values in an order set by DDP's bucket layout, which a resumed
    run's fresh DDP would start from anew (`gpujobs.rank.buckets`); 2 ranks could not show it."""
    three = (*SLOW, "resources.procs_per_node=3")
    straight = uninterrupted_digest(tmp_path_factory, "straight3", *three)
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *three)
    job.wait_for_step(15)
    job.signal_rank(2, signal.SIGUSR2)
    assert job.wait() == 0, job.output()
    assert [line["reason"] for line in attempts(run_dir)] == ["preempted", "completed"]
    result = read_result(run_dir)
    assert (result["world_size"], result["param_digest"]) == (3, straight)


def test_a_stop_asked_for_in_the_last_window_lets_the_run_complete(tmp_path: Path) -> None:
    """USR2 after the check at step 40, with the next (and last) check at step 60: the run is finished by
    then, so the attempt completes once, instead of a `preempted` line and a requeue to redo nothing."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, "telemetry.debug_slow_ms=200", "trainer.stop_check_every=20",
                     "trainer.log_every=1")
    seen = job.wait_for_step(45)
    job.signal_rank(1, signal.SIGUSR2)
    assert seen < 57, seen  # the signal came well before the last step
    assert job.wait() == 0, job.output()
    (line,) = attempts(run_dir)
    assert line["reason"] == "completed" and line["steps_done"] == 60, line
    assert read_result(run_dir)["steps"] == 60


def test_usr2_while_a_rank_starts_is_kept_for_its_watcher() -> None:
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        catch_early()
        sent = time.time()
        os.kill(os.getpid(), signal.SIGUSR2)  # a real signal, before any watcher exists
        watcher = PreemptionWatcher().install()
        assert watcher.flagged and watcher.flagged_at is not None and sent <= watcher.flagged_at <= time.time()
        watcher.uninstall()
        later = PreemptionWatcher().install()  # the early signal was handed over once, not kept
        assert not later.flagged
        later.uninstall()
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_a_run_started_with_resume_false_resumes_its_own_checkpoints_after_a_stop(
    tmp_path: Path, straight_digest: str
) -> None:
    """resume=false says the submission starts from scratch; its second attempt must not redo (and then
    prune) what its first one saved."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, "checkpoint.resume=false")
    job.wait_for_step(15)
    job.signal_rank(0, signal.SIGUSR2)
    assert job.wait() == 0, job.output()
    first, second = attempts(run_dir)
    assert first["reason"] == "preempted" and second["reason"] == "completed"
    assert second["start_step"] == first["steps_done"] and second["resumed_from"] == first["saved"]
    assert read_result(run_dir)["param_digest"] == straight_digest


def test_killed_rank_restarts_from_the_checkpoint(tmp_path: Path, straight_digest: str) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, "cluster.max_restarts=1")
    job.wait_for_step(21)  # logged after checkpoint 20 is complete; ~9 slowed steps before checkpoint 30
    job.signal_rank(1, signal.SIGKILL)
    assert job.wait() == 0, job.output()
    first, second = attempts(run_dir)
    assert first["reason"] == "failed" and first["requeue"] is True
    assert "remote worker" in first["error"]  # gloo names the peer that went away
    assert "culprit_rank" not in first  # a killed rank leaves no error: rank 0's echo blames nobody
    assert first["start_step"] == 0 and first["saved"].endswith("step_00000020")  # what it did, as any line says
    assert second["reason"] == "completed" and second["resumed_from"].endswith("step_00000020")
    assert second["start_step"] == 20
    assert read_result(run_dir)["param_digest"] == straight_digest


def test_rank_0_killed_is_recorded_by_the_launcher_blaming_no_survivor(tmp_path: Path) -> None:
    """Rank 0 dies without a word; rank 1 fails of it and leaves its echo. The launcher's line must not
    name rank 1: a rank that left nothing may be the cause of every error the others left."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, "cluster.max_restarts=0")
    job.wait_for_step(12)
    job.signal_rank(0, signal.SIGKILL)
    assert job.wait() == 1, job.output()
    (line,) = attempts(run_dir)
    assert line["reason"] == "failed" and line["recorded_by"] == "launcher", line
    assert "culprit_rank" not in line and "rank 1:" not in line["error"], line
    assert line["error"].startswith("rank 0 left no error of its own (killed by a signal"), line
    assert "rank 1 failed after it: " in line["error"], line
    assert line["start"] < line["end"], line  # the attempt's span, for the GPU-hour ledger
    assert (run_dir / "failures" / "rank_1.json").exists()  # the echo was there to be (mis)read


def test_a_killed_peer_of_three_ranks_leaves_no_survivor_blamed(tmp_path: Path) -> None:
    """Rank 1 of 3 is killed; ranks 0 and 2 fail of it. Rank 2's echo may come before rank 0's own: rank 0
    must still blame nobody, as one rank left no file."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, "resources.procs_per_node=3", "cluster.max_restarts=0")
    job.wait_for_step(12)
    job.signal_rank(1, signal.SIGKILL)
    assert job.wait() == 1, job.output()
    (line,) = attempts(run_dir)
    assert line["reason"] == "failed" and line["recorded_by"] == "rank 0", line
    assert "culprit_rank" not in line and line["error"].startswith("rank 0: "), line


def test_dead_rank_does_not_hang_the_others(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # torch's own timeout, not the hang watchdog (which needs pg_timeout_s >= hang_timeout_s + 30)
    job = RunningJob(run_dir, *SLOW, "trainer.pg_timeout_s=20", "trainer.hang_timeout_s=0")
    job.wait_for_step(10)
    killed = time.monotonic()
    job.signal_rank(1, signal.SIGKILL)
    assert job.wait(timeout=60) == 1
    assert time.monotonic() - killed < 20 + 10  # within the process-group timeout, plus shutdown
    (last,) = attempts(run_dir)
    assert last["reason"] == "failed" and last["requeue"] is False
    assert "budget exhausted" in last["why"]
    assert "job ended: failed" in job.output()


def test_job_failing_every_attempt_stops_at_its_budget(tmp_path: Path) -> None:
    # a store that passes every check at submit (sizes and times as prepared) but whose categorical indices
    # are not the tables': every attempt fails at its first batch
    parser = CriteoConfig(store=str(tmp_path / "store"), hash_buckets=16).parser()
    bad = {"label": np.zeros(64, np.uint8), "dense": np.zeros((64, 13), np.float32),
           "sparse": np.full((64, 26), 17, np.int32)}
    splits = {"train": [bad], "eval": [bad]}
    store_from_arrays(tmp_path / "store", parser.name, parser.settings(), parser.columns(), splits)
    run_dir = tmp_path / "run"
    proc = submit(
        run_dir, "+experiment=rec", "cluster=local", "data=criteo", "trainer.max_steps=12", "resources.gpus_per_node=0",
        f"data.store={tmp_path / 'store'}", "data.hash_buckets=16", "data.batch_size=8", "cluster.max_restarts=2",
    )
    assert proc.returncode == 1
    lines = attempts(run_dir)
    assert [line["reason"] for line in lines] == ["failed"] * 3
    assert [line["requeue"] for line in lines] == [True, True, False]
    assert "categorical indices outside" in lines[-1]["error"] and f"data.store={tmp_path}" in lines[-1]["error"]
    assert "failed budget exhausted" in proc.stdout
    assert proc.stdout.count("restarting from the last checkpoint") == 2
