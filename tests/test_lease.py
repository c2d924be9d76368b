"""One job per run dir: a second job is refused at submit, stands down on the job side, and a stale lease
is taken over. Real local runs and the live Slurm cluster; no part of the lease is faked."""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SLOW, read_result, sacct_state, slurm_job_id, submit
from jobctl import RunningJob, attempts

from gpujobs.base.process import boot_id, process_start
from gpujobs.rundir import lease


def test_a_second_local_submission_is_refused_and_the_first_completes(tmp_path: Path, straight_digest: str) -> None:
    run_dir = tmp_path / "run"
    first = RunningJob(run_dir, *SLOW)
    first.wait_for_step(6)
    frozen = first.freeze()  # the first job cannot end (and free its lease) while the second one starts
    started = time.monotonic()
    try:
        second = submit(run_dir, *SLOW, timeout=60)
    finally:
        first.thaw(frozen)
    assert second.returncode == 2, second.stdout + second.stderr
    assert time.monotonic() - started < 30  # refused without waiting for the first job
    (line,) = [x for x in second.stderr.splitlines() if x.startswith("gpujobs:")]
    assert f"in use by a local job (launcher pid {first.proc.pid}" in line and "one job per run dir" in line
    assert first.wait() == 0, first.output()
    assert [a["reason"] for a in attempts(run_dir)] == ["completed"]  # the refused one wrote no line
    assert read_result(run_dir)["param_digest"] == straight_digest


def test_a_stale_lease_is_taken_over_with_a_log_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a launcher that died without a word
    dead = lease.Lease("local", os.uname().nodename, gone.pid, None, 1.0)
    (run_dir / lease.LEASE_FILE).write_text(json.dumps(dead.__dict__))
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"taking over the stale lease of a local job (launcher pid {gone.pid}" in proc.stderr
    holder = lease.read(run_dir)
    assert holder is not None and holder.holder == "local" and holder.pid != gone.pid


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is no gpujobs launcher: what a lease's pid may be after a reboot or in a container."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_lease_naming_a_live_unrelated_process_is_taken_over_by_a_submit(
    tmp_path: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ticks = process_start(sleeper.pid)
    assert ticks is not None
    taken = {"holder": "local", "host": socket.gethostname(), "pid": sleeper.pid, "job_id": None,
             "since": time.time(), "start_ticks": str(int(ticks) - 100), "boot_id": boot_id()}
    (run_dir / lease.LEASE_FILE).write_text(json.dumps(taken))
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=debug", "trainer.max_steps=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (f"taking over the stale lease of a local job (launcher pid {sleeper.pid} on {socket.gethostname()}) "
            f"(pid {sleeper.pid} is another process now, not the launcher that took the lease)") in proc.stderr
    holder = lease.read(run_dir)
    assert holder is not None and holder.pid != sleeper.pid and holder.start_ticks is not None


