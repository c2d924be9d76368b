"""The NCCL flight recorder's dump on the watchdog's request, from a rank on any node.

A named pipe works only between processes of one host, so the watchdog leaves a request file in the run dir
and each rank's heartbeat thread writes it into the pipe torch listens on, in a private dir of the rank's
node. Here the rank and the watchdog are separate processes, and the watchdog runs in a mount namespace of
its own where the rank's node-local dir is an empty tmpfs: it cannot reach the pipe, as from another node.
There is no NCCL on the CPU: a thread in the rank process stands in for torch's NCCL monitor (it makes and
reads the pipe as torch's `DumpPipe` does, and writes a dump where torch would).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import missing

from gpujobs.attempt.evidence import NCCL_TRACE_STEM, dump_flight_recorder
from gpujobs.rundir import HEARTBEAT_DIR
from gpujobs.rundir.heartbeat import Beat, Heartbeat, flight_recorder_request_path, heartbeat_path, read_beat

RANK = 1
DUMP = b"\x80\x04flight recorder of rank 1"  # a pickle's first bytes: moved as bytes, never decoded

RANK_PROCESS = """
import os, sys, threading, time
from pathlib import Path
from gpujobs.attempt.evidence import nccl_debug_env
from gpujobs.rundir.heartbeat import Heartbeat

run_dir, rank, dump = Path(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
beat = Heartbeat(run_dir, rank, "node-a", 0.1).start()
env = nccl_debug_env(run_dir, 2000, beat.pipe_dir)
pipe = env["TORCH_NCCL_DEBUG_INFO_PIPE_FILE"] + f"{rank}.pipe"


def torch_monitor() -> None:
    # torch's stand-in: DumpPipe's mkfifo and non-blocking reads, then the dump to the temp file stem
    os.mkfifo(pipe, 0o666)
    fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    while True:
        try:
            asked = os.read(fd, 128)
        except BlockingIOError:
            asked = b""
        if asked:
            Path(env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] + str(rank)).write_bytes(dump)
        time.sleep(0.05)


threading.Thread(target=torch_monitor, daemon=True).start()
print(pipe, flush=True)
sys.stdin.readline()  # the test's word to end, as a rank ends
beat.close()
"""

WATCHDOG_PROCESS = """
import json, os, sys
from pathlib import Path
from gpujobs.attempt.evidence import dump_flight_recorder
from gpujobs.rundir.heartbeat import heartbeat_path, read_beat

run_dir, out, rank, pipe = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
beats = {rank: read_beat(heartbeat_path(run_dir, rank))}
found = dump_flight_recorder(run_dir, out, beats, 0.1)
print(json.dumps({"found": found, "pipe_seen": os.path.lexists(pipe)}))
"""


def start_rank(run_dir: Path, node_tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "TMPDIR": str(node_tmp)}
    return subprocess.Popen([sys.executable, "-c", RANK_PROCESS, str(run_dir), str(RANK), DUMP.hex()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def beat_with_recorder(run_dir: Path, rank: subprocess.Popen[str]) -> Beat:
    """The rank's heartbeat once it says torch made its pipe."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and rank.poll() is None:
        beat = read_beat(heartbeat_path(run_dir, RANK))
        if beat is not None and beat.flight_recorder:
            return beat
        time.sleep(0.05)
    rank.kill()
    pytest.fail(f"rank {RANK} never said it had a flight recorder (exit {rank.wait()})")


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """A run dir, and the rank's node-local temp dir (its $TMPDIR)."""
    run_dir, node_tmp = tmp_path / "run", tmp_path / "node-a-tmp"
    run_dir.mkdir()
    node_tmp.mkdir(mode=0o700)
    return run_dir, node_tmp


