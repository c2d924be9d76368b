"""The one judge of an attempt's end (gpujobs.attempt.judge), and its ledger line written once, complete."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
from conftest import compose_job

from gpujobs.attempt.hangs import HangReport
from gpujobs.attempt.judge import AttemptEnd, judge, record_verdict
from gpujobs.attempt.preemption import record_attempt
from gpujobs.attempt.watchdog import Hang
from gpujobs.backends.slurm import control
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.records import Attempt

HANG = HangReport(Hang(stalled_s=31.0, limit_s=30.0, culprit=1, node="n1", why="stopped writing"), Path("/h/1"), 33.0)
RANK0_LINE = Attempt(attempt=1, reason="completed", requeue=False, why="completed", end=2.0, error=None)
LEFT = ("failed", {"error": "rank 1: boom", "culprit_rank": 1, "node": "n2"})


def test_the_ladder_first_match_wins() -> None:
    """Rank 0's line, then a hang, then ranks killed at the time limit, then every rank's exit 0, then what
    the ranks left, then the supervisor's own words: each rung wins over every rung below it."""
    end = AttemptEnd(ranks=2, started=1.0, exited_ok=False, recorded=RANK0_LINE, hang=HANG, left=LEFT,
                     error="srun exited with code 1", node="n3", timed_out=True)
    stood = judge(end)
    assert (stood.reason, stood.line, stood.recorded) == ("completed", None, RANK0_LINE)
    assert stood.error == HANG.attempt_fields()["error"]  # rank 0 said no error of its own
    hung = judge(dataclasses.replace(end, recorded=None, exited_ok=True))
    assert hung.reason == "hung" and hung.line is not None
    assert (hung.line["culprit_rank"], hung.line["node"], hung.line["world_size"]) == (1, "n1", 2)
    assert "start" not in hung.line  # where it began comes from the heartbeats, and there were none
    late = judge(dataclasses.replace(end, recorded=None, hang=None))
    assert (late.reason, late.line) == ("timeout", {"start": 1.0, "world_size": 2, "error": "srun exited with code 1"})
    end = dataclasses.replace(end, timed_out=False)
    done = judge(dataclasses.replace(end, recorded=None, hang=None, exited_ok=True))
    assert (done.reason, done.line) == ("completed", None)  # a trainer's rank 0 wrote its line itself
    script = judge(dataclasses.replace(end, recorded=None, hang=None, exited_ok=True, script=True))
    assert script.line == {"start": 1.0, "world_size": 2, "script_exit": 0}
    left = judge(dataclasses.replace(end, recorded=None, hang=None))
    assert (left.reason, left.error, left.line) == ("failed", "rank 1: boom", {"start": 1.0, "world_size": 2,
                                                                               **LEFT[1]})
    silent = judge(dataclasses.replace(end, recorded=None, hang=None, left=None))
    assert (silent.reason, silent.line) == ("failed", {"start": 1.0, "world_size": 2,
                                                        "error": "srun exited with code 1", "node": "n3"})


def test_a_supervisor_records_what_the_ranks_did_not_and_counts_the_budget(tmp_path: Path) -> None:
    job = compose_job("cluster=local", "cluster.max_restarts=1")
    ledger = AttemptLog(tmp_path)
    end = AttemptEnd(ranks=2, started=1.0, exited_ok=False, error="rank 1 left no error of its own")
    first = record_verdict(ledger, job, judge(end), recorded_by="launcher")
    second = record_verdict(ledger, job, judge(end), recorded_by="launcher")
    assert (first.requeue, first.why) == (True, "failed 1 of at most 1")
    assert second.requeue is False and "budget exhausted" in second.why
    lines = [json.loads(line) for line in ledger.path.read_text().splitlines()]
    assert [(a["attempt"], a["reason"], a["recorded_by"], a["error"]) for a in lines] == [
        (n, "failed", "launcher", "rank 1 left no error of its own") for n in (1, 2)]


def test_a_requeue_that_fails_is_said_in_the_one_line_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A preempted Slurm attempt whose `scontrol requeue` is refused: the line is written once, after the
    requeue, and says so (no line written first and amended: the ledger is only appended to).

    `scontrol` here is a stand-in on PATH that refuses, as slurmctld does for a job it does not know:
    this test runs without a cluster."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 'slurm_requeue error: Invalid job id specified' >&2\nexit 1\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setattr(control, "REQUEUE_TRIES", 1)
    job = compose_job("cluster=slurm", "cluster.max_preemptions=3")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    AttemptLog(run_dir).record(job.cluster, "preempted", job_id="4241", world_size=2)
    inode = (run_dir / "attempts.jsonl").stat().st_ino
    recorded = record_attempt(str(run_dir), job, "preempted", world_size=2, start=1.0)
    lines = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert (run_dir / "attempts.jsonl").stat().st_ino == inode  # appended to, never rewritten
    assert lines[-1] == recorded.to_json() and len(lines) == 2
    assert (recorded.requeue, recorded.job_id) == (False, "4242")
    assert recorded.why == ("preempted 2 of at most 3, but the requeue failed: scontrol failed: "
                            "slurm_requeue error: Invalid job id specified (`scontrol requeue 4242`)"), recorded.why
