"""A run dir is trusted only if it is the user's, and nothing in it is written through a planted link.

The planter is real: another user (65534, `nobody`) owns the directory (chown, as root), or links were
planted in a run dir of ours while someone else could still write it (its mode fixed since). Each test
looks at files outside the run dir, the links' targets, and checks that none changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, compose_job, missing, submit

from gpujobs.attempt import failures
from gpujobs.attempt.failures import RankFailure
from gpujobs.attempt.file_sd import FileSdTarget, withdraw_left_target
from gpujobs.attempt.hangs import HangWatchdog
from gpujobs.attempt.watchdog import Hang
from gpujobs.base.errors import ConfigError
from gpujobs.config.nccl import NcclSettings
from gpujobs.rank.srun import parse_args, run_dir_of
from gpujobs.rundir import PROMETHEUS_FILE
from gpujobs.rundir.heartbeat import Heartbeat
from gpujobs.rundir.nccl import export_nccl_env
from gpujobs.rundir.trust import Untrusted, check_dir

NOBODY = 65534


def snapshot(path: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry under `path` (links not followed): its mode and, for a file, its bytes."""
    found = {}
    for entry in [path, *sorted(path.rglob("*"))]:
        info = entry.lstat()
        found[str(entry)] = (info.st_mode, entry.read_bytes() if entry.is_file() and not entry.is_symlink() else b"")
    return found


@pytest.fixture
def victims(tmp_path: Path) -> Path:
    """Files and a folder of the user's outside any run dir: what a planted link points at."""
    outside = tmp_path / "home"
    outside.mkdir()
    (outside / ".bashrc").write_text("export PATH=/usr/bin\n")
    (outside / "dir").mkdir()
    return outside


@pytest.fixture
def foreign(tmp_path: Path, victims: Path) -> Path:
    """A run dir that user 65534 made, 0777, with links planted where the job writes."""
    if os.geteuid() != 0:
        missing("root: the foreign run dir is chowned to another user")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("heartbeat", "hangs", "checkpoints", "failures"):
        (run_dir / name).symlink_to(victims / "dir")
    (run_dir / PROMETHEUS_FILE).write_text(json.dumps({"sd_target": planted_target(victims / ".bashrc")}))
    for entry in (run_dir, *run_dir.iterdir()):
        os.lchown(entry, NOBODY, NOBODY)
    run_dir.chmod(0o777)
    return run_dir


def planted_target(path: Path) -> dict[str, object]:
    """What prometheus.json says of a target rank 0 announced, naming `path` instead."""
    info = path.lstat()
    return {"path": str(path), "dev": info.st_dev, "ino": info.st_ino}


def test_check_dir_takes_the_users_dirs_and_names_what_is_wrong_with_others(tmp_path: Path) -> None:
    mine, sticky, open_ = tmp_path / "mine", tmp_path / "sticky", tmp_path / "open"
    for path, mode in ((mine, 0o755), (sticky, 0o1777), (open_, 0o775)):
        path.mkdir()
        path.chmod(mode)
    check_dir("hydra.run.dir", mine)
    check_dir("hydra.run.dir", sticky)
    check_dir("hydra.run.dir", tmp_path / "not-yet")
    (tmp_path / "link").symlink_to(mine)  # a link to a dir of the user's is that dir
    check_dir("hydra.run.dir", tmp_path / "link")
    with pytest.raises(ConfigError, match=r"hydra.run.dir='.*/open' is invalid: allowed a directory of this "
                                          r"user's .*; it is writable by others: mode 0775"):
        check_dir("hydra.run.dir", open_)