def test_a_watchdog_that_cannot_reach_the_ranks_pipe_gets_its_dump_through_the_heartbeat(
    dirs: tuple[Path, Path],
) -> None:
    run_dir, node_tmp = dirs
    out = run_dir / "hangs" / "1"
    out.mkdir(parents=True)
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        missing("unshare: no user and mount namespaces here")
    rank = start_rank(run_dir, node_tmp)
    try:
        assert rank.stdout is not None
        pipe = Path(rank.stdout.readline().strip())
        beat_with_recorder(run_dir, rank)
        pipe_dir = pipe.parent
        assert pipe_dir.parent == node_tmp and not pipe.is_relative_to(run_dir)
        assert stat.S_IMODE(pipe_dir.stat().st_mode) == 0o700 and stat.S_ISFIFO(pipe.stat().st_mode)
        # the watchdog sees node-a's temp dir as an empty tmpfs: as from another host, no pipe to open
        watchdog = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
             'mount -t tmpfs none "$1" && shift && exec "$@"', "sh", str(node_tmp),
             sys.executable, "-c", WATCHDOG_PROCESS, str(run_dir), str(out), str(RANK), str(pipe)],
            capture_output=True, text=True, timeout=30)
        assert watchdog.returncode == 0, watchdog.stderr
        assert json.loads(watchdog.stdout) == {"found": [RANK], "pipe_seen": False}
        assert (out / f"{NCCL_TRACE_STEM}{RANK}").read_bytes() == DUMP
        assert not flight_recorder_request_path(run_dir, RANK).exists()  # relayed once, then gone
        assert not (run_dir / HEARTBEAT_DIR / f"{NCCL_TRACE_STEM}{RANK}").exists()
        rank.communicate("end\n", timeout=10)
        assert rank.returncode == 0
        assert not pipe_dir.exists()  # a rank that ends leaves nothing in the node's temp dir
    finally:
        if rank.poll() is None:
            rank.kill()


def test_a_killed_ranks_pipe_dir_is_removed_by_the_next_rank_on_its_node(
    dirs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_dir, node_tmp = dirs
    rank = start_rank(run_dir, node_tmp)
    assert rank.stdout is not None
    pipe = Path(rank.stdout.readline().strip())
    beat_with_recorder(run_dir, rank)
    os.kill(rank.pid, signal.SIGKILL)  # as after a hang: no close, no cleanup
    rank.wait()
    assert pipe.parent.exists()
    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    beat = Heartbeat(run_dir, 0, "node-a", 3600).start()
    try:
        assert beat.pipe_dir is not None and list(node_tmp.iterdir()) == [beat.pipe_dir]
    finally:
        beat.close()
    assert list(node_tmp.iterdir()) == []


def test_a_dump_is_moved_into_the_evidence_but_a_link_in_its_place_is_not_followed(tmp_path: Path) -> None:
    run_dir, secret = tmp_path / "run", tmp_path / "secret"
    beats, out = run_dir / HEARTBEAT_DIR, run_dir / "hangs" / "1"
    beats.mkdir(parents=True)
    out.mkdir(parents=True)
    secret.write_text("the user's private file\n")
    (beats / f"{NCCL_TRACE_STEM}0").symlink_to(secret)  # planted where rank 0's dump goes
    (beats / f"{NCCL_TRACE_STEM}1").write_bytes(DUMP)
    found = dump_flight_recorder(run_dir, out, {r: Beat(r, 0, "node", "host", "run", 0.0) for r in (0, 1)}, 0.0)
    assert found == [1]
    assert (out / f"{NCCL_TRACE_STEM}1").read_bytes() == DUMP
    assert not os.path.lexists(out / f"{NCCL_TRACE_STEM}0")
    assert (beats / f"{NCCL_TRACE_STEM}0").is_symlink() and secret.read_text() == "the user's private file\n"


def test_a_rank_without_a_usable_temp_dir_runs_on_without_a_pipe_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    (tmp_path / "a-file").write_text("")
    node_tmp = tmp_path / "a-file" / "tmp"  # a $TMPDIR under a file: no dir can be made there, even by root
    monkeypatch.setattr(tempfile, "tempdir", str(node_tmp))
    beat = Heartbeat(tmp_path, 0, "node-a", 3600).start()
    try:
        assert beat.pipe_dir is None and beat.record().flight_recorder is False
    finally:
        beat.close()
    assert "rank 0 has no flight-recorder pipe" in caplog.text and "Not a directory" in caplog.text
