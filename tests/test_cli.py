"""The one `gpujobs` command as users run it: the console script `pip install` put beside this interpreter.

Each subcommand is the `python -m` entry point it names, with the same output and exit codes; the status
table stays readable at 80 columns on a real sweep with long overrides. One tiny local run and one tiny
4-point sweep (cluster=debug: in-process, a second each) serve every test here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_result

from gpujobs.cli.main import COMMANDS
from gpujobs.launch.status_table import shorten_keys

#: The console script of this environment (pyproject.toml's [project.scripts]).
GPUJOBS = Path(sys.executable).with_name("gpujobs")
#: A sweep whose points differ in three overrides, one of them long: 2 x 2 x 1 points.
SWEEP = ("optim.lr=0.001,0.0025", "+nccl.extra.NCCL_SOCKET_IFNAME=enp1s0f0np0,enp1s0f1np1", "trainer.seed=7")


def gpujobs(*args: str, cwd: Path, columns: int = 200, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """The real console script, in a terminal `columns` wide."""
    if not GPUJOBS.exists():
        pytest.fail(f"no {GPUJOBS}: install the project into this environment again (pip install -e '.[dev]')")
    return subprocess.run([str(GPUJOBS), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": str(columns)})


def python_m(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m module args` as `gpujobs` would be run beside it."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir of `gpujobs submit +experiment=rec +debug=tiny`, run to its end on this machine."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    proc = gpujobs("submit", "+experiment=rec", "+debug=tiny", "cluster=local", f"hydra.run.dir={run_dir}",
                   cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sweep dir of `gpujobs submit -m` over SWEEP, every point run to its end."""
    sweep_dir = tmp_path_factory.mktemp("cli") / "sweep"
    proc = gpujobs("submit", "-m", "+experiment=rec", "+debug=tiny", "cluster=debug", f"hydra.sweep.dir={sweep_dir}",
                   *SWEEP, cwd=sweep_dir.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [read_result(sweep_dir / str(num))["status"] for num in range(4)] == ["completed"] * 4
    return sweep_dir


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def test_help_lists_every_subcommand_in_80_columns(tmp_path: Path) -> None:
    proc = gpujobs("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name, command in COMMANDS.items():
        assert any(line.split() == [name, *command.summary.split()] for line in lines), proc.stdout
    assert {"submit", "status", "logs", "cancel", "resubmit", "cost", "report"} <= set(COMMANDS)
    assert max(len(line) for line in lines) <= 80, proc.stdout


def test_help_imports_neither_hydra_nor_torch() -> None:
    code = ("import sys\nfrom gpujobs.cli.main import main\nassert main(['--help']) == 0\n"
            "print(sorted(m for m in ('torch', 'hydra', 'omegaconf', 'rich') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "[]", proc.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_subcommand_has_its_help(tmp_path: Path, name: str) -> None:
    proc = gpujobs(name, "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    if name == "submit":  # Hydra's own help: the config groups of conf/
        assert "cluster: auto, debug, kubernetes, local, slurm" in proc.stdout, proc.stdout
    else:
        assert proc.stdout.startswith(f"usage: gpujobs {name} "), proc.stdout


def test_python_m_forms_print_the_same_help_under_their_own_names(tmp_path: Path) -> None:
    for ours, theirs, prog in (
        (gpujobs("status", "--help", cwd=tmp_path), python_m("gpujobs", "status", "--help", cwd=tmp_path),
         "python -m gpujobs status"),
        (gpujobs("report", "--help", cwd=tmp_path), python_m("gpujobs.report", "--help", cwd=tmp_path),
         "python -m gpujobs.report"),
    ):
        assert (ours.returncode, theirs.returncode) == (0, 0), ours.stderr + theirs.stderr
        usage, *rest = theirs.stdout.splitlines()
        assert usage.startswith(f"usage: {prog} "), theirs.stdout
        name = prog.split()[-1].split(".")[-1]
        assert ours.stdout.splitlines() == [usage.replace(prog, f"gpujobs {name}"), *rest], ours.stdout


def test_a_bad_subcommand_and_a_bad_override_exit_2_with_one_line(tmp_path: Path) -> None:
    bad = gpujobs("statsu", str(tmp_path), cwd=tmp_path)
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout + bad.stderr
    line = one_line(bad.stderr)
    assert line.startswith("gpujobs: command='statsu' is invalid: allowed one of submit, status,"), line
    none = gpujobs(cwd=tmp_path)
    assert none.returncode == 2 and "usage: gpujobs COMMAND" in none.stderr, none.stdout + none.stderr

    run_dir = tmp_path / "run"
    override = gpujobs("submit", "+experiment=rec", "cluster=local", "resources.nodes=0", f"hydra.run.dir={run_dir}",
                       cwd=tmp_path)
    assert override.returncode == 2, override.stdout + override.stderr
    assert one_line(override.stderr).startswith("gpujobs: config error: resources.nodes=0 is invalid"), override.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "soon"])
def test_seconds_options_refuse_what_sleep_cannot_take(run_dir: Path, value: str) -> None:
    """`--watch` and `--sacct-timeout` go to time.sleep and to subprocess timeouts: a finite number > 0."""
    for option in (("status", "--watch"), ("cost", "--sacct-timeout")):
        proc = gpujobs(*option, value, str(run_dir), cwd=run_dir.parent)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"'{value}' is invalid: allowed a number of seconds > 0" in proc.stderr.splitlines()[-1], proc.stderr
        assert "Traceback" not in proc.stderr


def test_submit_runs_the_tiny_rec_job_and_cfg_job_prints_the_config(run_dir: Path) -> None:
    assert read_result(run_dir)["status"] == "completed"
    cfg = gpujobs("submit", "+experiment=rec", "optim.lr=0.005", "--cfg", "job", cwd=run_dir.parent)
    assert cfg.returncode == 0, cfg.stderr
    assert "task: jobs.rec.task:build_task" in cfg.stdout.splitlines() and "  lr: 0.005" in cfg.stdout, cfg.stdout


@pytest.mark.parametrize("args", [("status",), ("cost",), ("logs",), ("cancel",), ("resubmit", "--failed")])
def test_management_commands_answer_as_python_m_gpujobs_does(run_dir: Path, args: tuple[str, ...]) -> None:
    """Same exit code and output on a real run dir: 0 and a table or rank 0's log, or resubmit's 1 (nothing
    failed)."""
    ours, theirs = gpujobs(*args, str(run_dir), cwd=run_dir.parent), python_m("gpujobs", *args, str(run_dir),
                                                                               cwd=run_dir.parent)
    assert (ours.returncode, ours.stdout, ours.stderr) == (theirs.returncode, theirs.stdout, theirs.stderr)
    assert ours.returncode == {"resubmit": 1}.get(args[0], 0), ours.stdout + ours.stderr
    if args[0] == "status":
        assert "completed (files)" in ours.stdout, ours.stdout
    if args[0] == "logs":
        assert "global_rank=0(2)" in ours.stdout and "Job completed successfully" in ours.stdout, ours.stdout
    if args[0] == "cost":
        assert "CPU-h" in ours.stdout and "total" in ours.stdout, ours.stdout


def test_a_point_of_a_single_run_dir_is_refused_saying_it_is_no_sweep(run_dir: Path) -> None:
    proc = gpujobs("logs", "--point", "3", str(run_dir), cwd=run_dir.parent)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert one_line(proc.stderr) == (f"gpujobs: no point #3: {run_dir} is a single run, not a sweep (its only "
                                     "point is 0)")


def test_report_writes_the_plots_of_a_run(run_dir: Path) -> None:
    proc = gpujobs("report", str(run_dir), cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "plots: " in proc.stdout and (run_dir / "report" / "loss.png").stat().st_size > 0, proc.stdout
    missing = gpujobs("report", str(run_dir / "nothing"), cwd=run_dir.parent)
    assert missing.returncode == 2 and one_line(missing.stderr).startswith("gpujobs: "), missing.stderr


def test_shortened_keys_stay_unambiguous() -> None:
    rows = [["+experiment=rec", "dim=2"], ["optim.lr=0.1", "model.dim=8", "data.dim=4", "+nccl.extra.NCCL_X=1"],
            ["~trainer.eval_every", "run-7"]]
    assert shorten_keys(rows) == [["+experiment=rec", "dim=2"], ["lr=0.1", "model.dim=8", "data.dim=4", "+NCCL_X=1"],
                                  ["~eval_every", "run-7"]]


def table_rows(table: str) -> list[str]:
    """Each row of a status table as one string: its lines' cells joined, top to bottom (a wrapped cell's
    words stay in order within the row)."""
    rows: list[list[str]] = []
    for line in table.splitlines():
        if not line.startswith("│"):
            continue
        if line.split("│")[1].strip():  # a row's first line: the point number
            rows.append([])
        rows[-1].append(line)
    return [" ".join(" ".join(line.split("│")[i].strip() for line in row) for i in range(1, row[0].count("│")))
            for row in rows]


def test_status_of_a_sweep_with_long_overrides_fits_80_columns(sweep_dir: Path) -> None:
    narrow = gpujobs("status", str(sweep_dir), cwd=sweep_dir.parent, columns=80)
    assert narrow.returncode == 0, narrow.stderr
    lines = narrow.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, narrow.stdout
    header = next(line for line in lines if line.startswith("┃"))
    assert [cell.strip() for cell in header.strip("┃").split("┃")] == ["point", "overrides", "state", "attempts",
                                                                      "step", "metric"], narrow.stdout
    assert "hidden to fit 80 columns: job id, world" in narrow.stdout, narrow.stdout  # no job id: a local sweep
    assert "+experiment=rec +debug=tiny cluster=debug trainer.seed=7" in " ".join(
        line.strip() for line in lines[:3]), narrow.stdout  # what every point shares: the title
    rows = table_rows(narrow.stdout)
    assert len(rows) == 4, narrow.stdout
    for num, (lr, ifname) in enumerate([(lr, ifname) for lr in ("0.001", "0.0025")
                                        for ifname in ("enp1s0f0np0", "enp1s0f1np1")]):
        # shortened keys, wrapped between overrides; one longer than the column breaks after its `=` only
        assert rows[num].split()[:4] == [str(num), f"lr={lr}", "+NCCL_SOCKET_IFNAME=", ifname], narrow.stdout
        assert "completed" in rows[num] and "auc=0." in rows[num], narrow.stdout

    wide = gpujobs("status", str(sweep_dir), cwd=sweep_dir.parent, columns=200)
    assert wide.returncode == 0, wide.stderr
    header = next(line for line in wide.stdout.splitlines() if line.startswith("┃"))
    assert [cell.strip() for cell in header.strip("┃").split("┃")] == [
        "point", "overrides", "job id", "state", "world", "attempts", "step", "metric"], wide.stdout
    assert "hidden" not in wide.stdout
    rows = table_rows(wide.stdout)
    assert len([line for line in wide.stdout.splitlines() if line.startswith("│")]) == 4, wide.stdout  # a line each
    assert rows[3].split()[:4] == ["3", "optim.lr=0.0025", "+nccl.extra.NCCL_SOCKET_IFNAME=enp1s0f1np1", "-"], rows
