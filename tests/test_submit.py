"""The CLI as users run it: bad input is refused in one line with exit 2, and nothing is left behind."""

from __future__ import annotations

import os
import re
import shlex
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
        "container.image=registry.example.com/rec:1",  # an image alone runs only where the kubelet runs it
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


# ---------------------------------------------------------------- the first hour (issue 40)


@pytest.mark.parametrize(
    ("override", "starts"),
    [
        ("optim.lrr=0.1", "optim.lrr='0.1' is invalid: did you mean optim.lr? allowed a key of optim: name, lr, "),
        ("+optim.lrr=0.1", "optim.lrr=0.1 is invalid: did you mean optim.lr? allowed keys of optim: name, lr, "),
        ("model.embeding_dim=8", "model.embeding_dim='8' is invalid: did you mean model.embedding_dim? allowed "),
        ("trainr.max_steps=3", "trainr.max_steps='3' is invalid: did you mean trainer.max_steps? allowed "),
        ("+checkpoint.asinc=true", "checkpoint.asinc=True is invalid: did you mean checkpoint.async? allowed "),
        ("optim.zzz=1", "optim.zzz='1' is invalid: allowed a key of optim: "),  # nothing close: no guess
    ],
)
def test_an_unknown_key_says_the_key_it_likely_meant_before_the_list(
    run_dir: Path, override: str, starts: str
) -> None:
    proc = submit(run_dir, "+experiment=rec", "cluster=local", override)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"gpujobs: config error: {starts}"), line
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "overrides",
    [
        ("trainer.max_steps=abc",),
        ("data=criteo", "data.store=no-such-store", "data.train_files=a.tsv", "data.eval_files=b.tsv"),
        ("cluster=slurm",),  # no sbatch here: refused at preflight, after Hydra made the run dir
    ],
)
def test_a_refused_submit_from_an_empty_directory_leaves_it_empty(tmp_path: Path, overrides: tuple[str, ...]) -> None:
    """Hydra makes `outputs/rec/<time>/` before the config is checked: a refusal takes back all three."""
    proc = subprocess.run([sys.executable, "-m", "gpujobs.submit", "+experiment=rec", *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": _python_only(tmp_path)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["bin"]  # only the test's own PATH


def _python_only(tmp_path: Path) -> str:
    """A PATH holding only `python` (this interpreter): no sbatch, no scontrol, no srun, nothing else."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").symlink_to(sys.executable)
    return str(bin_dir)


def test_the_slurm_dry_run_with_only_python_on_path_prints_the_script(tmp_path: Path) -> None:
    """A laptop without Slurm: the preflight's cluster questions are skipped, in one line, and the script that
    would be queued is printed; nothing is left in the submit directory."""
    proc = subprocess.run(
        [sys.executable, "-m", "gpujobs.submit", "+experiment=rec", "cluster=slurm", "cluster.dry_run=true",
         "cluster.partition=gpu", "resources.gpus_per_node=4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PATH": _python_only(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("#!/bin/bash\n"), proc.stdout
    assert "#SBATCH --partition=gpu\n" in proc.stdout and "#SBATCH --gpus-per-node=4\n" in proc.stdout, proc.stdout
    said = [line for line in proc.stderr.splitlines()
            if line.startswith("gpujobs:") and "resources.cpus_per_task=null" not in line]  # GPU ranks' CPUs: a note
    assert said == ["gpujobs: no `sbatch` on PATH: the dry run skips the cluster's checks (partition, nodes, GPUs, "
                    "time, account, qos)"], proc.stderr
    assert "memory plan: parallel=ddp, 4 ranks" in proc.stderr  # the plan beside the script, on stderr
    assert [p.name for p in tmp_path.iterdir()] == ["bin"]


def test_the_readme_first_command_prints_its_next_steps(tmp_path: Path) -> None:
    """The README's first command, as written there, run from an empty directory: it ends with the run dir and
    the commands that read it, each of which works there."""
    readme = (REPO / "README.md").read_text()
    first = readme.split("## Two commands", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    words = shlex.split(first.rsplit("&& ", 1)[1])
    assert words[:3] == ["python", "-m", "gpujobs.submit"], first
    # a fresh machine has no Slurm: without sbatch on PATH the default cluster is this machine (CI's has one)
    fresh = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                            if d and not os.path.exists(os.path.join(d, "sbatch")))
    proc = subprocess.run([sys.executable, *words[1:]], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PATH": fresh})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = (tmp_path / "outputs" / "rec").iterdir()
    pid = re.search(r"^gpujobs: local job (\d+): `kill -USR2 (\d+)` preempts it", proc.stdout, re.M)
    assert pid and pid[1] == pid[2], proc.stdout
    tail = proc.stdout.splitlines()[-4:]
    where = f"outputs/rec/{run_dir.name}"
    assert tail == [f"gpujobs: run dir {run_dir}; next:", f"  gpujobs status {where}",
                    f"  gpujobs logs {where} --rank 0", f"  gpujobs report {where}"], proc.stdout
    for line in tail[1:]:
        said = subprocess.run([sys.executable, "-m", "gpujobs.cli.main", *shlex.split(line)[1:]], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert said.returncode == 0 and said.stdout, (line, said.stdout, said.stderr)
