"""The CLI as users run it: bad input is refused in one line with exit 2, and nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, submit


@pytest.mark.parametrize(
    "override",
    [
        "resources.gpus_per_node=-1",
        "resources.nodes=0",
        "cluster.time=25:99",
        "+nccl.extra.NCCL_BOGUS=1",
        "trainer.max_steps=lots",
        "+resources.gpu=1",
        "resources.nodes=2",  # more than one node cannot run locally
        "resources.gpus_per_node=1",  # no NVIDIA GPU on this machine
        # numbers as their consumers read them (some gave a traceback, others overflowed on the job side)
        "resources.mem_gb=inf",
        "optim.lr=nan",
        "trainer.pg_timeout_s=1e15",
        "trainer.pg_timeout_s=1000000000000000",
        "cluster.signal_lead_s=70000",
        "resources.mem_gb=0.0001",  # would have rendered --mem=0M: the whole node
        "+nccl.extra.NCCL_IB_DISABLE=maybe",
    ],
)
def test_bad_config_one_line_exit_2_no_run_dir(run_dir: Path, override: str) -> None:
    proc = submit(run_dir, "+experiment=rec", "cluster=local", override)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gpujobs: config error: ")
    key = override.lstrip("+").split("=")[0]
    assert key.split(".")[-1] in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not run_dir.exists()


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("+experiment=nope", ["experiment='nope'", "rec"]),  # Hydra's own errors: several lines, before
        ("optim=nope", ["optim='nope'", "adam"]),
        ("optim.lrr=0.1", ["optim.lrr='0.1'", "weight_decay"]),
        ("model.nope.deeper=3", ["model.nope.deeper='3'", "embedding_dim"]),
        ("optim.lr=[1", ["optim.lr=[1", "does not parse"]),
        ("+optim.lr=3", ["optim.lr"]),
        ("~optim.zzz", ["optim.zzz"]),
        ("optim.lr=${oops}", ["optim.lr='${oops}'", "oops"]),  # a traceback and exit 1, before
        ("hydra.run.dir=${now:}", ["hydra.run.dir"]),  # an error in Hydra's error report, before
    ],
)
def test_a_bad_override_is_one_line_naming_it(run_dir: Path, override: str, names: list[str]) -> None:
    proc = submit(run_dir, "+experiment=rec", "cluster=local", override)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpujobs: config error: "), proc.stderr
    assert all(name in lines[0] for name in names), lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout and "HYDRA_FULL_ERROR" not in proc.stderr
    assert not run_dir.exists()


def test_hydra_full_error_still_gives_the_whole_traceback(run_dir: Path) -> None:
    proc = submit(run_dir, "+experiment=rec", "optim.lrr=0.1", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" in proc.stderr and "ConfigCompositionException" in proc.stderr


def test_a_nccl_variable_set_twice_is_refused_naming_both_keys(run_dir: Path) -> None:
    proc = submit(run_dir, "+experiment=rec", "cluster=local", "nccl.ib_disable=true", "+nccl.extra.NCCL_IB_DISABLE=0")
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpujobs: config error: nccl.extra.NCCL_IB_DISABLE='0'")
    assert "nccl.ib_disable" in lines[0]
    assert not run_dir.exists()


def test_unknown_config_group_option_exits_2(run_dir: Path) -> None:
    proc = submit(run_dir, "+experiment=rec", "cluster=moon")
    assert proc.returncode == 2
    assert "moon" in proc.stderr
    assert not run_dir.exists()


def test_cfg_job_prints_the_composed_config(run_dir: Path) -> None:
    proc = submit(run_dir, "+experiment=rec", "optim.lr=0.005", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    assert "lr: 0.005" in proc.stdout
    assert "embedding_dim:" in proc.stdout
    assert not run_dir.exists()


def test_submit_side_never_imports_torch(tmp_path: Path) -> None:
    """A whole local run (2 gloo ranks) from this process: the ranks import torch, the submitter must not."""
    script = f"""
import sys
sys.argv = ["gpujobs.submit", "+experiment=rec", "+debug=tiny", "cluster=local", "hydra.run.dir={tmp_path / 'run'}"]
from gpujobs.submit import main
try:
    main()
except SystemExit as exit_:
    assert exit_.code in (0, None), exit_.code
assert "torch" not in sys.modules, "the submit side imported torch"
print("NO-TORCH-OK")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "NO-TORCH-OK" in proc.stdout
    assert (tmp_path / "run" / "result.json").is_file()


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")))
def test_shipped_configs_leave_hydra_mode_unset(experiment: str) -> None:
    """`gpujobs.submit -m` skips Hydra's composition that only reads `hydra.mode`, answering "not set": true of
    every config shipped here (a config that sets it would still sweep, only without Hydra's warning)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
    assert cfg.hydra.mode is None


@pytest.mark.parametrize(("where", "sweep"), [("file", False), ("file/sub", False), ("file", True)])
def test_a_run_dir_that_cannot_be_made_is_one_line_exit_2(tmp_path: Path, where: str, sweep: bool) -> None:
    (tmp_path / "file").write_text("a file where the run dir goes")
    target = tmp_path / where
    args = ("-m", f"hydra.sweep.dir={target}", "optim.lr=1e-3,1e-2") if sweep else (f"hydra.run.dir={target}",)
    proc = subprocess.run([sys.executable, "-m", "gpujobs.submit", *args, "+experiment=rec", "+debug=tiny",
                           "cluster=local"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    key = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    assert len(lines) == 1 and lines[0].startswith(f"gpujobs: {key} is invalid: "), proc.stderr
    assert str(tmp_path / "file") in lines[0], proc.stderr
    assert (tmp_path / "file").read_text() == "a file where the run dir goes"


def test_a_template_dir_without_the_template_is_one_line_exit_2(
    run_dir: Path, tmp_path: Path, slurm: dict[str, str]
) -> None:
    proc = submit(run_dir, "+experiment=rec", "cluster=slurm", "cluster.dry_run=true",
                  env={**slurm, "GPUJOBS_SBATCH_TEMPLATES": str(tmp_path / "nowhere")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "GPUJOBS_SBATCH_TEMPLATES=" in lines[0] and "job.sbatch.j2" in lines[0], proc.stderr
    assert not run_dir.exists()
