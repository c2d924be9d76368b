"""Values that reach sbatch's parser: hostile text is refused before anything is written; what is accepted
reads back from Slurm exactly as meant.

`#SBATCH` lines are parsed by sbatch, not by a shell: a newline ends a directive (the rest of the value
would run as a command), a backslash escapes the next character, and `%` is expanded in log paths. The
refusals run the real CLI (`conftest.submit`); the read-back queues the rendered script on the live test
cluster, held, and asks Slurm what it understood.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_job, submit

from gpujobs.backends.slurm.sbatch import render_sbatch, sbatch_request
from gpujobs.base.errors import ConfigError
from gpujobs.launch import check_paths

DRY_RUN = ("+experiment=rec", "cluster=slurm", "cluster.dry_run=true")
#: Everything a shell would act on, which validation still accepts in a run dir (even for Slurm).
HOSTILE_DIR = "it's a \"$(reboot)\" `id`;#&|*?~ {x} $HOME !"


def hydra_quoted(text: str) -> str:
    """`text` as a quoted value of a Hydra override."""
    return "'" + text.replace("'", "\\'") + "'"


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpujobs: config error: ") and "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("hydra.run.dir", "a\nb"),
        ("hydra.run.dir", "a\rb"),
        ("name", "rec\n"),  # `$` of a pattern matches before a trailing newline: names are matched whole
        ("name", "rec\r"),
        ("cluster.partition", "debug\n#SBATCH --exclusive"),
        ("cluster.account", "lab\r"),
    ],
)
def test_a_newline_or_cr_in_a_dry_run_exits_2_naming_the_key_and_writes_nothing(
    tmp_path: Path, key: str, value: str
) -> None:
    run_dir = tmp_path / "run"
    if key == "hydra.run.dir":
        value = str(tmp_path / value)
    proc = submit(run_dir, *DRY_RUN, f"{key}={hydra_quoted(value)}")
    line = _one_error_line(proc)
    assert line.startswith(f"gpujobs: config error: {key}=")
    assert "control characters" in line
    assert list(tmp_path.iterdir()) == []  # not the run dir, not the hostile one, nothing


@pytest.mark.parametrize("char", ["%", "\\"])
def test_percent_and_backslash_in_a_slurm_run_dir_are_refused(tmp_path: Path, char: str) -> None:
    proc = submit(tmp_path / "run", *DRY_RUN, f"hydra.run.dir={hydra_quoted(str(tmp_path / f'run{char}x'))}")
    line = _one_error_line(proc)
    assert line.startswith("gpujobs: config error: hydra.run.dir=")
    assert "Slurm expands % and drops \\ in #SBATCH paths" in line
    assert list(tmp_path.iterdir()) == []


def test_a_control_character_in_a_local_run_dir_is_refused_too(tmp_path: Path) -> None:
    hostile = tmp_path / "a" / "b\tc"
    proc = submit(tmp_path / "run", "+experiment=rec", "cluster=local", f"hydra.run.dir={hydra_quoted(str(hostile))}")
    assert _one_error_line(proc).startswith("gpujobs: config error: hydra.run.dir=")
    assert not (tmp_path / "a").exists()  # Hydra made the parent, and the refused submit took it back


def test_percent_is_only_slurm_s_business() -> None:
    local = compose_job("+experiment=rec", "cluster=local")
    check_paths(local, Path("/runs/100%/run\\1"))  # local runs: no Slurm to expand or drop anything
    with pytest.raises(ConfigError) as info:
        check_paths(compose_job("+experiment=rec", "cluster=slurm"), Path("/runs/100%/run"))
    assert info.value.key == "hydra.run.dir"


@pytest.mark.parametrize(
    ("override", "key"),
    [("hydra.sweep.dir={dir}/sw%eep", "hydra.sweep.dir"),
     ("hydra.sweep.subdir=p%${{hydra.job.num}}", "hydra.sweep.subdir")],
)
def test_a_sweep_with_a_percent_in_its_dirs_is_refused_before_anything_is_written(
    tmp_path: Path, override: str, key: str
) -> None:
    cmd = [sys.executable, "-m", "gpujobs.submit", "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}", *DRY_RUN,
           override.format(dir=tmp_path), "trainer.seed=0,1"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"gpujobs: config error: {key}=" in proc.stderr and "(sweep point #0" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- live cluster: what sbatch understood


def _held(script: str, tmp_path: Path, slurm: dict[str, str]) -> dict[str, str]:
    """Queue `script` held (it never runs), read back what Slurm parsed, cancel it."""
    path = tmp_path / "held.sbatch"
    path.write_text(script)
    env = {**os.environ, **slurm}
    job_id = subprocess.run(["sbatch", "--hold", "--parsable", str(path)], capture_output=True, text=True,
                            env=env, check=True, timeout=60).stdout.strip().split(";")[0]
    try:
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env,
                               check=True, timeout=60).stdout
    finally:
        subprocess.run(["scancel", job_id], env=env, check=False, timeout=60)
    fields = {"JobId": job_id}
    for line in shown.splitlines():  # StdOut=... and StdErr=... have their own line: spaces and all
        key, _, value = line.strip().partition("=")
        if key in ("StdOut", "StdErr"):
            fields[key] = value
    fields["JobName"] = shown.split("JobName=", 1)[1].splitlines()[0]
    fields["Partition"] = shown.split("Partition=", 1)[1].split()[0]
    return fields


@pytest.mark.slurm
def test_sbatch_reads_a_hostile_accepted_run_dir_and_name_as_meant(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = tmp_path / HOSTILE_DIR / "run"
    proc = submit(tmp_path / "x", *DRY_RUN, f"hydra.run.dir={hydra_quoted(str(run_dir))}", "name=-rec.v2_",
                  "cluster.partition=debug", env=slurm)
    assert proc.returncode == 0, proc.stderr
    assert not run_dir.exists()  # a dry run writes nothing
    seen = _held(proc.stdout, tmp_path, slurm)
    assert seen["JobName"] == "-rec.v2_" and seen["Partition"] == "debug"
    assert seen["StdOut"] == f"{run_dir}/submitit/{seen['JobId']}_0_log.out"
    assert seen["StdErr"] == f"{run_dir}/submitit/{seen['JobId']}_0_log.err"
    step = next(line for line in proc.stdout.splitlines() if line.startswith("exec "))
    assert shlex.split(step)[-1] == str(run_dir)  # the shell line hands the job side the same dir


@pytest.mark.slurm
@pytest.mark.parametrize(("char", "read_as"), [("%x", "rec"), ("\\q", "q")])
def test_what_is_refused_is_what_sbatch_would_misread(
    tmp_path: Path, slurm: dict[str, str], char: str, read_as: str
) -> None:
    """Why `%` and `\\` are refused: rendered anyway (validation bypassed), Slurm logs somewhere else."""
    job = compose_job("+experiment=rec", "cluster=slurm", "cluster.partition=debug", "name=rec")
    seen = _held(render_sbatch(sbatch_request(job, tmp_path / f"run{char}" / "submitit", "true")), tmp_path, slurm)
    # `%x` became the job name; sbatch dropped the backslash (quoted or not)
    assert seen["StdOut"] == f"{tmp_path}/run{read_as}/submitit/{seen['JobId']}_0_log.out"