@pytest.mark.parametrize("key", ["start_ticks", "boot_id", "since"])
def test_a_lease_holds_only_while_its_pid_is_the_process_that_took_it(
    tmp_path: Path, sleeper: subprocess.Popen[bytes], key: str
) -> None:
    """The lease's pid is live (a `sleep`): its start time, its boot or, in a lease of an older gpujobs that
    records neither, the time the lease was taken say whether it is the holder; pid alone says nothing."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    held = {"holder": "local", "host": socket.gethostname(), "pid": sleeper.pid, "job_id": None,
            "since": time.time(), "start_ticks": process_start(sleeper.pid), "boot_id": boot_id()}
    if key == "since":  # a lease of an older gpujobs: neither start time nor boot; taken before the pid started
        del held["start_ticks"], held["boot_id"]
    other = {"start_ticks": "1", "boot_id": "00000000-0000-0000-0000-000000000000", "since": held["since"] - 60}
    stale = {**held, key: other[key]}
    (run_dir / lease.LEASE_FILE).write_text(json.dumps(stale))
    judged = lease.check_free(run_dir)
    assert judged is not None and judged.pid == sleeper.pid
    (run_dir / lease.LEASE_FILE).write_text(json.dumps(held))
    with pytest.raises(lease.LeaseHeld, match=f"in use by a local job \\(launcher pid {sleeper.pid} .*\\(running\\)"):
        lease.check_free(run_dir)


def _take(run_dir: Path, go: Any, won: Any, done: Any) -> None:
    go.wait()
    try:
        lease.acquire(run_dir, lease.here())
        with won.get_lock():
            won.value += 1
    except lease.LeaseHeld:
        pass
    done.wait(30)  # the winner lives on until both have tried: a lease whose holder exited is stale


@pytest.mark.parametrize("old", ["stale", "torn"])
def test_two_takers_of_one_stale_lease_never_both_win(tmp_path: Path, old: str) -> None:
    """Both judge the lease stale at once: one takes the run dir, the other is refused (every time)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    text = json.dumps(lease.Lease("local", os.uname().nodename, gone.pid, None, 1.0).__dict__)
    ctx = multiprocessing.get_context("fork")
    for trial in range(25):
        run_dir = tmp_path / f"run{trial}"
        run_dir.mkdir()
        (run_dir / lease.LEASE_FILE).write_text(text if old == "stale" else text[:20])
        go, won, done = ctx.Event(), ctx.Value("i", 0), ctx.Barrier(2)
        takers = [ctx.Process(target=_take, args=(run_dir, go, won, done)) for _ in range(2)]
        for taker in takers:
            taker.start()
        time.sleep(0.05)
        go.set()
        for taker in takers:
            taker.join(30)
            assert taker.exitcode == 0
        assert won.value == 1, f"trial {trial}: {won.value} takers won"
        holder = lease.read(run_dir)
        assert holder is not None and holder.pid in {t.pid for t in takers}
        # nothing left aside (the spare is the room the winner keeps for a rewrite on a full disk)
        assert sorted(p.name for p in run_dir.iterdir()) == sorted([lease.LEASE_FILE, f".{lease.LEASE_FILE}.spare"])


def test_a_torn_lease_holds_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / lease.LEASE_FILE).write_text('{"holder": "lo')
    lease.acquire(run_dir, lease.here())
    held = lease.read(run_dir)
    assert held is not None and held.holder == "local" and held.pid == os.getpid()


def test_on_slurm_a_second_submission_is_refused_and_a_hand_run_duplicate_stands_down(
    tmp_path: Path, slurm: dict[str, str]
) -> None:
    run_dir = tmp_path / "run"
    overrides = ("+experiment=rec", "+debug=tiny", "cluster=slurm", "trainer.max_steps=200",
                 "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40")
    first = submit(run_dir, *overrides, env=slurm)
    assert first.returncode == 0, first.stdout + first.stderr
    job_id = slurm_job_id(first.stdout)
    holder = lease.read(run_dir)
    assert holder is not None and holder.job_id == job_id

    second = submit(run_dir, *overrides, env=slurm, timeout=60)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"in use by Slurm job {job_id}" in second.stderr

    env = {**os.environ, **slurm}
    deadline = time.monotonic() + 60
    while not (run_dir / "metrics.jsonl").exists():  # the first job trains
        assert time.monotonic() < deadline, "the first job never started"
        time.sleep(0.5)
    queued = subprocess.run(["sbatch", "--parsable", str(run_dir / "submit.sbatch")], env=env,
                            capture_output=True, text=True, check=True)
    duplicate = queued.stdout.strip().split(";")[0]
    assert sacct_state(duplicate, slurm, timeout=120) == "FAILED"  # exit 3: stood down
    log = (run_dir / "submitit" / f"{duplicate}_0_log.err").read_text()
    assert f"in use by Slurm job {job_id}" in log and f"this job ({duplicate}) stands down" in log

    assert sacct_state(job_id, slurm, timeout=180) == "COMPLETED"
    lines = attempts(run_dir)
    assert [a["reason"] for a in lines] == ["completed"] and lines[0]["job_id"] == job_id
    assert read_result(run_dir)["steps"] == 200
