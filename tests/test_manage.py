"""Readers of run-dir JSON-lines files carry on past torn and garbage lines, and status, logs, cancel and
resubmit tell the truth: about arrays that never started, about ids scancel could not cancel, and about
runs whose files say they are over while sacct cannot be asked.

The first tests read real files written here; then a real local run; then the live Slurm cluster.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SLOW, compose_job, read_result, submit
from jobctl import RunningJob
from test_sweep import TINY, array_of, gpujobs, job_ids, sweep, wait_final, wait_gone

from gpujobs.backends.follow import MetricsFollower
from gpujobs.backends.slurm.sacct import parse_sacct, sacct_state_of
from gpujobs.base.atomic import read_jsonl
from gpujobs.base.errors import GpujobsError
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.files import read_submissions, record_cancel, record_submission, write_config
from gpujobs.rundir.records import PlanRecord, Result, TrainRecord, read_metrics

#: What a crash leaves at the end of a JSON-lines file, and lines that are no record at all.
TORN, GARBAGE = '{"step": 1, "loss": 0.', ("garbage\n", "[1, 2]\n", '{"step": 7, "loss": 0.5}}\n')


def tear(run_dir: Path) -> list[str]:
    """Garbage lines, then a torn last line, at the end of every JSON-lines file of the run dir (and of a
    gpu.jsonl, which a run without NVML lacks, as a sampler that died mid-line would leave it)."""
    names = {p.name for p in run_dir.glob("*.jsonl")} | {"gpu.jsonl"}
    for name in names:
        with open(run_dir / name, "a") as handle:
            handle.write("".join(GARBAGE) + TORN)
    return sorted(names)


def rows(table: str) -> dict[str, str]:
    """The status table's rows by their first cell (the point number, or "-" for a single run)."""
    cells = [line.strip("│ ").split("│") for line in table.splitlines() if line.startswith("│")]
    return {cell[0].strip(): "│".join(cell) for cell in cells}


def test_sacct_records_of_arrays_that_never_started() -> None:
    """Lines as the live cluster printed them (Slurm 22.05): a held array cancelled task by task before
    accounting listed it is one bare `JOBID` record; other arrays are ranges with or without `%P`."""
    states = parse_sacct(
        "22936206|CANCELLED by 0\n"      # never started: one record for the whole array
        "22936199_[0-999%1]|PENDING\n"
        "22936201_[3,5-7]|CANCELLED by 0\n"
        "22936197_0|CANCELLED by 0\n22936197_[4-999]|PENDING\n"
        "22936213|COMPLETED\n"
    )
    assert [sacct_state_of(f"22936206_{i}", states) for i in (0, 999)] == ["CANCELLED", "CANCELLED"]
    assert sacct_state_of("22936199_500", states) == "PENDING" and sacct_state_of("22936199_1000", states) is None
    assert [sacct_state_of(f"22936201_{i}", states) for i in range(3, 9)] == [
        "CANCELLED", None, "CANCELLED", "CANCELLED", "CANCELLED", None]
    assert sacct_state_of("22936197_0", states) == "CANCELLED" and sacct_state_of("22936197_999", states) == "PENDING"
    assert sacct_state_of("22936197_2", states) is None  # cancelled while pending: only a cancel note knows
    assert sacct_state_of("22936213", states) == "COMPLETED" and sacct_state_of("1", states) is None


