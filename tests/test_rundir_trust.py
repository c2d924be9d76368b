"""The run dir's remaining holes (issue 36): the directories above it, a directory of other files taken for
one, and a copy that shares its files with the original through hard links.

Each fault is real: a parent directory chowned to user 65534 (`nobody`, as root), a user's results in the
directory named as the run dir, a run dir copied with `cp -al`. Each test checks that nothing outside the
run dir changed, and the refusal is one line, exit 2.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, missing, submit
from test_trust import NOBODY, snapshot

from gpujobs.attempt.slurm_task import parse_args, run_dir_of
from gpujobs.base.errors import ConfigError
from gpujobs.rundir.trust import Untrusted, check_dir, check_run_dir, check_run_dir_files

TINY = ("+experiment=rec", "+debug=tiny", "cluster=debug")


@pytest.fixture
def theirs(tmp_path: Path) -> Path:
    """A directory of user 65534's, 0755: not root's, not the user's (root, here)."""
    if os.geteuid() != 0:
        missing("root: the parent directory is chowned to another user")
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, NOBODY, NOBODY)
    return parent


def refused(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line of a submission refused with exit 2."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_a_run_dir_under_another_users_directory_is_refused_at_submit(tmp_path: Path, theirs: Path) -> None:
    """The run dir's own owner and mode were checked, not its parents': user 65534 could rename the run dir
    and leave a link of theirs in its place."""
    run_dir = theirs / "run"
    before = snapshot(tmp_path)
    line = refused(submit(run_dir, *TINY, "trainer.max_steps=1", timeout=120))
    assert line == (f"gpujobs: config error: hydra.run.dir='{run_dir}' is invalid: allowed a directory under "
                    "directories that only root or this user may change, up to / (as OpenSSH's StrictModes holds "
                    f"a home); {theirs} above it is owned by nobody (uid 65534), mode 0755, and could have the run "
                    "dir swapped for a link"), line
    assert snapshot(tmp_path) == before


def test_a_sweep_dir_under_another_users_directory_is_refused_at_submit(tmp_path: Path, theirs: Path) -> None:
    """Sweep dirs are checked as run dirs are: their parents were not."""
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "gpujobs.submit", "-m", *TINY, "cluster=local",
                           f"hydra.sweep.dir={theirs / 'sweep'}", "optim.lr=0.1,0.2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    line = refused(proc)
    assert line.startswith(f"gpujobs: config error: hydra.sweep.dir='{theirs / 'sweep'}' is invalid"), line
    assert f"{theirs} above it is owned by nobody (uid 65534)" in line, line
    assert snapshot(tmp_path) == before


def test_the_job_side_refuses_a_run_dir_under_another_users_directory(theirs: Path) -> None:
    """The job side checked the run dir alone, before it reads submitit's pickle."""
    run_dir = theirs / "run"
    (run_dir / "submitit").mkdir(parents=True)
    with pytest.raises(Untrusted, match=f"the run dir {run_dir} is not trusted .*{theirs} above it is owned by nobody"):
        check_run_dir(run_dir)
    with pytest.raises(SystemExit, match=f"the run dir {run_dir} is not trusted"):
        run_dir_of(parse_args(["--folder", str(run_dir / "submitit"), str(run_dir)]), None)


def test_a_link_on_the_way_is_as_safe_as_the_directory_that_holds_it(tmp_path: Path, theirs: Path) -> None:
    """Both walks: a link of the user's to another's directory (resolved), and a link in another's directory
    to one of the user's (as written: its owner can point it elsewhere)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (tmp_path / "to-theirs").symlink_to(theirs)
    (theirs / "to-mine").symlink_to(mine)
    for run_dir in (tmp_path / "to-theirs" / "run", theirs / "to-mine" / "run"):
        with pytest.raises(ConfigError, match=f"{theirs} above it is owned by nobody"):
            check_dir("hydra.run.dir", run_dir)


def test_the_ordinary_places_pass(tmp_path: Path) -> None:
    """pytest's tmp dirs, /tmp (1777, sticky), the checkout, a link to a dir of the user's: all pass."""
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    (tmp_path / "link").symlink_to(sticky)
    for run_dir in (tmp_path / "run", sticky / "run", tmp_path / "link" / "run", Path("/tmp") / "gpujobs-not-made",
                    REPO / "outputs" / "rec" / "not-made", Path.home() / "not-made"):
        check_dir("hydra.run.dir", run_dir)


def test_a_directory_of_other_files_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    """A run dir pointed at an existing directory of the user's work was written among it (config.yaml,
    checkpoints/, and a completed run's result.json over its own)."""
    work = tmp_path / "work"
    (work / "results").mkdir(parents=True)
    (work / "results" / "model.pt").write_bytes(b"weights")
    before = snapshot(tmp_path)
    line = refused(submit(work, *TINY, "trainer.max_steps=1", timeout=120))
    assert line == (f"gpujobs: config error: hydra.run.dir='{work}' is invalid: allowed a new or empty directory, or "
                    "a run dir (one holding config.yaml, checkpoints/, attempts.jsonl, ...); it holds results and none "
                    "of a run dir's files: it is left as it is"), line
    assert snapshot(tmp_path) == before


def test_an_empty_directory_and_a_run_dir_are_taken(tmp_path: Path) -> None:
    empty, run, submitted = tmp_path / "empty", tmp_path / "run", tmp_path / "submitted"
    for path in (empty, run, submitted / "logs"):
        path.mkdir(parents=True)
    (run / "config.yaml").write_text("name: rec\n")
    (run / "notes.txt").write_text("mine\n")  # a user's note beside a run's files: still the run dir
    for path in (empty, run, tmp_path / "absent"):
        check_run_dir_files("hydra.run.dir", path)
    check_run_dir_files("hydra.run.dir", submitted, folder="logs")  # a submission that sbatch refused left it


def test_a_run_dir_copied_with_hard_links_is_refused_and_the_original_unchanged(tmp_path: Path) -> None:
    """`cp -al RUN COPY` then resuming COPY appended COPY's attempt and metrics to RUN's ledger (one file,
    two names)."""
    original, copy = tmp_path / "run", tmp_path / "copy"
    proc = submit(original, *TINY, "trainer.max_steps=2", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    subprocess.run(["cp", "-al", str(original), str(copy)], check=True)
    before = snapshot(original)
    line = refused(submit(copy, *TINY, "trainer.max_steps=4", timeout=120))
    assert line.startswith(f"gpujobs: config error: hydra.run.dir='{copy}' is invalid: allowed a run dir whose "
                           f"files each have one name; {copy}/"), line
    assert "has 2 (a hard link, as cp -al makes: the job would write the other names' file too; copy a run dir " \
           "with cp -a)" in line, line
    assert snapshot(original) == before
