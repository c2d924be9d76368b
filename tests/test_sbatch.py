"""The sbatch script is a pure function of the config: golden-file tested, every value quoted."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from conftest import assert_golden, compose_job

from gpujobs.launch.sbatch import render_sbatch, sbatch_request

COMMAND = "/venv/bin/python -u -m submitit.core._submit /runs/rec/submitit"


def test_two_node_ethernet_job_matches_the_golden_file() -> None:
    job = compose_job(
        "+experiment=rec", "cluster=slurm", "cluster.partition=debug", "cluster.account=recsys",
        "cluster.time=02:30:00", "cluster.signal_lead_s=300", "resources.nodes=2",
        "resources.gpus_per_node=3", "resources.cpus_per_task=8", "resources.mem_gb=64", "nccl=ethernet",
    )
    text = render_sbatch(sbatch_request(job, Path("/runs/rec/submitit"), COMMAND))
    assert_golden(text, "rec_2nodes_3gpus.sbatch")


def test_hostile_paths_are_quoted() -> None:
    job = compose_job("+experiment=rec", "cluster=slurm")
    folder = Path("/runs/it's $(reboot)/submitit")
    text = render_sbatch(sbatch_request(job, folder, COMMAND))
    output = next(line for line in text.splitlines() if line.startswith("#SBATCH --output="))
    value = output.split("=", 1)[1]
    assert shlex.split(value) == [f"{folder}/%j_0_log.out"]
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert shlex.split(srun)[3] == f"{folder}/%j_%t_log.out"


@pytest.mark.parametrize("flag", ["--signal=USR2@120", "--requeue", "--ntasks-per-node=2", "--open-mode=append"])
def test_defaults_carry_the_contract_flags(flag: str) -> None:
    text = render_sbatch(sbatch_request(compose_job("+experiment=rec", "cluster=slurm"), Path("/r"), COMMAND))
    assert f"#SBATCH {flag}\n" in text
    assert "--gpus-per-node" not in text  # CPU ranks: no GPU request