def test_follower_reads_a_torn_line_once_completed_and_skips_garbage(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    follower = MetricsFollower(path)
    assert list(follower.poll()) == []  # no file yet
    path.write_text('{"step": 1, "loss": 0.7}\n' + TORN)
    assert [r["step"] for r in follower.poll()] == [1]
    with open(path, "a") as handle:
        handle.write('5}\n')  # the rest of the torn line
    assert list(follower.poll()) == [{"step": 1, "loss": 0.5}]
    with open(path, "ab") as handle:  # garbage, a line torn inside a two-byte character, a line without a step
        handle.write("".join(GARBAGE).encode() + b'{"step": 2, "note": "' + "é".encode()[:1])
    assert list(follower.poll()) == []
    with open(path, "ab") as handle:
        handle.write("é".encode()[1:] + b'"}\n{"kind": "eval"}\n{"step": 3}\n')
    assert list(follower.poll()) == [{"step": 2, "note": "é"}, {"step": 3}]


def test_records_appended_after_a_torn_line_are_kept(tmp_path: Path) -> None:
    """A cancel note written after a crash tore the last line starts a line of its own."""
    record_submission(tmp_path, "41_3", tmp_path / "submitit")
    with open(tmp_path / "slurm_jobs.jsonl", "a") as handle:
        handle.write('{"job_id": "1; rm -rf /", "logs": "x"}\n' + TORN)
    record_cancel(tmp_path, "41_3")
    assert [(s.job_id, s.logs, s.cancelled is not None) for s in read_submissions(tmp_path)] == [
        ("41_3", tmp_path / "submitit", False), ("41_3", None, True)]
    assert len(read_jsonl(tmp_path / "slurm_jobs.jsonl")) == 3  # the odd id is a record, just not a job


def test_a_resume_plan_metrics_log_appends_after_a_torn_line_is_kept(tmp_path: Path) -> None:
    """The previous attempt died mid-line: the next attempt's MetricsLog (its first record is the resume's
    plan) starts a line of its own, and every record it writes is read back."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 5, "loss": 0.5, "samples_per_s": 9.0}\n' + TORN)
    metrics = MetricsLog(path)
    metrics.write(PlanRecord(step=5, mode="static", reason="resume", shares=[0.5, 0.5]))
    metrics.write(TrainRecord(step=6, loss=0.4, samples_per_s=9.0))
    metrics.close()
    assert [(r.step, type(r).__name__) for r in read_metrics(tmp_path)] == [
        (5, "TrainRecord"), (5, "PlanRecord"), (6, "TrainRecord")]
    assert path.read_text().splitlines()[1] == TORN  # left alone, on a line of its own


@pytest.mark.timeout(30)  # a follower blocked opening the FIFO fails the test instead of hanging the suite
def test_a_follower_of_a_fifo_says_so_instead_of_blocking(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    os.mkfifo(path)
    with pytest.raises(GpujobsError, match=f"^{path} cannot be read: it is a FIFO, not a regular file$"):
        list(MetricsFollower(path).poll())


def test_local_run_survives_garbage_in_its_metrics_and_the_tools_read_torn_files(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW)
    seen = job.wait_for_step(9)
    with open(run_dir / "metrics.jsonl", "a") as handle:  # between rank 0's lines, as it writes on
        handle.write("".join(GARBAGE) + TORN)
    assert job.wait() == 0, job.output()
    out = job.output()
    assert "gpujobs: status=completed steps=60" in out, out
    shown = [int(s) for s in re.findall(r"\] step (\d+)", out)]
    assert max(shown) == 60 and [s for s in shown if s > seen + 3], out  # still followed after the garbage

    assert tear(run_dir) == ["attempts.jsonl", "gpu.jsonl", "metrics.jsonl"]
    status = gpujobs("status", str(run_dir), env={})
    assert status.returncode == 0, status.stderr
    row = rows(status.stdout)["-"]
    assert "completed (files)" in row and "1 (completed)" in row and " 60 " in row, status.stdout
    # the files say the run is over: --watch ends (the old follower of states polled forever)
    watch = gpujobs("status", "--watch", "0.2", str(run_dir), env={})
    assert watch.returncode == 0 and "completed (files)" in watch.stdout, watch.stdout + watch.stderr
    cancel = gpujobs("cancel", str(run_dir), env={})
    assert (cancel.returncode, cancel.stdout) == (0, "gpujobs: cancelled nothing (no Slurm job)\n"), cancel.stderr
    logs = gpujobs("logs", str(run_dir), "--rank", "0", "--err", env={})  # a local rank's log, as a Slurm rank's
    assert logs.returncode == 0 and "[rank 0] attempt 1 ended: completed" in logs.stdout, logs.stdout + logs.stderr
    again = gpujobs("resubmit", "--failed", str(run_dir), env={})
    assert (again.returncode, again.stdout) == (1, "gpujobs: no failed points to resubmit\n"), again.stderr


def test_watch_ends_when_the_last_attempt_says_no_requeue(tmp_path: Path) -> None:
    """A run that failed for good has no result.json: its last attempt's `requeue: false` is final."""
    run_dir = tmp_path / "run"
    failed = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "task=jobs.rec.task:no_such_builder")
    assert failed.returncode == 1, failed.stdout + failed.stderr
    tear(run_dir)
    watch = gpujobs("status", "--watch", "0.2", str(run_dir), env={})
    assert watch.returncode == 0 and "failed (files)" in rows(watch.stdout)["-"], watch.stdout + watch.stderr


