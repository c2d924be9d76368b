"""The hang watchdog, for real: a rank is stopped (SIGSTOP) mid-run; the launcher must notice within
`trainer.hang_timeout_s` + 30 s, keep every rank's stacks, blame the stopped rank, leave no process of
the hung attempt behind, and restart the job from its checkpoint to the uninterrupted `param_digest`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import SLOW, read_result, slurm_job_id, uninterrupted_digest
from jobctl import RunningJob, attempts, slurm_rank_pids

from gpujobs.attempt.evidence import stopped, take_stacks
from gpujobs.base.process import alive
from gpujobs.rundir import HEARTBEAT_DIR
from gpujobs.rundir.heartbeat import Beat, stacks_path

HANG_TIMEOUT_S = 8
HANG = (*SLOW, f"trainer.hang_timeout_s={HANG_TIMEOUT_S}", "cluster.max_restarts=1")


def path_without_py_spy() -> str:
    """PATH with every directory that holds a py-spy left out (the faulthandler fallback)."""
    dirs = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "py-spy").exists()]
    return os.pathsep.join(dirs)


@pytest.mark.parametrize("stacks", ["py-spy", "faulthandler"])
def test_a_stopped_rank_is_found_hung_and_the_job_resumes(tmp_path: Path, straight_digest: str, stacks: str) -> None:
    if stacks == "py-spy" and shutil.which("py-spy") is None:
        pytest.fail("py-spy is part of the dev extras (gpujobs[hangs]): install them")
    env = {"PATH": path_without_py_spy()} if stacks == "faulthandler" else {}
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *HANG, env=env)
    job.wait_for_step(21)  # checkpoint 20 is on disk
    ranks = job.local_rank_pids()
    os.kill(ranks[1], signal.SIGSTOP)
    stopped_at = time.time()
    assert job.wait(timeout=180) == 0, job.output()

    hung, completed = attempts(run_dir)
    assert hung["reason"] == "hung" and hung["recorded_by"] == "launcher", hung
    assert hung["culprit_rank"] == 1 and "rank 1" in hung["error"] and "stopped running" in hung["error"], hung
    assert hung["requeue"] is True and hung["node"], hung
    assert hung["start_step"] == 0 and hung["steps_done"] >= 21, hung  # from the heartbeats
    assert hung["end"] - stopped_at <= HANG_TIMEOUT_S + 30, hung
    assert HANG_TIMEOUT_S <= hung["hung_s"] <= HANG_TIMEOUT_S + 30, hung
    assert not any(alive(pid) for pid in ranks.values())  # the stopped rank and its peer are gone

    evidence = Path(hung["evidence"])
    assert evidence == run_dir / "hangs" / "1"
    for rank in (0, 1):
        text = (evidence / f"rank_{rank}.txt").read_text()
        assert "Trainer.fit" in text or " in fit" in text, text  # py-spy's frame of the loop, or faulthandler's
    summary = json.loads((evidence / "hang.json").read_text())
    assert summary["culprit_rank"] == 1
    assert summary["stacks"]["1"].startswith(stacks), summary["stacks"]
    assert json.loads((evidence / "nvml.json").read_text())["node"]

    assert completed["reason"] == "completed" and completed["resumed_from"].endswith("step_00000020"), completed
    assert read_result(run_dir)["param_digest"] == straight_digest


_SLOW_DUMPER = """
import faulthandler, io, os, signal, sys, tempfile, threading, time
stacks = sys.argv[1]
def dump(signum, frame):
    with tempfile.TemporaryFile("w+") as whole:  # a real dump, written out in two parts with a pause between
        faulthandler.dump_traceback(whole, all_threads=True)
        whole.seek(0)
        text = whole.read()
    cut = text.index("Current thread")
    with open(stacks, "a") as out:
        out.write(text[:cut]); out.flush()
        time.sleep(1.0)  # descheduled mid-dump, as a rank on a busy node is
        out.write(text[cut:])
signal.signal(signal.SIGUSR1, dump)
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print(threading.main_thread().ident, flush=True)
while True:
    time.sleep(0.01)
