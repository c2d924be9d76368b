"""bench/gpu_check.py's verdict: which checks a machine runs, the summary table, and the exit code a later
session's one GPU run is judged by (the checks themselves run in `bash bench/gpu_check.sh`); its deadline and
budgets; the check-only switch that lets its two GPU ranks share one GPU; and gpu_check.sh from a python
that has torch and the heavy dependencies but nothing of ours, as a GPU node's is."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, compose_job

from gpujobs.backends.local import check_local_resources
from gpujobs.base.errors import ConfigError
from gpujobs.config.nccl import GLOO_ON_CUDA_ENV

sys.path.insert(0, str(REPO / "bench"))
import gpu_check
import gpu_check_env
from gpu_check import NO_GPU, NOT_ALL_RUN, Check, Machine, bench, need, run_checks, run_child


def passes(m: Machine) -> str:
    return "42 samples/s"


def fails(m: Machine) -> str:
    need(False, "the resumed run redid 3 steps")
    return "unreached"


CPU = Check("cpu check", passes)
ONE_GPU = Check("one-GPU check", passes, "NCCL", 1)
TWO_GPUS = Check("two-GPU check", passes, "NCCL between two GPUs", 2)


def machine(gpus: int, tmp_path: Path) -> Machine:
    return Machine(gpus, "" if gpus else "NVML sees no NVIDIA GPU here", "GPU-0" if gpus else "", tmp_path, ())


def test_without_a_gpu_the_cpu_checks_run_and_each_gpu_check_is_named_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_checks(machine(0, tmp_path), (CPU, ONE_GPU, TWO_GPUS)) == NO_GPU
    table = capsys.readouterr().out.split("summary")[1].splitlines()
    assert any(line.startswith("cpu check") and " no " in line and "passed   42 samples/s [" in line for line in table)
    assert any("one-GPU check" in line and "skipped  needs a GPU (NCCL)" in line for line in table), table
    assert any("two-GPU check" in line and "skipped  needs a GPU (NCCL between two GPUs)" in line for line in table)


def test_one_gpu_runs_every_one_gpu_check_and_passes_without_the_two_gpu_one(tmp_path: Path) -> None:
    assert run_checks(machine(1, tmp_path), (CPU, ONE_GPU, TWO_GPUS)) == 0


def test_a_failed_check_fails_the_run_and_the_others_still_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_checks(machine(0, tmp_path), (Check("resume", fails), CPU, ONE_GPU)) == 1
    out = capsys.readouterr().out
    assert "FAILED   CheckFailed: the resumed run redid 3 steps" in out and "cpu check" in out.split("summary")[1]


def test_the_torchrec_check_is_skipped_by_name_where_fbgemms_cuda_build_is_absent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """This machine has FBGEMM's CPU build (fbgemm-gpu-cpu), not the CUDA one: on a GPU node like it, the TorchRec
    row says what it needs instead of failing; the run's exit is still 0 where every other check passed."""
    import importlib.metadata

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("fbgemm-gpu")
    torchrec_check = next(check for check in gpu_check.CHECKS if check.run is gpu_check.torchrec_sharded)
    assert run_checks(machine(1, tmp_path), (CPU, torchrec_check)) == 0
    table = capsys.readouterr().out.split("summary")[1]
    assert "TorchRec tables sharded" in table and "needs fbgemm-gpu (FBGEMM's CUDA build" in table, table


def test_only_the_check_switch_lets_two_gpu_ranks_share_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # gpu_check's two ranks on a one-GPU machine: refused as ever without the switch, and on a machine
    # without a GPU even with it (there is nothing to share)
    job = compose_job("+experiment=rec", "cluster=local", "resources.gpus_per_node=2", "resources.procs_per_node=2")
    with pytest.raises(ConfigError, match=r"resources.gpus_per_node=2 .*0..1 \(GPUs on this machine\)"):
        check_local_resources(job, 1)
    monkeypatch.setenv(GLOO_ON_CUDA_ENV, "1")
    check_local_resources(job, 1)
    with pytest.raises(ConfigError, match="has no NVIDIA GPU"):
        check_local_resources(job, 0)


