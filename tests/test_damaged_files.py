"""What `status`, `cost`, `logs`, `cancel`, `resubmit` and a `-m` rerun read from a sweep dir or a run dir
that was damaged (by hand, by another tool) or cannot be read: one line naming the file and what is
wrong, exit 2, nothing written; never a traceback.

Each test damages a real file: a sweep.json cut short or of another shape, a config.yaml that is empty or
no YAML, a directory where a file belongs. chmod 000 does not stop root (the suite runs as root in CI),
so "cannot be read" is a directory in place of the file there, and also no permission where the tests
run as another user.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import compose_job
from test_sweep import gpujobs, sweep

from gpujobs.rundir.attempts import AttemptLog
from gpujobs.rundir.files import write_config

TINY = ("+experiment=rec", "+debug=tiny", "cluster=local")
#: Every command that reads a sweep dir's sweep.json, as a user types it.
COMMANDS = (("status",), ("cost",), ("logs",), ("cancel",), ("resubmit", "--failed"))
#: Ways a file cannot be read: a directory in its place; and, unless we are root, no permission.
UNREADABLE = ("directory", *(("no permission",) if os.geteuid() != 0 else ()))


def one_line(proc: object, starts: str) -> str:
    """The command exited 2 with one line on stderr that starts with `starts`, and printed nothing."""
    rc, out, err = proc.returncode, proc.stdout, proc.stderr  # type: ignore[attr-defined]
    assert rc == 2 and out == "", (rc, out, err)
    (line,) = err.splitlines()
    assert line.startswith(starts), line
    return str(line)


def make_unreadable(path: Path, how: str) -> None:
    """`path` is there but cannot be read."""
    if how == "directory":
        path.unlink(missing_ok=True)
        path.mkdir()
    else:
        path.touch()
        path.chmod(0)


def failed_local_run(run_dir: Path) -> Path:
    """A real config and a real failed attempt (as the local launcher records one): `cost` and `resubmit
    --failed` read the config of such a run."""
    job = compose_job(*TINY)
    write_config(run_dir, job)
    AttemptLog(run_dir).record(job.cluster, "failed", recorded_by="launcher", start=round(time.time() - 5, 3),
                               world_size=2, error="RuntimeError: boom")
    return run_dir


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("text", ['{"points": [', "", "[1, 2]", '{"points": {"x": 1}}',
                                  '{"points": [{"num": "a", "run_dir": "x"}]}'])
def test_a_damaged_sweep_json_is_one_line_and_exit_2(tmp_path: Path, text: str) -> None:
    sweep_dir = tmp_path / "sweep"
    failed_local_run(sweep_dir / "0")
    (sweep_dir / "sweep.json").write_text(text)
    before = snapshot(sweep_dir)
    # every command for the first damage (the reviewer's), `status` for the others: the same reader
    for command in COMMANDS if text == '{"points": [' else COMMANDS[:1]:
        proc = gpujobs(*command, str(sweep_dir), env={})
        one_line(proc, f"gpujobs: {sweep_dir / 'sweep.json'} is damaged: ")
    assert snapshot(sweep_dir) == before


def test_a_sweep_json_that_cannot_be_read_is_one_line_and_exit_2(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    for how in UNREADABLE:
        make_unreadable(sweep_dir / "sweep.json", how)
        one_line(gpujobs("status", str(sweep_dir), env={}), f"gpujobs: {sweep_dir / 'sweep.json'} cannot be read: ")


def test_a_sweep_rerun_into_a_dir_with_a_damaged_sweep_json_is_refused_before_any_point(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (sweep_dir / "sweep.json").write_text('{"points": [')
    # Hydra's basic sweeper makes each point's run dir before its task plans it: none may be left
    for sweeper in ("hydra/sweeper=basic", "hydra/sweeper=gpujobs"):
        proc = sweep(sweep_dir, *TINY, sweeper, "trainer.max_steps=2,3", env={})
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stderr.splitlines()[-1].startswith(f"gpujobs: {sweep_dir / 'sweep.json'} is damaged: "), proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert sorted(p.name for p in sweep_dir.iterdir()) == ["multirun.yaml", "sweep.json"]  # Hydra's own file
        assert (sweep_dir / "sweep.json").read_text() == '{"points": ['


@pytest.mark.parametrize(("text", "why"), [
    ("", "is damaged: it is empty"),
    ("model: [\n", "is damaged: not YAML ("),
    ("- 1\n- 2\n", "is damaged: a YAML list"),
    ("model:\n  _target_: 3\n", "is not a config this gpujobs can run: model._target_=3 is invalid"),
])
def test_a_damaged_config_is_one_line_naming_it(tmp_path: Path, text: str, why: str) -> None:
    run_dir = failed_local_run(tmp_path / "run")
    (run_dir / "config.yaml").write_text(text)
    before = snapshot(run_dir)
    for command in (("cost",), ("resubmit", "--failed")):
        one_line(gpujobs(*command, str(run_dir), env={}), f"gpujobs: {run_dir / 'config.yaml'} {why}")
    assert snapshot(run_dir) == before  # resubmit ran nothing


def test_a_config_that_cannot_be_read_is_one_line_naming_it(tmp_path: Path) -> None:
    run_dir = failed_local_run(tmp_path / "run")
    for how in UNREADABLE:
        make_unreadable(run_dir / "config.yaml", how)
        for command in (("cost",), ("resubmit", "--failed")):
            one_line(gpujobs(*command, str(run_dir), env={}), f"gpujobs: {run_dir / 'config.yaml'} cannot be read: ")


@pytest.mark.parametrize("name", ["attempts.jsonl", "metrics.jsonl", "slurm_jobs.jsonl"])
def test_a_jsonl_file_that_cannot_be_read_is_one_line_naming_it(tmp_path: Path, name: str) -> None:
    run_dir = failed_local_run(tmp_path / "run")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 0.5,
                                                        "samples_per_s": 10.0, "time": time.time()}) + "\n")
    for how in UNREADABLE:
        make_unreadable(run_dir / name, how)
        # resubmit reads the attempts (which failed) and the submissions, not the metrics
        for command in (("status",), ("cost",), *((("resubmit", "--failed"),) if name != "metrics.jsonl" else ())):
            one_line(gpujobs(*command, str(run_dir), env={}), f"gpujobs: {run_dir / name} cannot be read: ")