"""


def test_stacks_are_taken_whole_from_a_rank_that_pauses_mid_dump(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose handler writes one thread, then stalls for a second, then the main thread: the evidence
    holds the main thread's frames (before, it was read 0.2 s after the first bytes, half a dump)."""
    monkeypatch.setenv("PATH", path_without_py_spy())  # the rank's own handler answers
    run_dir = tmp_path / "run"
    (run_dir / HEARTBEAT_DIR).mkdir(parents=True, mode=0o700)
    stacks = stacks_path(run_dir, 0)
    rank = subprocess.Popen([sys.executable, "-c", _SLOW_DUMPER, str(stacks)], stdout=subprocess.PIPE, text=True)
    try:
        main_thread = int(rank.stdout.readline())
        beat = Beat(rank=0, pid=rank.pid, node="n", host=socket.gethostname(), instance="i", started=0.0,
                    main_thread=main_thread)
        out = tmp_path / "evidence"
        out.mkdir()
        how = take_stacks(run_dir, out, {0: beat})
        text = (out / "rank_0.txt").read_text()
        assert how[0] == "faulthandler", how
        assert text.startswith("Thread 0x"), text  # the other thread's block first
        assert f"Current thread 0x{main_thread:016x}" in text and "in <module>" in text, text
    finally:
        rank.kill()
        rank.wait()


_ANSWERING_RANK = """
import faulthandler, signal, sys, threading, time
stacks = sys.argv[1]
def dump(signum, frame):
    with open(stacks, "a") as out:
        faulthandler.dump_traceback(out, all_threads=True)
        out.write(f"answered at {time.monotonic()}\\n")
signal.signal(signal.SIGUSR1, dump)
print(threading.main_thread().ident, flush=True)
while True:
    time.sleep(0.01)
"""


def test_a_stopped_rank_answers_before_a_running_rank_is_asked(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The running ranks are held while a stopped one is continued alone to write its stacks; a running rank
    asked first was held mid-dump and left half a dump (CI). So rank 0, running, is asked only once rank 1,
    stopped, has answered; and both answers are whole."""
    monkeypatch.setenv("PATH", path_without_py_spy())
    run_dir = tmp_path / "run"
    (run_dir / HEARTBEAT_DIR).mkdir(parents=True, mode=0o700)
    ranks = [subprocess.Popen([sys.executable, "-c", _ANSWERING_RANK, str(stacks_path(run_dir, rank))],
                              stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        beats = {rank: Beat(rank=rank, pid=proc.pid, node="n", host=socket.gethostname(), instance="i",
                            started=0.0, main_thread=int(proc.stdout.readline())) for rank, proc in enumerate(ranks)}
        os.kill(ranks[1].pid, signal.SIGSTOP)
        while not stopped(ranks[1].pid):  # the stop takes effect once the rank is scheduled (a busy machine)
            time.sleep(0.01)
        out = tmp_path / "evidence"
        out.mkdir()
        how = take_stacks(run_dir, out, beats)
        assert how == {0: "faulthandler",
                       1: "faulthandler (stopped: continued alone to write them, then stopped again)"}, how
        answered = {}
        for rank in (0, 1):
            text = (out / f"rank_{rank}.txt").read_text()
            assert f"Current thread 0x{beats[rank].main_thread:016x}" in text and "in <module>" in text, text
            answered[rank] = float(text.split("answered at ")[1])
        assert answered[1] < answered[0], answered
        assert stopped(ranks[1].pid)  # stopped again, not gone
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


_DYING_RANK = """
import os, signal, sys, threading, time
stacks = sys.argv[1]
def dump(signum, frame):  # a first thread's block, then the crash (faulthandler reading a running thread's frames)
    with open(stacks, "a") as out:
        out.write("Thread 0x00007f0000000001 (most recent call first):\\n")
    os.kill(os.getpid(), signal.SIGKILL)
signal.signal(signal.SIGUSR1, dump)
print(threading.main_thread().ident, flush=True)
while True:
    time.sleep(0.01)
"""


def test_a_stopped_rank_that_dies_answering_leaves_the_others_stopped_for_the_kill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1, stopped, dies while it writes its stacks (CI: faulthandler crashed it). Continued, rank 0 would
    find its peer gone and record a failure of its own before the watchdog's kill, and the attempt judged
    hung would be recorded `failed`: rank 0 is kept stopped instead, and not asked."""
    monkeypatch.setenv("PATH", path_without_py_spy())
    run_dir = tmp_path / "run"
    (run_dir / HEARTBEAT_DIR).mkdir(parents=True, mode=0o700)
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(stacks_path(run_dir, rank))], stdout=subprocess.PIPE,
                              text=True) for rank, code in enumerate((_ANSWERING_RANK, _DYING_RANK))]
    try:
        beats = {rank: Beat(rank=rank, pid=proc.pid, node="n", host=socket.gethostname(), instance="i",
                            started=0.0, main_thread=int(proc.stdout.readline())) for rank, proc in enumerate(ranks)}
        os.kill(ranks[1].pid, signal.SIGSTOP)
        while not stopped(ranks[1].pid):
            time.sleep(0.01)
        out = tmp_path / "evidence"
        out.mkdir()
        how = take_stacks(run_dir, out, beats)
        assert how[1] == "faulthandler (stopped: continued alone to write them, and died doing it)", how
        assert how[0].startswith("not asked: rank 1 died writing its stacks"), how
        assert ranks[1].wait(timeout=10) == -signal.SIGKILL
        assert stopped(ranks[0].pid)  # held for the kill, never continued
        assert not stacks_path(run_dir, 0).exists() or stacks_path(run_dir, 0).read_text() == ""  # never asked
        assert (out / "rank_0.txt").read_text().startswith("not asked")
        assert (out / "rank_1.txt").read_text().startswith("Thread 0x")  # what it wrote before it died
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


