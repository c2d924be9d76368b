"""The sbatch script is a pure function of the config: golden-file tested, every value quoted."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from conftest import assert_golden, compose_job

from gpujobs.backends.slurm.sbatch import render_sbatch, sbatch_request
from gpujobs.launch import check_paths

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
    step = shlex.split(next(line for line in text.splitlines() if line.startswith("exec ")))
    srun = step[step.index("srun"):]  # the srun line, under the batch step's supervisor
    assert srun[3] == f"{folder}/%j_%t_log.out"


@pytest.mark.parametrize("flag", ["--signal=USR2@120", "--requeue", "--ntasks-per-node=2", "--open-mode=append"])
def test_defaults_carry_the_contract_flags(flag: str) -> None:
    text = render_sbatch(sbatch_request(compose_job("+experiment=rec", "cluster=slurm"), Path("/r"), COMMAND))
    assert f"#SBATCH {flag}\n" in text
    assert "--gpus-per-node" not in text  # CPU ranks: no GPU request


#: The most hostile values validation still accepts: names use every allowed character (a leading `-`
#: too), the run dir every character a shell acts on (only control characters, `%` and `\` are refused).
HOSTILE = (
    "+experiment=rec", "cluster=slurm", "name=-rec.v2_", "cluster.partition=gpu.a100-x_1",
    "cluster.account=-lab.1_", "cluster.qos=q-1.x_", "cluster.constraint='[a100,ib]'",
    "cluster.exclude='node[3-4],gpu-01'", "cluster.time=2-00:00:00", "cluster.signal_lead_s=65535",
    "resources.nodes=2", "resources.gpus_per_node=8", "resources.mem_gb=0.0009765625", "nccl=ethernet",
    "nccl.socket_ifname='^=lo,docker0'", "nccl.debug_subsys='INIT,NET^+/=:'", "+nccl.extra.NCCL_NVLS_ENABLE=true",
    "+nccl.extra.NCCL_TOPO_FILE=/etc/nccl/topo+1.xml",
)
HOSTILE_RUN_DIR = Path("/runs/it's a \"$(reboot)\" `id`;#&|*?~ {x} $HOME !/rec")


def test_the_most_hostile_accepted_job_matches_the_golden_file() -> None:
    job = compose_job(*HOSTILE)
    check_paths(job, HOSTILE_RUN_DIR)  # accepted: this is what validation lets through to sbatch
    folder = HOSTILE_RUN_DIR / job.cluster.folder
    command = " ".join(shlex.quote(arg) for arg in ("/venv/bin/python", "-u", "-m", "gpujobs.rank.srun",
                                                     "--folder", str(folder), str(HOSTILE_RUN_DIR)))
    text = render_sbatch(sbatch_request(job, folder, command))
    assert_golden(text, "hostile_accepted.sbatch")
    # every directive's value reads back as the value (sbatch's quoting is the shell's, less backslashes)
    flags = dict(line.removeprefix("#SBATCH --").split("=", 1) for line in text.splitlines()
                 if line.startswith("#SBATCH --") and "=" in line)
    assert shlex.split(flags["job-name"]) == ["-rec.v2_"]
    assert shlex.split(flags["output"]) == [f"{folder}/%j_0_log.out"]
    assert flags["mem"] == "1M"  # 1 MiB, the least that is not the whole node
    assert flags["signal"] == "USR2@65535"
    assert "\\" not in text.split("\n# NCCL")[0]
    assert "export NCCL_NVLS_ENABLE=1\n" in text  # `true`, as NCCL reads it


FOUR_NODES = ("+experiment=rec", "cluster=slurm", "cluster.partition=debug", "resources.nodes=4",
              "resources.gpus_per_node=2", "resources.cpus_per_task=4")
ELASTIC = (*FOUR_NODES, "resources.min_nodes=2")


def test_an_elastic_job_asks_for_a_node_range_and_fixes_no_total() -> None:
    """`--nodes=MIN-MAX`; everything else per node, so the world size is whatever the allocation gives."""
    text = render_sbatch(sbatch_request(compose_job(*ELASTIC), Path("/runs/rec/submitit"), COMMAND))
    assert_golden(text, "rec_elastic_2to4_nodes.sbatch")
    assert "#SBATCH --nodes=2-4\n" in text and "#SBATCH --ntasks-per-node=2\n" in text
    assert "#SBATCH --gpus-per-node=2\n" in text
    assert "--ntasks=" not in text and "--ntasks " not in text
    srun = shlex.split(next(line for line in text.splitlines() if line.startswith("exec ")))
    srun = srun[srun.index("srun"):]
    assert not {"-n", "-N", "--nodes", "--ntasks"} & set(srun) and not [a for a in srun if a.startswith("--n")]


@pytest.mark.parametrize("min_nodes", ["resources.min_nodes=null", "resources.min_nodes=4"])
def test_min_nodes_equal_to_nodes_renders_the_fixed_script(min_nodes: str) -> None:
    fixed, same = compose_job(*FOUR_NODES), compose_job(*FOUR_NODES, min_nodes)
    render = [render_sbatch(sbatch_request(job, Path("/r"), COMMAND)) for job in (fixed, same)]
    assert render[0] == render[1] and "#SBATCH --nodes=4\n" in render[0] and "Elastic" not in render[0]
