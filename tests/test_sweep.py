"""Sweeps as job arrays, job management and sbatch export.

The first tests are pure (array specs, splitting, sacct parsing, the golden array script); the rest run
against the live Slurm cluster of scripts/local-slurm.sh.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, assert_golden, compose_job, read_result, sacct_state, submit
from omegaconf import OmegaConf

from gpujobs.backends.slurm.sacct import parse_sacct
from gpujobs.backends.slurm.sbatch import render_sbatch, sbatch_request
from gpujobs.base.errors import ConfigError
from gpujobs.launch.sweep import Point, SweepPlan, array_spec, chunks, header_groups
from gpujobs.rundir.files import config_yaml, read_submissions

TINY = ("+experiment=rec", "+debug=tiny", "cluster=slurm", "resources.procs_per_node=1")
GOOD, BAD = "task=jobs.rec.task:build_task", "task=jobs.rec.task:no_such_builder"  # BAD fails in the job


def _points(n: int, *overrides: str) -> list[Point]:
    job = compose_job("+experiment=rec", "cluster=slurm", *overrides)
    return [Point(i, [], job, Path(f"/runs/sweep/{i}")) for i in range(n)]


def test_array_spec_and_split_at_max_array_size() -> None:
    assert array_spec(6, None) == "0-5" and array_spec(6, 2) == "0-5%2"
    sizes = [len(chunk) for chunk in chunks(_points(2500), 1001)]
    assert sizes == [1001, 1001, 498]


def test_points_with_different_headers_get_different_arrays() -> None:
    one, two = _points(2), _points(1, "resources.nodes=2")
    groups = header_groups([one[0], two[0], one[1]], Path("/runs/sweep/submitit"))
    assert [[p.num for p in group] for group in groups] == [[0, 1], [0]]


def test_sacct_lines_with_pending_ranges() -> None:
    text = "17_0|COMPLETED\n17_[2-4%2]|PENDING\n17_1|CANCELLED by 0\n18|RUNNING\n19_[5,7]|PENDING\n"
    assert parse_sacct(text) == {
        "17_0": "COMPLETED", "17_1": "CANCELLED", "17_2": "PENDING", "17_3": "PENDING", "17_4": "PENDING",
        "18": "RUNNING", "19_5": "PENDING", "19_7": "PENDING",
    }


def test_slurm_points_cannot_share_a_fixed_prometheus_port() -> None:
    """Slurm may pack two points onto one node: one fixed port would fail all but one of them."""
    fixed = SweepPlan(Path("/runs/sweep"), _points(3, "telemetry.prometheus_port=9400"))
    with pytest.raises(ConfigError, match=r"telemetry.prometheus_port=9400 .* points #0 and #1 may share a node"):
        fixed.check_together()
    own_ports = [Point(i, [], compose_job("+experiment=rec", "cluster=slurm", f"telemetry.prometheus_port={9400 + i}"),
                       Path(f"/runs/sweep/{i}")) for i in range(3)]
    here = [Point(i, [], compose_job("+experiment=rec", "cluster=local", "telemetry.prometheus_port=9400"),
                  Path(f"/runs/sweep/{i}")) for i in range(3)]  # run one after another
    for points in (_points(3, "telemetry.prometheus_port=0"), _points(3), own_ports, here):
        SweepPlan(Path("/runs/sweep"), points).check_together()


@pytest.mark.parametrize(("first", "second"), [("a", "a/b"), ("a/b", "a")])
def test_a_point_inside_another_points_run_dir_or_around_it_is_refused(tmp_path: Path, first: str, second: str) -> None:
    """One run dir inside another's: its files would lie among the other point's (its checkpoints/, its
    submitit/), and `status` of the outer point would read a dir that is not its own."""
    job = compose_job("+experiment=rec", "+debug=tiny", "cluster=local")
    sweep_dir = tmp_path / "sweep"
    plan = SweepPlan(sweep_dir)
    plan.add(job, sweep_dir / first, 0, [])
    with pytest.raises(ConfigError) as refused:
        plan.add(job, sweep_dir / second, 1, [])
    assert str(refused.value) == (
        f"hydra.sweep.subdir='{second}' is invalid: allowed a dir per point inside the sweep dir {sweep_dir} (the "
        f"default is ${{hydra.job.num}}): points #0 and #1 would nest their run dirs {sweep_dir / first} and "
        f"{sweep_dir / second}")
    assert [point.num for point in plan.points] == [0]


def test_array_script_matches_the_golden_file() -> None:
    job = compose_job(
        "+experiment=rec", "cluster=slurm", "cluster.partition=debug", "cluster.time=00:30:00",
        "cluster.array_parallelism=2", "resources.procs_per_node=1", "nccl=ethernet",
    )
    folder = Path("/runs/rec/sweep/submitit")
    command = "/venv/bin/python -u -m gpujobs.rank.srun --folder /runs/rec/sweep/submitit --points /runs/p.txt"
    text = render_sbatch(sbatch_request(job, folder, command, array=array_spec(6, 2)))
    assert_golden(text, "rec_array_6x2.sbatch")


def test_config_yaml_writes_what_omegaconf_writes() -> None:
    job = compose_job("+experiment=rec", "cluster=slurm")
    tricky = {"unicode": "é 日本", "long": "word " * 40, "lines": "a\nb", "like_float": "1.0", "like_bool": "true",
              "like_null": "null", "interp": "${x}", "quotes": "it's \"q\"", "empty": "", "colon": "a: b",
              "list": [1, 2.5, None, True, "yes", {"k": []}], "map": {}, "tiny": 1e-30, "inf": float("inf")}
    changed = job.to_dict()
    changed["trainer"]["seed"] += 1  # a sweep's next point: its other sections' text is reused
    for values in (job.to_dict(), tricky, changed, {}):
        assert config_yaml(values) == OmegaConf.to_yaml(values)


# ---------------------------------------------------------------- live cluster


def sweep(
    sweep_dir: Path, *overrides: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -m gpujobs.submit -m ...` with its sweep dir at `sweep_dir`."""
    cmd = [sys.executable, "-m", "gpujobs.submit", "-m", f"hydra.sweep.dir={sweep_dir}", *overrides]
    return subprocess.run(cmd, cwd=sweep_dir.parent, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


def gpujobs(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m gpujobs ...` (status, logs, cancel, resubmit)."""
    return subprocess.run([sys.executable, "-m", "gpujobs", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "COLUMNS": "200", **env})


def job_ids(run_dir: Path) -> list[str]:
    """The Slurm jobs queued for `run_dir`, oldest first (submissions, not cancel notes)."""
    return [line.job_id for line in read_submissions(run_dir) if line.logs is not None]


def array_of(stdout: str) -> str:
    match = re.search(r"submitted Slurm job array (\d+)", stdout)
    assert match, stdout
    return match.group(1)


def wait_final(job_id: str, env: dict[str, str], timeout: float = 90) -> str:
    state = sacct_state(job_id, env, timeout)
    assert state not in ("", "PENDING", "RUNNING"), f"{job_id} still {state}"
    return state


def wait_gone(*ids: str, env: dict[str, str], timeout: float = 120) -> None:
    """Until squeue lists none of `ids`: accounting may call a job over while it is still COMPLETING, and
    until then it holds its run dir's lease (a resubmit is refused, as a second job on it would be)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"], capture_output=True, text=True,
                                env={**os.environ, **env}, check=False)
        if listed.returncode == 0 and not listed.stdout.strip():
            return
        if listed.returncode != 0 and "Invalid job id" in listed.stderr:  # purged: long gone
            return
        time.sleep(0.5)
    raise AssertionError(f"squeue still lists {', '.join(ids)} after {timeout} s")


@pytest.mark.slurm
def test_six_point_sweep_is_one_array(tmp_path: Path, slurm: dict[str, str]) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, *TINY, "optim.lr=1e-3,3e-3,1e-2", "model.embedding_dim=8,16", env=slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [sweep_dir / str(i) for i in range(6)]
    assert not all((r / "result.json").exists() for r in runs)  # returned before the points finished
    array = array_of(proc.stdout)
    assert proc.stdout.count("submitted Slurm job") == 1
    assert [job_ids(r) for r in runs] == [[f"{array}_{i}"] for i in range(6)]
    for i, run in enumerate(runs):
        assert wait_final(f"{array}_{i}", slurm) == "COMPLETED"
        assert read_result(run)["status"] == "completed"
        assert (run / "config.yaml").exists() and "#SBATCH --array" not in (run / "submit.sbatch").read_text()
    queued = (sweep_dir / "submitit" / f"{array}_submission.sh").read_text()
    assert "#SBATCH --array=0-5\n" in queued
    status = gpujobs("status", str(sweep_dir), env=slurm)
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("COMPLETED") == 6 and "model.embedding_dim=16" in status.stdout


@pytest.mark.slurm
def test_cancel_fail_and_resubmit_only_the_failed(tmp_path: Path, slurm: dict[str, str]) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, *TINY, f"{GOOD},{BAD.split('=')[1]}", "trainer.max_steps=12,100000", env=slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array = array_of(proc.stdout)
    # points: 0 good/12, 1 good/100000 (cancelled), 2 bad/12, 3 bad/100000 (both fail in the job)
    cancel = gpujobs("cancel", str(sweep_dir), "--point", "1", env=slurm)
    assert cancel.returncode == 0 and f"{array}_1" in cancel.stdout, cancel.stdout + cancel.stderr
    # sacct has no record of an array task cancelled while still pending: the status table knows anyway
    states = {i: wait_final(f"{array}_{i}", slurm) for i in (0, 2, 3)}
    assert states == {0: "COMPLETED", 2: "FAILED", 3: "FAILED"}
    status = gpujobs("status", str(sweep_dir), env=slurm)
    cells = [(line.split()[1:2], line) for line in status.stdout.splitlines()]
    rows = {first[0]: line for first, line in cells if first and first[0].isdigit()}
    assert "CANCELLED" in rows["1"] and "FAILED" in rows["2"] and "COMPLETED" in rows["0"], status.stdout

    # repair point 2 (as a user fixing the cause would), then bring back the failed ones only
    config = sweep_dir / "2" / "config.yaml"
    config.write_text(config.read_text().replace("no_such_builder", "build_task"))
    wait_gone(f"{array}_2", f"{array}_3", env=slurm)
    again = gpujobs("resubmit", "--failed", str(sweep_dir), env=slurm)
    assert again.returncode == 0, again.stdout + again.stderr
    second = array_of(again.stdout)
    assert "2 points" in again.stdout
    assert [len(job_ids(sweep_dir / str(i))) for i in range(4)] == [1, 1, 2, 2]
    assert job_ids(sweep_dir / "2")[-1] == f"{second}_0" and job_ids(sweep_dir / "3")[-1] == f"{second}_1"
    assert wait_final(f"{second}_0", slurm) == "COMPLETED" and wait_final(f"{second}_1", slurm) == "FAILED"
    assert read_result(sweep_dir / "2")["status"] == "completed"
    assert not (sweep_dir / "1" / "result.json").exists()


@pytest.mark.slurm
def test_one_bad_point_refuses_the_whole_sweep(tmp_path: Path, slurm: dict[str, str]) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, *TINY, "optim.lr=1e-3,-1,3e-3", env=slurm)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gpujobs")]
    assert lines == ["gpujobs: config error: optim.lr=-1.0 is invalid: allowed a number > 0 "
                     "(sweep point #1: " + " ".join(TINY) + " optim.lr=-1)"], proc.stderr
    assert "submitted" not in proc.stdout
    assert not sweep_dir.exists()


@pytest.mark.slurm
def test_a_sweep_that_sbatch_refuses_is_one_line_and_leaves_nothing(tmp_path: Path, slurm: dict[str, str]) -> None:
    sweep_dir = tmp_path / "sweep"  # no node has the feature: preflight passes it, sbatch refuses the array
    proc = sweep(sweep_dir, *TINY, "cluster.constraint=nosuchfeature", "trainer.seed=1,2", env=slurm)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gpujobs")]
    assert len(lines) == 1 and lines[0].startswith("gpujobs: sbatch refused the job: "), proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr and "submitted" not in proc.stdout
    assert not sweep_dir.exists(), sorted(str(p) for p in sweep_dir.rglob("*"))  # no sweep.json, no point dirs


def test_a_slurm_sweep_on_one_fixed_prometheus_port_is_refused_and_leaves_nothing(
    tmp_path: Path, slurm: dict[str, str]
) -> None:
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, *TINY, "telemetry.prometheus_port=9400", "trainer.seed=1,2", env=slurm)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gpujobs")]
    assert lines == ["gpujobs: config error: telemetry.prometheus_port=9400 is invalid: allowed 0 (a free port for "
                     "each point, written to its prometheus.json and file_sd target) or a port per point in a "
                     "Slurm sweep: points #0 and #1 may share a node"], proc.stderr
    assert "submitted" not in proc.stdout and not sweep_dir.exists()
    apart = sweep(sweep_dir, *TINY, "cluster.dry_run=true", "telemetry.prometheus_port=9400,9401", env=slurm)
    assert apart.returncode == 0, apart.stderr


@pytest.mark.slurm
def test_dry_run_prints_the_script_and_writes_nothing(tmp_path: Path, slurm: dict[str, str]) -> None:
    single = submit(tmp_path / "run", *TINY, "cluster.dry_run=true", env=slurm)
    assert single.returncode == 0, single.stderr
    assert single.stdout.startswith("#!/bin/bash\n") and "gpujobs.rank.srun" in single.stdout
    assert "--array" not in single.stdout
    swept = sweep(tmp_path / "sweep", *TINY, "cluster.dry_run=true", "cluster.array_parallelism=1",
                  "optim.lr=1e-3,3e-3", env=slurm)
    assert swept.returncode == 0, swept.stderr
    assert "#SBATCH --array=0-1%1\n" in swept.stdout and "--points" in swept.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slurm
def test_exported_script_queued_by_hand_trains_again_to_the_same_digest(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    first = submit(run_dir, *TINY, "cluster.wait=true", env=slurm)
    assert first.returncode == 0, first.stdout + first.stderr
    by_hand = subprocess.run(["sbatch", str(run_dir / "submit.sbatch")], capture_output=True, text=True,
                             cwd=tmp_path, env={**os.environ, **slurm}, timeout=30)
    job_id = by_hand.stdout.split()[-1]
    assert wait_final(job_id, slurm) == "COMPLETED"
    rerun = read_result(run_dir / "reruns" / job_id)
    assert rerun["status"] == "completed" and rerun["steps"] == 12  # trained again, from step 0
    assert rerun["param_digest"] == read_result(run_dir)["param_digest"]


@pytest.mark.slurm
def test_hundred_points_are_queued_with_one_sbatch(tmp_path: Path, slurm: dict[str, str]) -> None:
    """A logging `sbatch` in front of the real one counts the calls."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "sbatch_calls"
    bin_dir.mkdir()
    real = subprocess.run(["which", "sbatch"], capture_output=True, text=True).stdout.strip()
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {real} "$@"\n')
    (bin_dir / "sbatch").chmod(0o755)
    env = {**slurm, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = sweep(tmp_path / "sweep", *TINY, "cluster.array_parallelism=1", "trainer.seed=range(0,100)", env=env)
    array = array_of(proc.stdout) if proc.returncode == 0 else ""
    subprocess.run(["scancel", array], env={**os.environ, **slurm}, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(calls.read_text().splitlines()) == 1
    assert "#SBATCH --array=0-99%1" in (tmp_path / "sweep" / "submitit" / f"{array}_submission.sh").read_text()


@pytest.mark.slurm
def test_sweeper_derived_configs_match_composing_every_point(tmp_path: Path, slurm: dict[str, str]) -> None:
    """The gpujobs sweeper composes once; Hydra's basic sweeper composes each point: same dirs, same configs."""
    subdir = "hydra.sweep.subdir=${hydra.job.num}_${hydra.job.override_dirname}"
    swept = ("optim.lr=1e-3,3e-3", "trainer.seed=range(1,3)", "++trainer.max_steps=12,13")
    runs = {}
    for sweeper in ("gpujobs", "basic"):
        sweep_dir = tmp_path / sweeper
        proc = sweep(sweep_dir, *TINY, "cluster.array_parallelism=1", subdir, f"hydra/sweeper={sweeper}", *swept,
                     env=slurm)
        subprocess.run(["scancel", array_of(proc.stdout)], env={**os.environ, **slurm}, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert ("(gpujobs launcher, one composition)" in proc.stdout) == (sweeper == "gpujobs"), proc.stdout
        runs[sweeper] = {p.name: (p / "config.yaml").read_text() for p in sweep_dir.iterdir() if p.name != "submitit"
                         and p.is_dir()}
    last = [name for name in runs["gpujobs"] if name.startswith("7_++trainer.max_steps=13,")]
    assert len(runs["gpujobs"]) == 8 and len(last) == 1 and last[0].endswith("optim.lr=0.003,"
                                                                             + ",".join(TINY[3:]) + ",trainer.seed=2")
    assert runs["gpujobs"] == runs["basic"]


@pytest.mark.slurm
def test_sweeper_params_reach_every_derived_point(tmp_path: Path, slurm: dict[str, str]) -> None:
    """`hydra.sweeper.params` from a config: its plain values are not in the sweep's own composition (made
    from the command line), so every derived point sets them, as composing the point would."""
    extra = tmp_path / "conf" / "experiment"
    extra.mkdir(parents=True)
    (extra / "swept.yaml").write_text("# @package _global_\ndefaults:\n  - rec\n"
                                      "hydra:\n  sweeper:\n    params:\n      optim.lr: '0.5'\n"
                                      "      trainer.seed: 1,2\n")
    runs = {}
    for sweeper in ("gpujobs", "basic"):
        sweep_dir = tmp_path / sweeper
        proc = sweep(sweep_dir, f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "+experiment=swept", *TINY[1:],
                     f"hydra/sweeper={sweeper}", env=slurm)
        subprocess.run(["scancel", array_of(proc.stdout)], env={**os.environ, **slurm}, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[sweeper] = {p.name: (p / "config.yaml").read_text() for p in sweep_dir.iterdir() if p.name.isdigit()}
    assert "  lr: 0.5\n" in runs["gpujobs"]["1"] and "  seed: 2\n" in runs["gpujobs"]["1"]
    assert runs["gpujobs"] == runs["basic"]


def files_of(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory` with its bytes and its mtime (ns), less multirun.yaml: Hydra's sweeper
    writes that one before any point is looked at, for every `-m` run."""
    return {str(path.relative_to(directory)): (path.read_bytes(), path.stat().st_mtime_ns)
            for path in sorted(directory.rglob("*")) if path.is_file() and path.name != "multirun.yaml"}


def refusal(proc: subprocess.CompletedProcess[str]) -> str:
    """The one `gpujobs:` line of a refused submission (exit code 2)."""
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gpujobs")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    return lines[0]


def test_a_local_sweep_run_again_with_another_value_is_refused_before_any_point_starts(tmp_path: Path) -> None:
    """Point 1 trained with optim.lr=0.003: the rerun with 0.01 is refused as a single run is, at submit,
    before point 0 runs again, and nothing of the sweep dir changes; a single run into it is refused too."""
    sweep_dir = tmp_path / "sw5"
    local = ("+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=9")
    first = sweep(sweep_dir, *local, "optim.lr=1e-3,3e-3", env={})
    assert first.returncode == 0, first.stdout + first.stderr
    assert (sweep_dir / "1" / "checkpoints").is_dir() and (sweep_dir / "sweep.json").exists()
    # a sweep ends with its sweep dir and the commands that read it (submitted from its parent: `sw5`)
    said = first.stdout.splitlines()[-4:]
    assert said == [f"gpujobs: sweep dir {sweep_dir}; next:", "  gpujobs status sw5",
                    "  gpujobs logs sw5 --point 0 --rank 0", "  gpujobs cost sw5"], first.stdout
    before = files_of(sweep_dir)

    again = sweep(sweep_dir, *local, "optim.lr=1e-3,1e-2", env={})
    line = refusal(again)
    assert line.startswith(f"gpujobs: {sweep_dir / '1' / 'checkpoints'}/step_"), line
    assert "other values of optim.lr (0.003 -> 0.01)" in line, line
    assert line.endswith(f"(sweep point #1: {' '.join(local)} optim.lr=0.01)"), line
    assert "sweep point #0:" not in again.stdout, again.stdout  # point 0 did not run again either
    assert files_of(sweep_dir) == before

    single = submit(sweep_dir, *local)
    line = refusal(single)
    assert line.startswith(f"gpujobs: config error: hydra.run.dir='{sweep_dir}' is invalid: allowed a run dir, "
                           "not a sweep dir (it holds sweep.json"), line
    assert files_of(sweep_dir) == before


@pytest.mark.parametrize(("sweeper", "subdir", "why"), [
    ("gpujobs", "same", "points #0 and #1 would both run in {sweep}/same (sweep point #1: "),
    ("basic", "same", "points #0 and #1 would both run in {sweep}/same (sweep point #1: "),
    ("gpujobs", ".", "point #0 would run on the sweep dir itself (sweep point #0: "),
    ("basic", "../out", "point #0 would run in {tmp}/out, outside it (sweep point #0: "),
    ("gpujobs", "submitit", "point #0 would run in {sweep}/submitit, among the array scripts, logs and pickles of "
                            "the sweep (sweep point #0: "),
    ("basic", "submitit/x", "point #0 would run in {sweep}/submitit/x, among the array scripts, logs and pickles "
                            "of the sweep (sweep point #0: "),
])
def test_a_subdir_that_is_no_dir_of_its_own_inside_the_sweep_dir_is_refused_before_anything_runs(
    tmp_path: Path, sweeper: str, subdir: str, why: str
) -> None:
    """Two points in one run dir: locally the second would find the first's result ("completed already",
    its AUC shown under the second's optim.lr), on Slurm both would write one config.yaml. The basic
    sweeper's Hydra makes each point's dir before the point is planned: it is taken back too."""
    sweep_dir = tmp_path / "sweep"
    proc = sweep(sweep_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=2",
                 f"hydra/sweeper={sweeper}", f"hydra.sweep.subdir={subdir}", "optim.lr=1e-3,3e-3", env={})
    line = refusal(proc)
    assert line.startswith(f"gpujobs: config error: hydra.sweep.subdir='{subdir}' is invalid: allowed a dir per "
                           f"point inside the sweep dir {sweep_dir} (the default is ${{hydra.job.num}}): "
                           f"{why.format(sweep=sweep_dir, tmp=tmp_path)}"), line
    assert "sweep point #" not in proc.stdout, proc.stdout  # no point ran
    assert list(tmp_path.iterdir()) == []  # no sweep dir, no point dirs, nothing outside


@pytest.mark.slurm
def test_a_slurm_sweep_run_again_with_another_value_queues_nothing(tmp_path: Path, slurm: dict[str, str]) -> None:
    """As with cluster=local: the array's points are checked against their run dirs before anything is
    written or queued."""
    sweep_dir = tmp_path / "sweep"
    first = sweep(sweep_dir, *TINY, "cluster.wait=true", "optim.lr=1e-3,3e-3", env=slurm)
    assert first.returncode == 0, first.stdout + first.stderr
    array = array_of(first.stdout)
    wait_gone(f"{array}_0", f"{array}_1", env=slurm)  # else point 0 is refused first: its job still holds it
    before = files_of(sweep_dir)
    again = sweep(sweep_dir, *TINY, "optim.lr=1e-3,1e-2", env=slurm)
    line = refusal(again)
    assert line.startswith(f"gpujobs: {sweep_dir / '1' / 'checkpoints'}/step_"), line
    assert "other values of optim.lr (0.003 -> 0.01)" in line and "submitted" not in again.stdout, line
    assert files_of(sweep_dir) == before


@pytest.mark.parametrize("sweeper", ["gpujobs", "basic"])
def test_adding_a_key_that_exists_fails_as_composition_does(tmp_path: Path, sweeper: str) -> None:
    """The derived points apply `+key=` as Hydra would at each point: where the key exists, it fails."""
    proc = sweep(tmp_path / "sweep", "+experiment=rec", "cluster=local", f"hydra/sweeper={sweeper}",
                 "+trainer.seed=1,2", env={})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Could not append to config. An item is already at 'trainer.seed'" in proc.stderr
    assert not (tmp_path / "sweep" / "0").exists()


@pytest.mark.parametrize("sweeper", ["gpujobs", "basic"])
def test_a_group_left_missing_fails_as_composition_does(tmp_path: Path, sweeper: str) -> None:
    """A defaults entry left `???` is skipped by the sweep's composition but refused by a point's."""
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    (conf / "extra").mkdir()
    (conf / "extra" / "a.yaml").write_text("foo: 1\n")
    primary = (conf / "config.yaml").read_text()
    (conf / "config.yaml").write_text(primary.replace("  - data: synthetic\n", "  - data: synthetic\n  - extra: ???\n"))
    proc = sweep(tmp_path / "sweep", "+experiment=rec", "cluster=local", f"hydra/sweeper={sweeper}",
                 "trainer.seed=1,2", env={"GPUJOBS_CONFIG_DIR": str(conf)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "You must specify 'extra'" in proc.stderr


@pytest.mark.slurm
def test_group_sweep_composes_every_point(tmp_path: Path, slurm: dict[str, str]) -> None:
    """A swept config group cannot be derived from one composition: the basic sweeper's path runs it."""
    proc = sweep(tmp_path / "sweep", *TINY, "cluster.dry_run=true", "nccl=default,ethernet", env=slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "one composition" not in proc.stdout and proc.stdout.count("#SBATCH --array=0-0\n") == 2


def test_launcher_plugin_is_discovered_without_importing_submitit() -> None:
    code = (
        "import sys\n"
        "from hydra.core.plugins import Plugins\n"
        "from hydra.plugins.launcher import Launcher\n"
        "names = [p.__name__ for p in Plugins.instance().discover(Launcher)]\n"
        "assert 'GpujobsLauncher' in names, names\n"
        "assert 'submitit' not in sys.modules and 'gpujobs' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