def test_a_hang_whose_evidence_cannot_be_kept_is_still_killed_and_recorded(tmp_path: Path) -> None:
    """A plain file where RUN_DIR/hangs/ goes: no stacks can be written, yet the hung attempt must die
    (no process left) and get its `hung` line."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *HANG[:-1], "cluster.max_restarts=0")
    job.wait_for_step(12)
    (run_dir / "hangs").write_text("a file where the evidence folder goes")
    ranks = job.local_rank_pids()
    os.kill(ranks[1], signal.SIGSTOP)
    assert job.wait(timeout=180) == 1, job.output()
    (hung,) = attempts(run_dir)
    assert hung["reason"] == "hung" and hung["culprit_rank"] == 1 and hung["requeue"] is False, hung
    assert not any(alive(pid) for pid in ranks.values()), ranks
    # no next attempt on this node: the supervisor removes the killed ranks' flight-recorder pipe dirs
    assert not [d for pid in ranks.values() for d in Path(tempfile.gettempdir()).glob(f"gpujobs-nccl-pipe-*-{pid}-*")]
    assert "could not keep the evidence of the hang" in job.output(), job.output()
    assert (run_dir / "hangs").read_text() == "a file where the evidence folder goes"


ON_SLURM = (
    "+experiment=rec", "+debug=tiny", "trainer.max_steps=200", "checkpoint.every_steps=50", "cluster=slurm",
    "resources.nodes=1", "resources.procs_per_node=2", "cluster.wait=true", "cluster.max_restarts=1",
    f"trainer.hang_timeout_s={HANG_TIMEOUT_S}", "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40",
)


@pytest.fixture(scope="module")
def slurm_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same training as ON_SLURM, uninterrupted, as 2 local ranks."""
    local = [o for o in ON_SLURM if not o.startswith(("cluster=", "resources.nodes", "cluster.wait"))]
    return uninterrupted_digest(tmp_path_factory, "reference", *local, "cluster=local")


def test_a_hung_attempt_leaves_no_prometheus_target_behind(tmp_path: Path) -> None:
    """Rank 0 announced its endpoint as a file_sd target and was killed for the hang before it could withdraw
    it: the launcher does, or an alert would fire for a job that is over."""
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir(mode=0o700)
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *HANG[:-1], "cluster.max_restarts=0", "telemetry.prometheus_port=0",
                     f"telemetry.prometheus_sd_dir={sd_dir}")
    job.wait_for_step(21)
    assert len(list(sd_dir.glob("gpujobs-*.json"))) == 1, list(sd_dir.iterdir())
    os.kill(job.local_rank_pids()[1], signal.SIGSTOP)
    assert job.wait(timeout=180) == 1, job.output()
    (hung,) = attempts(run_dir)
    assert hung["reason"] == "hung", hung
    assert list(sd_dir.iterdir()) == [], list(sd_dir.iterdir())


