"""The files NCCL writes (NCCL_DEBUG_FILE, NCCL_GRAPH_DUMP_FILE, NCCL_TOPO_DUMP_FILE) land in RUN_DIR/nccl/.

NCCL fopen()s them for writing on every rank, following symlinks: a path from config (a shared /tmp)
is one another user can plant a link at. So config takes a bare file name, refused otherwise before
anything is written, and every rank gets RUN_DIR/nccl/<name>, its own run dir's. The refusals run the
real CLI (`conftest.submit`); the placement is seen in a real 2-rank gloo run, in the environment each
rank logs (gloo never opens the files, so the environment is what there is to see).
"""

from __future__ import annotations

import ast
import re
import shlex
import stat
from pathlib import Path

import pytest
from conftest import compose_job, submit

from gpujobs.backends.slurm.sbatch import job_command, render_sbatch, sbatch_request
from gpujobs.config.nccl import OUTPUT_FILE_VARS, NcclSettings
from gpujobs.rundir.nccl import export_nccl_env

DRY_RUN = ("+experiment=rec", "cluster=slurm", "cluster.dry_run=true")
TINY = ("+experiment=rec", "+debug=tiny", "cluster=local", "trainer.max_steps=3", "trainer.eval_every=0")


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p.log"),  # the shared place a link can be planted at
        ("NCCL_DEBUG_FILE", "logs/nccl.log"),
        ("NCCL_DEBUG_FILE", ".."),
        ("NCCL_DEBUG_FILE", "''"),
        ("NCCL_GRAPH_DUMP_FILE", "../graph.xml"),
        ("NCCL_TOPO_DUMP_FILE", "."),
    ],
)
def test_a_path_for_a_file_nccl_writes_exits_2_in_one_line_and_writes_nothing(
    tmp_path: Path, var: str, value: str
) -> None:
    proc = submit(tmp_path / "run", *DRY_RUN, f"+nccl.extra.{var}={value}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"gpujobs: config error: nccl.extra.{var}="), lines[0]
    assert "a file name" in lines[0] and "RUN_DIR/nccl/" in lines[0] and "%h" in lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("array", [None, "0-1"])
def test_the_sbatch_script_names_no_file_nccl_writes_and_keeps_the_files_nccl_reads(array: str | None) -> None:
    # one script serves every point of an array and a rerun dir: only a rank knows its run dir
    job = compose_job("+experiment=rec", "cluster=slurm", "+nccl.extra.NCCL_DEBUG_FILE=nccl.%h.%p.log",
                      "+nccl.extra.NCCL_TOPO_DUMP_FILE=topo.xml", "+nccl.extra.NCCL_TOPO_FILE=/etc/nccl/topo.xml")
    folder = Path("/runs/rec/submitit")
    command = job_command(folder, run_dir=Path("/runs/rec")) if array is None else job_command(
        folder, points=Path("/runs/sweep/points.json"))
    text = render_sbatch(sbatch_request(job, folder, command, array=array))
    exports = [shlex.split(line)[1] for line in text.splitlines() if line.startswith("export NCCL_")]
    assert "NCCL_TOPO_FILE=/etc/nccl/topo.xml" in exports  # only read by NCCL: a path, as before
    assert not [e for e in exports if e.split("=")[0] in OUTPUT_FILE_VARS], exports
    assert "nccl.%h.%p.log" not in text and "topo.xml" not in text.replace("/etc/nccl/topo.xml", "")


def test_each_rank_gets_the_file_names_under_its_run_dir_only() -> None:
    nccl = compose_job("+experiment=rec", "+nccl.extra.NCCL_DEBUG_FILE=nccl.%h.%p.log",
                       "+nccl.extra.NCCL_GRAPH_DUMP_FILE=graph.xml").nccl
    assert nccl.extra["NCCL_DEBUG_FILE"] == "nccl.%h.%p.log"  # config.yaml keeps the name as given
    assert not set(nccl.to_env()) & OUTPUT_FILE_VARS
    env = nccl.to_env(Path("/runs/a"))
    assert env["NCCL_DEBUG_FILE"] == "/runs/a/nccl/nccl.%h.%p.log"
    assert env["NCCL_GRAPH_DUMP_FILE"] == "/runs/a/nccl/graph.xml"
    # NCCL expands % in NCCL_DEBUG_FILE only (%% is one %): a local run dir's own % reaches NCCL as itself
    env = nccl.to_env(Path("/runs/100%h"))
    assert env["NCCL_DEBUG_FILE"] == "/runs/100%%h/nccl/nccl.%h.%p.log"
    assert env["NCCL_GRAPH_DUMP_FILE"] == "/runs/100%h/nccl/graph.xml"


def test_a_file_without_a_run_dir_is_refused_not_dropped() -> None:
    with pytest.raises(ValueError, match="NCCL_DEBUG_FILE"):
        export_nccl_env(NcclSettings(extra={"NCCL_DEBUG_FILE": "nccl.log"}), None)


def test_a_two_rank_run_gives_every_rank_the_debug_file_in_its_run_dir(run_dir: Path) -> None:
    proc = submit(run_dir, *TINY, "nccl=debug", "+nccl.extra.NCCL_DEBUG_FILE=nccl.%h.%p.log")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = sorted((run_dir / "submitit").glob("*_log.err"))
    assert len(logs) == 2
    for log in logs:
        found = re.search(r"NCCL environment: (\{.*\})", log.read_text())
        assert found, log.read_text()
        env = ast.literal_eval(found.group(1))
        assert env["NCCL_DEBUG_FILE"] == f"{run_dir}/nccl/nccl.%h.%p.log"
        assert env["NCCL_DEBUG"] == "INFO"
    made = run_dir / "nccl"
    assert made.is_dir() and not made.is_symlink()
    assert stat.S_IMODE(made.stat().st_mode) & 0o077 == 0  # the job's own: no one else writes there
    assert "NCCL_DEBUG_FILE: nccl.%h.%p.log" in (run_dir / "config.yaml").read_text()
