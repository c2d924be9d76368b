"""Faults caused for real in real runs: a full disk during a save, a damaged checkpoint, a reused run dir.

Each interrupted run must still end with the `param_digest` of an uninterrupted run. The integrity
faults run twice: with synchronous periodic saves and with `checkpoint.async=true`, where the write,
the agreement and the publishing happen in the background and must keep the same guarantees.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SLOW, compose_job, read_metrics, read_result, submit
from jobctl import RunningJob, attempts

from gpujobs.rundir import lease
from gpujobs.rundir.attempts import AttemptLog, AttemptNotRecorded


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A real filesystem of `size` mounted at `path` (tmpfs; needs root)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CI runs as root: the full-disk test needs to mount a small tmpfs")
        pytest.skip("mounting a small filesystem needs root")
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write into `directory` until its filesystem says ENOSPC; returns the filler file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as handle:  # unbuffered: nothing is left to fail at close
        try:
            while True:
                handle.write(b"\0" * 65536)
        except OSError as err:
            assert err.errno == 28, err
    return filler


#: The periodic saves of each variant: synchronous, and in the background.
SAVES = {"sync": (), "async": ("checkpoint.async=true",)}


def wait_published(job: RunningJob, checkpoint: Path, timeout: float = 60) -> None:
    """Block until `checkpoint` has its marker (a background save publishes some steps after its own)."""
    deadline = time.monotonic() + timeout
    while not (checkpoint / "COMPLETE").exists():
        if time.monotonic() > deadline or job.proc.poll() is not None:
            raise AssertionError(f"{checkpoint.name} never published:\n{job.output()}")
        time.sleep(0.02)


def periodic_saves_ran(run_dir: Path, saves: str) -> None:
    """The variant really saved as it says: metrics.jsonl records each save's kind (the last one, at
    step 60, is synchronous in both)."""
    records = read_metrics(run_dir)
    kinds = {r["async"] for r in records if r.get("kind") == "checkpoint" and r["step"] < 60}
    assert kinds == {saves == "async"}, kinds


@pytest.mark.parametrize("saves", sorted(SAVES))
def test_a_disk_that_fills_during_a_save_loses_nothing(tmp_path: Path, straight_digest: str, saves: str) -> None:
    run_dir = tmp_path / "run"
    with small_disk(run_dir / "checkpoints", "4m") as checkpoints:  # a save is ~1.1 MB: three fit
        job = RunningJob(run_dir, *SLOW, *SAVES[saves])
        job.wait_for_step(21)  # ~9 slowed steps before 30
        wait_published(job, checkpoints / "step_00000020")  # checkpoints 10 and 20 are published
        filler = fill(checkpoints)
        assert job.wait() == 1, job.output()
        out = job.output()
        assert "checkpoint at step 30 not saved" in out and "No space left on device" in out, out
        assert "last good: step 20" in out, out
        (line,) = attempts(run_dir)
        assert line["reason"] == "failed" and "CheckpointNotSaved" in line["error"]
        assert "step 30 not saved" in line["error"] and "last good: step 20" in line["error"]
        named = re.search(r"not saved \(rank (\d+)", line["error"])  # the rank whose write failed is the culprit
        assert named and line["culprit_rank"] == int(named.group(1)) and line["node"], line
        assert not (run_dir / "result.json").exists()
        published = sorted(p.name for p in checkpoints.iterdir() if (p / "COMPLETE").exists())
        assert published == ["step_00000010", "step_00000020"]  # intact: nothing pruned, nothing half-written
        assert not [p for p in checkpoints.iterdir() if p.name.startswith(".tmp-")]
        periodic_saves_ran(run_dir, saves)

        filler.unlink()  # space freed: the same command resumes
        again = submit(run_dir, *SLOW, *SAVES[saves])
        assert again.returncode == 0, again.stdout + again.stderr
    result = read_result(run_dir)
    assert result["resumed_from"].endswith("step_00000020")
    assert result["param_digest"] == straight_digest


@pytest.mark.parametrize("saves", sorted(SAVES))
def test_a_damaged_rank_file_sends_all_ranks_back_to_the_same_older_step(
    tmp_path: Path, straight_digest: str, saves: str
) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *SLOW, *SAVES[saves])
    job.wait_for_step(33)
    wait_published(job, run_dir / "checkpoints" / "step_00000030")
    job.signal_rank(1, signal.SIGKILL)  # the run fails (no restart budget) with checkpoints 20 and 30 on disk
    assert job.wait() == 1, job.output()
    periodic_saves_ran(run_dir, saves)
    newest = run_dir / "checkpoints" / "step_00000030"
    victim = newest / "rank_1.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte, same size: only the marker's checksum tells
    victim.write_bytes(bytes(data))

    again = submit(run_dir, *SLOW, *SAVES[saves])
    assert again.returncode == 0, again.stdout + again.stderr
    result = read_result(run_dir)
    assert result["resumed_from"].endswith("step_00000020") and result["start_step"] == 20
    assert result["param_digest"] == straight_digest
    last = attempts(run_dir)[-1]
    assert last["reason"] == "completed" and last["resumed_from"].endswith("step_00000020")
    (skipped,) = last["resume_skipped"]  # the fallback is recorded, never silent
    assert skipped["step"] == 30 and "rank 1: rank_1.pt fails its checksum" in skipped["why"]


def test_resuming_with_a_changed_model_key_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tiny = ("+experiment=rec", "+debug=tiny", "cluster=local")
    assert submit(run_dir, *tiny, "trainer.max_steps=4").returncode == 0
    before = sorted(os.listdir(run_dir / "checkpoints"))
    proc = submit(run_dir, *tiny, "model.embedding_dim=8")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("gpujobs:")]
    assert "model.embedding_dim (16 -> 8)" in line and "use a new run dir" in line
    assert sorted(os.listdir(run_dir / "checkpoints")) == before
    # what a step computes is the same: a longer run resumes, and is told that its schedule changed
    longer = submit(run_dir, *tiny, "trainer.max_steps=8", "trainer.log_every=2")
    assert longer.returncode == 0, longer.stdout + longer.stderr
    assert read_result(run_dir)["resumed_from"].endswith("step_00000004")
    assert "trainer.max_steps 4 -> 8 with optim.schedule=cosine: the steps after step_00000004" in longer.stderr
    # a run dir with nothing left to train is left as it is: no second `completed` line, the same result
    result, ledger = (run_dir / "result.json").read_text(), (run_dir / "attempts.jsonl").read_text()
    again = submit(run_dir, *tiny, "trainer.max_steps=8")
    assert again.returncode == 0 and "completed already (8 steps): nothing to run" in again.stdout, again.stderr
    assert (run_dir / "result.json").read_text() == result and (run_dir / "attempts.jsonl").read_text() == ledger
    constant = submit(run_dir, *tiny, "trainer.max_steps=10", "optim.schedule=constant")
    assert constant.returncode == 2 and "optim.schedule ('cosine' -> 'constant')" in constant.stderr


def test_resume_false_in_a_run_dir_with_checkpoints_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tiny = ("+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=4")
    assert submit(run_dir, *tiny).returncode == 0
    config = (run_dir / "config.yaml").read_text()
    proc = submit(run_dir, *tiny, "checkpoint.resume=false")
    assert proc.returncode == 2
    assert "checkpoint.resume=false" in proc.stderr and "use a new run dir, or remove them" in proc.stderr
    assert (run_dir / "config.yaml").read_text() == config  # nothing rewritten
    assert json.loads((run_dir / "result.json").read_text())["steps"] == 4


def test_a_prometheus_port_in_use_is_a_recorded_failed_attempt(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run_dir = tmp_path / "run"
        proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", f"telemetry.prometheus_port={port}")
    assert proc.returncode == 1
    (line,) = attempts(run_dir)  # inside the attempt, within its budget: not a crash before it
    assert line["reason"] == "failed" and "Address already in use" in line["error"], line
    assert f"the Prometheus endpoint cannot listen on 127.0.0.1:{port} (telemetry.prometheus_addr" in line["error"]
    assert "Address already in use" in proc.stdout


def test_a_result_that_cannot_be_written_leaves_the_completed_line_alone(tmp_path: Path) -> None:
    """result.json cannot replace a directory: the run fails after its `completed` line, and rank 0 must
    not add a second, `failed` line for the same attempt (nor requeue a finished run)."""
    run_dir = tmp_path / "run"
    (run_dir / "result.json").mkdir(parents=True)
    (run_dir / "result.json" / "keep").write_text("not empty")
    proc = submit(run_dir, "cluster=local", "resources.procs_per_node=1", "trainer.max_steps=20",
                  "cluster.max_restarts=2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = attempts(run_dir)
    assert line["reason"] == "completed" and line["steps_done"] == 20, line
    assert "job ended: completed" in proc.stdout, proc.stdout


def test_a_failed_attempt_names_the_newest_background_save_it_took(tmp_path: Path) -> None:
    """Saves every step in the background; rank 1 is killed. Rank 0's `failed` line says which checkpoint
    it saved last: the newest one published, or the one before it where that one was still in flight."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "model.embedding_dim=256",
                     "trainer.max_steps=400", "checkpoint.every_steps=1", "checkpoint.keep=3", "checkpoint.async=true",
                     "trainer.eval_every=0", "cluster.max_restarts=0")
    job.wait_for_step(30)
    os.kill(job.local_rank_pids()[1], signal.SIGKILL)
    assert job.wait(timeout=120) == 1, job.output()
    (line,) = attempts(run_dir)
    assert line["reason"] == "failed" and line["recorded_by"] == "rank 0", line
    published = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")
                       if (p / "COMPLETE").exists())
    saved = int(Path(line["saved"]).name.split("_")[1])
    assert saved in published and published[-1] - saved <= 1, (saved, published)