def hangs(m: Machine) -> str:
    """A check whose child, and that child's own child, never end: both pids kept in m.work/pids."""
    run_child(m, ["sh", "-c", f"sleep 300 & echo $$ $! > {m.work / 'pids'}; wait"], 600, "a hung child")
    return "unreached"


def slow_pass(m: Machine) -> str:
    time.sleep(1.5)
    return "took 1.5 s"


def gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie awaiting its reaper counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_hung_check_costs_its_row_its_processes_killed_and_the_deadline_leaves_the_rest_unrun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "LEAST_S", 1.0)
    table = tmp_path / "table.txt"
    checks = (Check("hung check", hangs, budget_s=2), CPU, ONE_GPU)
    started = time.monotonic()
    assert run_checks(machine(0, tmp_path), checks, deadline_s=2.5, table_path=table) == 1
    assert time.monotonic() - started < 10
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    deadline = time.monotonic() + 5
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(gone, pids)), f"the hung check's processes outlived it: {pids}"
    out = capsys.readouterr().out
    rows = table.read_text().splitlines()
    assert rows == out.split("\n\n")[-1].splitlines()[: len(rows)]  # the file is the table printed
    assert any(r.startswith("hung check") and "TIMEOUT  stopped at its budget of 2 s" in r for r in rows), rows
    assert any(r.startswith("cpu check") and "not run  the deadline (2 s) was spent before it" in r for r in rows)
    assert any(r.startswith("one-GPU check") and "skipped" in r for r in rows)  # skipped, deadline or not
    assert out.count("row: hung check") == 1  # printed as it ended


def test_the_deadline_left_a_check_unrun_after_the_others_passed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_check, "LEAST_S", 1.0)
    table = tmp_path / "rows.txt"
    assert run_checks(machine(1, tmp_path), (Check("slow", slow_pass), CPU), 2.0, table) == NOT_ALL_RUN
    text = table.read_text()
    assert "passed   took 1.5 s" in text and "not run" in text, text


def test_the_table_file_holds_every_row_as_each_check_ends(tmp_path: Path) -> None:
    seen: list[str] = []

    def look(m: Machine) -> str:  # the file as the second check starts: the first row done, the rest not reached
        seen.append((m.work / "table.txt").read_text())
        return "looked"

    assert run_checks(machine(1, tmp_path), (CPU, Check("look", look), ONE_GPU)) == 0
    assert "passed   42 samples/s" in seen[0] and "look" in seen[0] and "not reached" in seen[0], seen[0]


def test_bench_figures_come_from_their_own_file_not_stdout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # bench_gpu.py needs CUDA, which is not here: a stand-in prints what NCCL_DEBUG=INFO prints on stdout and
    # writes its figures where --json says, as bench_gpu.py does
    stand_in = tmp_path / "bench" / "bench_gpu.py"
    stand_in.parent.mkdir()
    stand_in.write_text(
        "import json, sys\n"
        "print('node:1:1 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>')\n"
        "out = sys.argv[sys.argv.index('--json') + 1]\n"
        "open(out, 'w').write(json.dumps({'ddp': True, 'trainer_vs_plain': 0.97, 'trainer_samples_per_s': 1e5}))\n"
        "print('{not json either')\n")
    monkeypatch.setattr(gpu_check, "REPO", tmp_path)
    figures = bench(machine(1, tmp_path))
    assert figures["trainer_vs_plain"] == 0.97


def test_the_env_check_knows_every_dependency_of_the_project() -> None:
    # each distribution pyproject.toml requires is tried by its module (hydra-core as hydra, ...)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip().lower() for d in project["dependencies"]}
    tried = {gpu_check_env.distribution(m).lower() for m in gpu_check_env.MODULES}
    assert names <= tried, names - tried


# ------------------------------------------------------------------ a python with torch and nothing of ours
#: What a GPU node's python lacks (the issue's list): hidden from the python the tests build.
OURS = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit")
HIDDEN = ("hydra", "hydra_plugins", "omegaconf", "antlr4", "submitit", "gpujobs", "jobs")