def test_a_foreign_run_dir_with_planted_links_is_refused_at_submit(foreign: Path, victims: Path) -> None:
    before, inside = snapshot(victims), snapshot(foreign)
    proc = submit(foreign, "+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=2", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == (f"gpujobs: config error: hydra.run.dir='{foreign}' is invalid: allowed a directory of this "
                    "user's that no one else may write, unless sticky (chmod go-w, or chmod +t like /tmp); it is "
                    "owned by nobody (uid 65534), not by root (uid 0), mode 0777"), line
    assert snapshot(victims) == before
    assert snapshot(foreign) == inside


def test_a_foreign_sweep_dir_is_refused_at_submit(foreign: Path) -> None:
    (foreign / "multirun.yaml").symlink_to(foreign / "heartbeat")  # the sweeper's first write
    os.lchown(foreign / "multirun.yaml", NOBODY, NOBODY)
    inside = snapshot(foreign)
    proc = subprocess.run([sys.executable, "-m", "gpujobs.submit", "-m", "+experiment=rec", "+debug=tiny",
                           "cluster=local", f"hydra.sweep.dir={foreign}", "optim.lr=0.1,0.2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"gpujobs: config error: hydra.sweep.dir='{foreign}' is invalid" in proc.stderr, proc.stderr
    assert snapshot(foreign) == inside  # no point dir made in it, nothing written through its links


def test_another_users_submitit_folder_in_a_sticky_run_dir_is_refused_at_submit(tmp_path: Path) -> None:
    """A sticky run dir lets others add entries: one made the folder where submitit keeps the pickles it loads."""
    if os.geteuid() != 0:
        missing("root: the planted folder is chowned to another user")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o1777)
    run_dir.chmod(0o1777)
    (run_dir / "submitit").mkdir()
    os.chown(run_dir / "submitit", NOBODY, NOBODY)
    inside = snapshot(run_dir)
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=2", timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"gpujobs: config error: cluster.folder='{run_dir}/submitit' is invalid" in proc.stderr, proc.stderr
    assert snapshot(run_dir) == inside


def test_the_job_side_refuses_a_foreign_run_dir_before_reading_anything(foreign: Path) -> None:
    with pytest.raises(SystemExit, match=f"the run dir {foreign} is not trusted"):
        run_dir_of(parse_args(["--folder", str(foreign / "submitit"), str(foreign)]), None)


def test_a_run_dir_made_under_umask_002_is_the_users_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(["sh", "-c", 'umask 002 && exec "$0" -m gpujobs.submit "$@"', sys.executable,
                           f"hydra.run.dir={run_dir}", "+experiment=rec", "+debug=tiny", "cluster=debug",
                           "trainer.max_steps=1"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for path in (run_dir, run_dir / "checkpoints"):
        assert path.stat().st_mode & 0o022 == 0, (path, oct(path.stat().st_mode))


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A run dir of the user's, 0755 now, in which links were planted while others could write it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    return run_dir


def test_the_heartbeat_writes_through_no_planted_link(planted: Path, victims: Path) -> None:
    beats = planted / "heartbeat"
    beats.mkdir()
    (beats / "rank_0.json").symlink_to(victims / ".bashrc")
    os.link(victims / ".bashrc", beats / "rank_0.stacks")  # another name for a file outside
    before = snapshot(victims)
    with pytest.raises(Untrusted, match=r"rank_0\.json is a symlink"):
        Heartbeat(planted, 0, "node", 1.0).start()
    (beats / "rank_0.json").unlink()
    beat = Heartbeat(planted, 0, "node", 1.0)
    with pytest.raises(Untrusted, match=r"rank_0\.stacks is not a file of this run's"):
        beat.start()
    beat.close()
    assert snapshot(victims) == before


def test_a_planted_heartbeat_folder_is_not_followed(planted: Path, victims: Path) -> None:
    (planted / "heartbeat").symlink_to(victims / "dir")
    with pytest.raises(Untrusted, match="heartbeat is a symlink"):
        Heartbeat(planted, 0, "node", 1.0).start()
    assert list((victims / "dir").iterdir()) == []


def test_hang_evidence_goes_through_no_planted_link(planted: Path, victims: Path) -> None:
    (planted / "hangs").symlink_to(victims / "dir")
    killed = []
    job = compose_job("+experiment=rec", "+debug=tiny", "cluster=local")
    watchdog = HangWatchdog(planted, job, 1, "local:1", 1, kill=lambda: killed.append(True))
    watchdog.handle(Hang(stalled_s=1.0, limit_s=1.0, culprit=0, node=None, why="stopped"))
    assert killed == [True]  # the hung ranks die all the same
    assert list((victims / "dir").iterdir()) == []


def test_a_failure_and_nccl_files_go_through_no_planted_folder(planted: Path, victims: Path) -> None:
    (planted / "failures").symlink_to(victims / "dir")
    (planted / "nccl").symlink_to(victims / "dir")
    failures.leave(planted, RankFailure(rank=0, node="n", error="boom", at=1.0))
    with pytest.raises(Untrusted, match="nccl is a symlink"):
        export_nccl_env(NcclSettings(extra={"NCCL_DEBUG_FILE": "debug.%h.%p"}), planted)
    assert list((victims / "dir").iterdir()) == []


def test_a_planted_prometheus_json_deletes_nothing_and_rank_0s_target_is_still_withdrawn(
    planted: Path, victims: Path, tmp_path: Path
) -> None:
    (planted / PROMETHEUS_FILE).write_text(json.dumps({"sd_target": planted_target(victims / ".bashrc")}))
    withdraw_left_target(planted)
    assert (victims / ".bashrc").read_text() == "export PATH=/usr/bin\n"
    sd_dir = tmp_path / "sd"
    sd_dir.mkdir()
    target = FileSdTarget(sd_dir, "rec", planted)
    assert target.write("n1:9100", {"job": "rec", "run_dir": str(planted.resolve())})
    (planted / PROMETHEUS_FILE).write_text(json.dumps({"sd_target": target.identity()}))
    withdraw_left_target(planted)
    assert list(sd_dir.iterdir()) == []


def test_a_fifo_where_the_job_writes_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A FIFO planted where the job writes a file (no reader on it) is refused at once: before, opening it to
    write blocked the rank for as long as nobody read it."""
    import threading

    from gpujobs.rundir.trust import Untrusted, write_own

    planted = tmp_path / "rank_0.json"
    os.mkfifo(planted)
    outcome: list[BaseException] = []

    def write() -> None:
        try:
            write_own(planted, "{}")
        except BaseException as err:
            outcome.append(err)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(10)
    assert not writer.is_alive(), "write_own blocked on the FIFO"
    assert len(outcome) == 1 and isinstance(outcome[0], Untrusted) and "FIFO" in str(outcome[0])