def leave_free(directory: Path, free: int) -> Path:
    """Fill `directory`'s filesystem up to `free` bytes left; returns the filler file."""
    stat = os.statvfs(directory)
    filler = directory / "filler"
    filler.write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - free))
    return filler


def test_a_ledger_line_a_full_disk_refuses_is_said_in_one_line(tmp_path: Path) -> None:
    """20 KB free under the run dir (its config, plan and lease take four of those five blocks): the ranks
    fail, no line of the ledger fits, and the restart cannot be started. Each is said in one line on stderr,
    not a traceback; the budget counted the attempt (`test_an_attempt_no_line_fits_is_still_counted...` shows
    the count going on)."""
    with small_disk(tmp_path / "disk", "4m") as disk:
        leave_free(disk, 20 * 1024)
        run_dir = disk / "run"
        proc = submit(run_dir, *SLOW, "cluster.max_restarts=1")
        ledger = (run_dir / "attempts.jsonl").read_text()
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    unwritten, unstarted = proc.stderr.splitlines()[-2:]
    assert unwritten == (f"gpujobs: attempt 1 ended failed (failed 1 of at most 1), but its line could not be "
                         f"written to {run_dir / 'attempts.jsonl'}: No space left on device; the budgets still "
                         "count it (kept in the lease)"), proc.stderr
    assert unstarted == f"gpujobs: attempt 2 could not be started in {run_dir / 'submitit'}: No space left on device"
    assert ledger == ""