@pytest.mark.slurm
@pytest.mark.timeout(600)  # the run, the hang timeout, the requeue and the rest of the run
def test_a_hung_rank_on_slurm_requeues_on_the_other_node(
    tmp_path: Path, slurm: dict[str, str], slurm_reference: str
) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *ON_SLURM, env=slurm)
    job.wait_for_step(60)  # checkpoint 50 is on disk
    job_id = slurm_job_id(job.output())
    ranks = slurm_rank_pids(job_id)
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1], signal.SIGSTOP)
    stopped_at = time.time()
    assert job.wait(timeout=300) == 0, job.output()

    hung, completed = attempts(run_dir)
    assert hung["reason"] == "hung" and hung["recorded_by"] == "supervisor", hung
    assert hung["culprit_rank"] == 1 and hung["job_id"] == job_id, hung
    assert hung["end"] - stopped_at <= HANG_TIMEOUT_S + 30, hung
    sick = hung["node"]
    assert sick in ("node1", "node2") and hung["excluded"] == [sick], hung
    assert not any(alive(pid) for pid in ranks.values())
    for rank in (0, 1):  # a real Python stack of the training loop (rank 0 waits in whichever collective)
        text = (Path(hung["evidence"]) / f"rank_{rank}.txt").read_text()
        assert "Trainer.fit" in text or " in fit" in text, text  # py-spy's frame, or faulthandler's

    env = {**os.environ, **slurm}
    runs = subprocess.run(["sacct", "-X", "--duplicates", "-n", "-P", "-j", job_id, "-o", "NodeList,State"],
                          capture_output=True, text=True, check=True, env=env).stdout.split()
    nodes = [line.split("|")[0] for line in runs]
    assert sick in nodes[:1] and nodes[-1] != sick, runs  # the requeued run went to the other node
    assert completed["reason"] == "completed" and completed["resumed_from"].endswith("step_00000050"), completed
    assert read_result(run_dir)["param_digest"] == slurm_reference

    status = subprocess.run([sys.executable, "-m", "gpujobs", "status", str(run_dir)], capture_output=True,
                            text=True, env={**env, "COLUMNS": "80"}, check=True).stdout
    assert sick in status, status


def test_a_rank_stopped_in_a_save_is_hung_within_the_plain_limit(tmp_path: Path) -> None:
    """Rank 1 is stopped in a save, a phase slow by nature: a stopped process saves nothing, so the attempt
    is hung after `trainer.hang_timeout_s`, not after `trainer.hang_slow_phase_s` (10 min here) or torch's
    collective timeout, and the job restarts from its checkpoint."""
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "model.embedding_dim=256",
                     "trainer.max_steps=400", "checkpoint.every_steps=1", "checkpoint.keep=2", "trainer.eval_every=0",
                     "trainer.hang_timeout_s=5", "trainer.hang_slow_phase_s=600", "trainer.pg_timeout_s=630",
                     "cluster.max_restarts=1")
    job.wait_for_step(2)
    rank_1 = job.local_rank_pids()[1]
    beat = run_dir / "heartbeat" / "rank_1.json"
    deadline = time.monotonic() + 60
    while True:  # stop rank 1 where its heartbeat says it saves (what the watchdog reads of it)
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output()
        if json.loads(beat.read_bytes().strip() or b"{}").get("phase") == "checkpoint":
            os.kill(rank_1, signal.SIGSTOP)
            time.sleep(0.05)
            if json.loads(beat.read_bytes().strip())["phase"] == "checkpoint":
                break
            os.kill(rank_1, signal.SIGCONT)  # it wrote another phase as it stopped: again
    stopped_at = time.time()
    assert job.wait(timeout=240) == 0, job.output()
    hung, completed = attempts(run_dir)
    assert hung["reason"] == "hung" and hung["culprit_rank"] == 1 and "phase checkpoint" in hung["error"], hung
    assert hung["end"] - stopped_at < 5 + 30, hung
    assert not alive(rank_1)
    assert completed["reason"] == "completed" and completed["resumed_from"], completed