def _hidden(entry: str) -> bool:
    """Whether a site-packages entry is one of what a node lacks, or the editable install of the checkout."""
    name = entry.lower().replace("-", "_")
    if "editable" in name or name.startswith("gpujobs"):
        return True
    return any(name == h or name.startswith(f"{h}.") or name.startswith(f"{h}_") for h in HIDDEN) or any(
        name.startswith(d.replace("-", "_") + "-") for d in (*OURS, "hydra_submitit_launcher"))


@pytest.fixture(scope="module")
def node_python(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A python as a GPU node has (torch and the heavy dependencies, not gpujobs, Hydra, OmegaConf, antlr4 or
    submitit), and a wheelhouse of those four, built as the guide says: a venv whose site-packages holds links
    to this environment's, the four left out; their wheels from `pip wheel` (pip's cache, else PyPI)."""
    root = tmp_path_factory.mktemp("node")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)  # with pip: --wheelhouse's
    site = next((venv / "lib").glob("python3*/site-packages"))
    ours = Path(importlib.metadata.distribution("torch").locate_file(""))
    for entry in ours.iterdir():
        if not _hidden(entry.name) and not entry.name.endswith(".pth") and not (site / entry.name).exists():
            (site / entry.name).symlink_to(entry)
    python = venv / "bin" / "python"
    probe = subprocess.run([str(python), "-c", "import torch, numpy, pyarrow, pynvml, yaml; import hydra"],
                           capture_output=True, text=True, timeout=120)
    assert "No module named 'hydra'" in probe.stderr, probe.stderr  # torch and the rest there, ours not
    wheels = root / "wheels"
    pins = [f"{d}=={importlib.metadata.version(d)}" for d in OURS]
    made = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), *pins],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    return python, wheels


def gpu_check_sh(python: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """bash bench/gpu_check.sh with `python`, from outside the checkout, on an environment without ours."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(python), PATH=f"{python.parent}:{env['PATH']}")
    return subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          env=env, cwd="/", timeout=timeout)


def test_gpu_check_sh_names_each_missing_module_and_exits_2_without_a_wheelhouse(
    node_python: tuple[Path, Path]
) -> None:
    done = gpu_check_sh(node_python[0])
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout.startswith("gpu_check: torch "), done.stdout
    assert "CUDA" in done.stdout.splitlines()[0] and "NCCL" in done.stdout.splitlines()[0]
    for module, pip_name in (("hydra", "hydra-core"), ("omegaconf", "omegaconf"), ("submitit", "submitit")):
        assert f"gpu_check: missing {module}: pip name {pip_name}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_gpu_check_sh_with_a_wheelhouse_reaches_its_table_and_exits_3_without_a_gpu(
    node_python: tuple[Path, Path]
) -> None:
    python, wheels = node_python
    before = sorted(p.name for p in python.parent.parent.rglob("*"))
    done = gpu_check_sh(python, "--wheelhouse", str(wheels), "--only", "NVML,bench_gpu")
    out = done.stdout + done.stderr
    assert done.returncode == NO_GPU, out
    assert "Traceback" not in out
    assert "installing antlr4-python3-runtime" in out or "installing" in out
    table = out.split("gpu_check summary")[1]
    assert "NVML health of every GPU" in table and "skipped  needs a GPU (real NVML)" in table, table
    assert sorted(p.name for p in python.parent.parent.rglob("*")) == before  # nothing of the python touched


def test_gpu_check_sh_within_a_deadline_of_40_s_ends_within_60_s_naming_what_did_not_run(
    node_python: tuple[Path, Path], tmp_path: Path
) -> None:
    python, wheels = node_python
    table = tmp_path / "table.txt"
    started = time.monotonic()
    done = gpu_check_sh(python, "--wheelhouse", str(wheels), "--deadline", "40", "--table", str(table))
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert took < 60, f"{took:.0f} s: {out[-3000:]}"
    rows = table.read_text()
    assert done.returncode in (1, NOT_ALL_RUN), out[-3000:]  # the first CPU check passes or runs out of time
    assert "not run  the deadline (40 s) was spent before it" in rows, rows
    assert "2 ranks on 1 device" in rows and "skipped" in rows, rows