def test_a_ledger_line_too_long_for_the_disk_is_written_without_its_details(tmp_path: Path) -> None:
    """A full disk whose attempts.jsonl has room left in its last block for a short line, not a long one
    (a failed attempt's error): the short line goes in, the long one leaves no torn part behind."""
    cluster = compose_job("cluster=local", "cluster.max_restarts=3").cluster
    with small_disk(tmp_path / "disk", "1m") as disk:
        log = AttemptLog(disk)
        log.record(cluster, "preempted", start=1.0, world_size=2)
        fill(disk)
        recorded = log.record(cluster, "failed", start=2.0, world_size=2, error="x" * 8192, saved="step_00000020")
        lines = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [line["reason"] for line in lines] == ["preempted", "failed"], lines
    assert "error" not in lines[1] and lines[1]["saved"] == "step_00000020" and lines[1]["world_size"] == 2, lines
    assert lines[1]["why"] == "failed 1 of at most 3 (written without its details: the disk was full)", lines
    assert recorded.to_json() == lines[1]


def test_an_attempt_no_line_fits_is_still_counted_and_written_once_there_is_room(tmp_path: Path) -> None:
    cluster = compose_job("cluster=local", "cluster.max_restarts=1").cluster
    with small_disk(tmp_path / "disk", "1m") as disk:
        log = AttemptLog(disk)
        filler = fill(disk)
        with pytest.raises(AttemptNotRecorded, match=r"attempt 1 ended failed .* No space left on device"):
            log.record(cluster, "failed", start=1.0)
        with pytest.raises(AttemptNotRecorded) as second:
            log.record(cluster, "failed", start=2.0)
        assert second.value.attempt.requeue is False and "budget exhausted" in second.value.attempt.why
        assert [a.attempt for a in log.read()] == [1, 2] and log.path.read_text() == ""
        filler.unlink()
        log.record(cluster, "cancelled", start=3.0)
        assert [a.attempt for a in log.read()] == [1, 2, 3] and not log.unrecorded
        assert [json.loads(line)["attempt"] for line in log.path.read_text().splitlines()] == [1, 2, 3]