def test_status_shows_each_attempts_world_size_and_the_current_one(tmp_path: Path) -> None:
    """Written by the real writers: the ledger (one line per attempt, one of an older gpujobs without a
    world size), rank 0's metrics log and the result; `status` reads them as it reads any run dir."""
    run_dir = tmp_path / "run"
    job = compose_job("+experiment=rec", "+debug=tiny", "cluster=slurm", "resources.nodes=2",
                      "resources.min_nodes=1", "resources.procs_per_node=2")
    write_config(run_dir, job)

    def world_cells() -> tuple[str, str]:
        status = gpujobs("status", str(run_dir), env={})
        assert status.returncode == 0, status.stderr
        cells = [c.strip() for c in rows(status.stdout)["-"].split("│")]
        header = next(line for line in status.stdout.splitlines() if "attempts" in line)
        names = [c.strip() for c in header.strip("┃ ").split("┃")]
        return cells[names.index("world")], cells[names.index("attempts")]

    assert world_cells() == ("-", "0")
    ledger = AttemptLog(run_dir)
    ledger.record(job.cluster, "preempted", job_id="11", world_size=4)
    ledger.record(job.cluster, "failed", job_id="11")  # an older line: no world size
    ledger.record(job.cluster, "preempted", job_id="11", world_size=2, recorded_by="supervisor")
    assert world_cells() == ("2", "3 (preempted) world 4→?→2")  # nothing newer: the last attempt's
    metrics = MetricsLog(run_dir / "metrics.jsonl")  # the attempt now running trains on 3 ranks
    metrics.write(TrainRecord(step=40, loss=0.5, samples_per_s=900.0, step_time_s=[0.1] * 3))
    metrics.close()
    assert world_cells() == ("3", "3 (preempted) world 4→?→2")
    ledger.record(job.cluster, "completed", job_id="11", world_size=3)
    Result(status="completed", steps=40, world_size=3).write(run_dir)
    assert world_cells() == ("3", "4 (completed) world 4→?→2→3")


def state_cell(run_dir: Path) -> tuple[str, str]:
    """`status RUN_DIR`'s row of a single run: (its state, its step)."""
    status = gpujobs("status", str(run_dir), env={})
    assert status.returncode == 0, status.stderr
    header = next(line for line in status.stdout.splitlines() if "attempts" in line)
    names = [c.strip() for c in header.strip("┃ ").split("┃")]
    cells = [c.strip() for c in rows(status.stdout)["-"].split("│")]
    return cells[names.index("state")], cells[names.index("step")]


