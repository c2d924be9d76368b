"""bench/gpu_check.py's verdict: which checks a machine runs, the summary table, and the exit code a later
session's one GPU run is judged by (the checks themselves run in `bash bench/gpu_check.sh`); and the
check-only switch that lets its two GPU ranks share one GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import compose_job

from gpujobs.backends.local import check_local_resources
from gpujobs.base.errors import ConfigError
from gpujobs.config.nccl import GLOO_ON_CUDA_ENV

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from gpu_check import NO_GPU, Check, Machine, need, run_checks


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