def test_an_attempt_no_line_fits_is_counted_by_the_next_process_through_the_lease(tmp_path: Path) -> None:
    """A full disk takes no ledger line: the lease keeps the attempt (in the room kept beside it), so a
    log with nothing in memory (a fresh launcher, the supervisor after a requeue, rank 0) counts it too."""
    cluster = compose_job("cluster=local", "cluster.max_restarts=1").cluster
    with small_disk(tmp_path / "disk", "1m") as disk:
        lease.acquire(disk, lease.here())
        filler = fill(disk)
        with pytest.raises(AttemptNotRecorded, match=r"attempt 1 ended failed .*\(kept in the lease\)$"):
            AttemptLog(disk).record(cluster, "failed", start=1.0)
        with pytest.raises(AttemptNotRecorded, match=r"\(kept in the lease\)$") as second:
            AttemptLog(disk).record(cluster, "failed", start=2.0)
        assert second.value.attempt.attempt == 2 and second.value.attempt.requeue is False, second.value.attempt
        assert "budget exhausted" in second.value.attempt.why
        held = lease.read(disk)
        assert held is not None and [line["attempt"] for line in held.unrecorded] == [1, 2], held
        filler.unlink()
        AttemptLog(disk).record(cluster, "cancelled", start=3.0)
        lines = [json.loads(line) for line in (disk / "attempts.jsonl").read_text().splitlines()]
        held = lease.read(disk)
    assert [(line["attempt"], line["reason"]) for line in lines] == [(1, "failed"), (2, "failed"), (3, "cancelled")]
    assert lines[0]["why"] == "failed 1 of at most 1 (written without its details: the disk was full)", lines
    assert held is not None and held.unrecorded == [] and held.pid == os.getpid(), held


def test_a_completed_script_attempt_a_full_disk_refuses_is_said_in_two_lines(tmp_path: Path) -> None:
    """The launcher records a script job's `completed` attempt on a full disk: neither the line nor
    result.json fits. Each is said in one line on stderr, no traceback, and the launcher goes on (exit 0)."""
    script = Path(__file__).parent / "scripts" / "torchrun_style.py"
    with small_disk(tmp_path / "disk", "1m") as disk:
        run_dir = disk / "run"
        run_dir.mkdir()
        fill(disk)
        code = ("import sys, time; from pathlib import Path; from conftest import compose_job; "
                "from gpujobs.rank.script import record_completed; "
                f"job = compose_job('cluster=local', 'resources.procs_per_node=2', '+script.path={script}'); "
                f"record_completed(Path('{run_dir}'), job, 2, time.time() - 5, 5.0, recorded_by='launcher')")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).parent)
        left = {p.name: p.read_text() for p in run_dir.iterdir()}
    assert proc.returncode == 0, proc.stderr
    unrecorded, no_result = proc.stderr.splitlines()
    assert unrecorded.startswith("gpujobs: attempt 1 ended completed (completed), but its line could not be written "
                                 f"to {run_dir / 'attempts.jsonl'}: No space left on device"), proc.stderr
    assert no_result == (f"gpujobs: the run completed, but its result could not be written to "
                         f"{run_dir / 'result.json'}: No space left on device"), proc.stderr
    assert left == {"attempts.jsonl": ""}, left  # no torn line, no temp file of result.json