def test_status_of_a_local_run_says_running_while_it_trains_again_and_interrupted_once_killed(tmp_path: Path) -> None:
    """The lease of a live local launcher says running: on its first attempt (nothing recorded yet), and
    when a completed run trains further (its old result.json says completed, and --watch must wait).
    A launcher killed mid-run leaves `interrupted`, which is final and which `resubmit --failed` reruns here."""
    run_dir = tmp_path / "run"
    slow = [o for o in SLOW if not o.startswith("trainer.max_steps=")]
    first = RunningJob(run_dir, *slow, "trainer.max_steps=60")
    first.wait_for_step(9)
    frozen = first.freeze()  # mid-run for as long as status looks
    try:
        assert state_cell(run_dir)[0] == "running (files)"  # no attempt recorded yet: was `? (files)`
    finally:
        RunningJob.thaw(frozen)
    assert first.wait() == 0, first.output()
    assert state_cell(run_dir) == ("completed (files)", "60")

    further = RunningJob(run_dir, *slow, "trainer.max_steps=120")
    seen = further.wait_for_step(66)
    frozen = further.freeze()  # it stays mid-run while status and --watch look
    watch = subprocess.Popen([sys.executable, "-m", "gpujobs", "status", "--watch", "0.5", str(run_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "COLUMNS": "200"})
    try:
        state, step = state_cell(run_dir)
        assert state == "running (files)" and int(step) >= seen, (state, step)  # not the old result's 60
        assert watch.stdout is not None
        drawn = ""
        while "running (files)" not in drawn:  # --watch redraws: it did not end on the old result
            line = watch.stdout.readline()
            assert line, drawn + watch.communicate()[1]
            drawn += line
        RunningJob.thaw(frozen)
        assert further.wait() == 0, further.output()
        rest, err = watch.communicate(timeout=60)
    finally:
        RunningJob.thaw(frozen)
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0 and "completed (files)" in rest, rest + err
    assert state_cell(run_dir) == ("completed (files)", "120")

    killed = RunningJob(run_dir, *slow, "trainer.max_steps=180")
    killed.wait_for_step(126)
    killed.kill()  # the launcher and its ranks, SIGKILL: nobody records the attempt
    assert state_cell(run_dir)[0] == "interrupted (files)"
    watch_now = gpujobs("status", "--watch", "0.2", str(run_dir), env={})
    assert watch_now.returncode == 0 and "interrupted (files)" in watch_now.stdout, watch_now.stdout
    again = gpujobs("resubmit", "--failed", str(run_dir), env={})
    assert again.returncode == 0 and f"gpujobs: resubmitted {run_dir}\n" in again.stdout, again.stdout + again.stderr
    assert read_result(run_dir)["steps"] == 180 and state_cell(run_dir) == ("completed (files)", "180")


def test_status_of_a_local_sweep_while_it_runs(tmp_path: Path) -> None:
    """The sweep's launcher holds every point's lease it took: the point it finished is completed, the
    one it trains is running, and the one it has not reached has nothing to say yet."""
    sweep_dir = tmp_path / "sweep"
    slow = [o for o in SLOW if not o.startswith("trainer.max_steps=")]
    # hydra.mode=MULTIRUN: `-m` would have to come before the run dir RunningJob puts first
    job = RunningJob(sweep_dir / "1", "hydra.mode=MULTIRUN", f"hydra.sweep.dir={sweep_dir}", *slow,
                     "trainer.max_steps=6,60,6")
    job.wait_for_step(9)  # point 1's steps: point 0 is done
    frozen = job.freeze()
    try:
        status = gpujobs("status", str(sweep_dir), env={})
    finally:
        RunningJob.thaw(frozen)
    table = rows(status.stdout)
    assert status.returncode == 0, status.stderr
    assert ["completed (files)" in table["0"], "running (files)" in table["1"], "? (files)" in table["2"]] == [
        True] * 3, status.stdout
    assert job.wait() == 0, job.output()


def test_resubmit_failed_reruns_the_failed_points_of_a_local_sweep_here(tmp_path: Path) -> None:
    """What `status` calls failed, `resubmit --failed` brings back: locally, as the sweep ran its points."""
    sweep_dir = tmp_path / "sweep"
    tiny = ("+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=6")
    proc = sweep(sweep_dir, *tiny, "task=jobs.rec.task:build_task,jobs.rec.task:no_such_builder", env={})
    assert proc.returncode == 1 and "1 of 2 points ok, 1 failed" in proc.stderr, proc.stdout + proc.stderr
    status = gpujobs("status", str(sweep_dir), env={})
    table = rows(status.stdout)
    assert "completed (files)" in table["0"] and "failed (files)" in table["1"], status.stdout
    kept = (sweep_dir / "0" / "attempts.jsonl").read_text()

    broken = gpujobs("resubmit", "--failed", str(sweep_dir), env={})  # not repaired yet: it fails again
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert "gpujobs: point #1 (" in broken.stderr and "0 of 1 points ok, 1 failed" in broken.stderr, broken.stderr
    config = sweep_dir / "1" / "config.yaml"  # repaired, as a user fixing the cause would
    config.write_text(config.read_text().replace("no_such_builder", "build_task"))
    again = gpujobs("resubmit", "--failed", str(sweep_dir), env={})
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.endswith("gpujobs: resubmitted points 1\n"), again.stdout
    assert "sweep point #1:" in again.stdout and "sweep point #0:" not in again.stdout, again.stdout
    assert read_result(sweep_dir / "1")["status"] == "completed"
    assert (sweep_dir / "0" / "attempts.jsonl").read_text() == kept  # the completed point did not run
    done = gpujobs("resubmit", "--failed", str(sweep_dir), env={})
    assert (done.returncode, done.stdout) == (1, "gpujobs: no failed points to resubmit\n"), done.stderr


# ---------------------------------------------------------------- live cluster


def _wait_running(job_id: str, env: dict[str, str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                               env={**os.environ, **env}, check=False).stdout.strip()
        if state == "RUNNING":
            return
        time.sleep(0.3)
    raise AssertionError(f"{job_id} not running within {timeout} s")


def _scancel(*ids: str, env: dict[str, str]) -> None:
    subprocess.run(["scancel", *ids], env={**os.environ, **env}, check=False, timeout=30)


@pytest.mark.slurm
def test_torn_lines_in_a_slurm_sweep_and_cancel_says_what_it_could_not(tmp_path: Path, slurm: dict[str, str]) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, *TINY, "trainer.max_steps=12,100000", env=slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array = array_of(proc.stdout)
    resubmitted = ""
    try:
        assert wait_final(f"{array}_0", slurm) == "COMPLETED"
        _wait_running(f"{array}_1", slurm)
        for num in (0, 1):
            tear(sweep_dir / str(num))

        status = gpujobs("status", str(sweep_dir), env=slurm)
        assert status.returncode == 0, status.stderr
        table = rows(status.stdout)
        assert "COMPLETED" in table["0"] and " 12 " in table["0"] and "RUNNING" in table["1"], status.stdout
        logs = gpujobs("logs", "--point", "0", str(sweep_dir), env=slurm)
        assert logs.returncode == 0 and "completed" in logs.stdout, logs.stdout + logs.stderr
        # sacct cannot answer in time: the files (result.json) say point 0 is over, so --follow ends
        follow = gpujobs("logs", "--follow", "--point", "0", "--sacct-timeout", "0.001", str(sweep_dir), env=slurm)
        assert follow.returncode == 0 and follow.stdout == logs.stdout, follow.stdout + follow.stderr
        assert "sacct did not answer" in follow.stderr

        # point 0 has ended: scancel cannot cancel it, and says so; point 1 is cancelled and noted
        cancel = gpujobs("cancel", str(sweep_dir), env=slurm)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert f"cancelled {array}_1\n" in cancel.stdout and f"{array}_0 had already ended" in cancel.stdout
        assert [s.job_id for s in read_submissions(sweep_dir / "1") if s.cancelled] == [f"{array}_1"]
        assert not [s for s in read_submissions(sweep_dir / "0") if s.cancelled]
        assert wait_final(f"{array}_1", slurm) == "CANCELLED"

        nothing = gpujobs("resubmit", "--failed", str(sweep_dir), env=slurm)
        assert nothing.returncode == 1 and "no failed points" in nothing.stdout, nothing.stdout + nothing.stderr
        wait_gone(f"{array}_1", env=slurm)  # its lease holds while it is COMPLETING
        again = gpujobs("resubmit", "--failed", "--cancelled", str(sweep_dir), env=slurm)
        assert again.returncode == 0 and "resubmitted points 1\n" in again.stdout, again.stdout + again.stderr
        resubmitted = array_of(again.stdout)
        assert job_ids(sweep_dir / "1") == [f"{array}_1", f"{resubmitted}_0"]  # kept past the torn line
    finally:
        _scancel(array, *([resubmitted] if resubmitted else []), env=slurm)


@pytest.mark.slurm
def test_a_sweep_cancelled_before_it_started_shows_cancelled_and_comes_back(
    tmp_path: Path, slurm: dict[str, str]
) -> None:
    """The array is queued held (an `sbatch` in front of the real one adds `--hold`), then its tasks are
    cancelled one by one with plain scancel, leaving gpujobs no notes: what status shows comes from sacct."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = subprocess.run(["which", "sbatch"], capture_output=True, text=True, check=True).stdout.strip()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\nexec {real} --hold "$@"\n')
    (bin_dir / "sbatch").chmod(0o755)
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, *TINY, "trainer.seed=1,2,3",
                 env={**slurm, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    array = array_of(proc.stdout) if proc.returncode == 0 else ""
    second = ""
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _scancel(*(f"{array}_{i}" for i in range(3)), env=slurm)
        records = _sacct_records(array, slurm)
        assert len(records) == 1, records  # one record stands for the whole array, whatever its form
        status = gpujobs("status", str(sweep_dir), env=slurm)
        table = rows(status.stdout)
        assert status.returncode == 0 and [("CANCELLED" in table[str(i)]) for i in range(3)] == [True] * 3, (
            records, status.stdout, status.stderr)

        again = gpujobs("resubmit", "--failed", "--cancelled", str(sweep_dir), env=slurm)
        assert again.returncode == 0 and "resubmitted points 0, 1, 2" in again.stdout, again.stdout + again.stderr
        second = array_of(again.stdout)
        assert [wait_final(f"{second}_{i}", slurm) for i in range(3)] == ["COMPLETED"] * 3
        assert [read_result(sweep_dir / str(i))["status"] for i in range(3)] == ["completed"] * 3
    finally:
        _scancel(*(a for a in (array, second) if a), env=slurm)


def _sacct_records(array: str, env: dict[str, str], timeout: float = 30) -> list[str]:
    """sacct's records of `array` once it has any (accounting lags the controller by a few seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", array], capture_output=True,
                             text=True, env={**os.environ, **env}, check=False).stdout.splitlines()
        if out and all("CANCELLED" in line for line in out):
            return out
        time.sleep(0.5)
    raise AssertionError(f"sacct lists no cancelled record of {array} within {timeout} s")


def test_cli_entry_point_is_importable_without_torch() -> None:
    """The management commands are submit side: torch is never imported."""
    code = "import sys\nfrom gpujobs.__main__ import main\nassert 'torch' not in sys.modules\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
