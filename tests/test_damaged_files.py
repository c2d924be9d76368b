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
import subprocess
import sys
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
#: What else may stand where a JSON-lines file belongs, and what the commands say of it: a FIFO (which
#: blocks whoever opens it to read), a link planted there (never followed).
NOT_FILES = {"FIFO": "it is a FIFO, not a regular file",
             "link": "it is a symbolic link, not a regular file (gpujobs does not follow it)"}


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


@pytest.mark.timeout(60)  # a command blocked on the FIFO fails the test instead of hanging the suite
@pytest.mark.parametrize("name", ["attempts.jsonl", "metrics.jsonl", "slurm_jobs.jsonl"])
def test_a_fifo_or_a_link_in_place_of_a_jsonl_file_is_one_line_never_a_hang(tmp_path: Path, name: str) -> None:
    run_dir = failed_local_run(tmp_path / "run")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 0.5,
                                                        "samples_per_s": 10.0, "time": time.time()}) + "\n")
    elsewhere = tmp_path / "elsewhere.jsonl"  # what a planted link points at: a file of records
    elsewhere.write_bytes((run_dir / "attempts.jsonl").read_bytes() + (run_dir / "metrics.jsonl").read_bytes())
    path = run_dir / name
    for what, why in NOT_FILES.items():
        path.unlink(missing_ok=True)
        os.mkfifo(path) if what == "FIFO" else path.symlink_to(elsewhere)
        before = snapshot(tmp_path)
        # resubmit reads the attempts (which failed) and the submissions, not the metrics
        for command in (("status",), ("cost",), *((("resubmit", "--failed"),) if name != "metrics.jsonl" else ())):
            proc = subprocess.run([sys.executable, "-m", "gpujobs", *command, str(run_dir)], capture_output=True,
                                  text=True, timeout=15, env={**os.environ, "COLUMNS": "200"})
            one_line(proc, f"gpujobs: {path} cannot be read: {why}")
        assert snapshot(tmp_path) == before


def test_a_number_no_float_holds_skips_its_line_like_a_torn_one(tmp_path: Path) -> None:
    """1e999 parses to inf, which no step count survives; NaN and Infinity are no JSON at all. The line
    holding one is skipped; the rest of the file is read."""
    run_dir = failed_local_run(tmp_path / "run")
    good = {"kind": "train", "step": 1, "loss": 0.5, "samples_per_s": 10.0, "time": time.time(),
            "step_time_s": [0.1, 0.1], "local_time_s": [0.08, 0.07]}
    bad = ['{"kind": "eval", "step": 1e999, "auc": 0.7}',
           '{"kind": "plan", "step": 1, "mode": "off", "reason": "start", "shares": [1.0], "counts": [1e999]}',
           '{"kind": "eval", "step": 2, "auc": NaN}', '{"kind": "eval", "step": 3, "auc": -Infinity}']
    (run_dir / "metrics.jsonl").write_text("\n".join([json.dumps(good), *bad]) + "\n")
    for command in (("status",), ("cost",)):
        proc = gpujobs(*command, str(run_dir), env={})
        assert proc.returncode == 0 and proc.stderr == "", (command, proc.stderr)
    assert "loss=0.5000" in gpujobs("status", str(run_dir), env={}).stdout  # the train line, not an eval's auc
    plots = tmp_path / "plots"
    report = subprocess.run([sys.executable, "-m", "gpujobs.report", str(run_dir), "--out", str(plots)],
                            capture_output=True, text=True, timeout=60)
    assert report.returncode == 0 and report.stderr == "", report.stderr
    # the only plan line was the one with 1e999: no balance plot
    assert report.stdout.splitlines()[-1] == f"plots: {plots}/loss.png, {plots}/throughput.png, {plots}/step_time.png"
