"""resources.cpus_per_task: null by default, derived at submit (issue 39 D6): a GPU rank's autograd, NCCL
proxy and watchdog, gloo, heartbeat, NVML and checkpoint threads do not share one core; an explicit value is
kept as it is."""

from __future__ import annotations

import os

import pytest
from conftest import compose_job

from gpujobs.backends.local import LocalBackend
from gpujobs.backends.slurm.preflight import ClusterInfo, PartitionInfo, node_cpus
from gpujobs.base.errors import ConfigError
from gpujobs.config.cluster import GPU_RANK_CPUS_CAP
from gpujobs.launch import derive_cpus


@pytest.mark.parametrize(("overrides", "node", "cpus"), [
    ((), 64, 1),  # CPU ranks: one each, as before
    (("resources.gpus_per_node=8",), 64, 8),  # the node's CPUs / its GPUs
    (("resources.gpus_per_node=8",), 12, 1),
    (("resources.gpus_per_node=4",), 40, 8),  # at most GPU_RANK_CPUS_CAP
    (("resources.gpus_per_node=4",), None, 1),  # unknown: the former default, and the line says so
])
def test_null_is_a_nodes_cpus_over_its_gpu_ranks_capped(overrides: tuple[str, ...], node: int | None,
                                                         cpus: int) -> None:
    res = compose_job("cluster=slurm", *overrides).resources
    assert res.cpus_per_task is None and res.derived_cpus(node)[0] == cpus
    assert GPU_RANK_CPUS_CAP == 8


def test_slurm_derives_from_the_fewest_cpus_of_a_partition_node_with_the_gpus() -> None:
    nodes = {"g1": (64, 8), "g2": (48, 8), "c1": (16, 0), "small": (8, 2)}
    info = ClusterInfo({"gpu": PartitionInfo("gpu", default=True, nodes=nodes)}, None, None)
    assert node_cpus(compose_job("cluster=slurm", "resources.gpus_per_node=8"), info) == 48
    assert node_cpus(compose_job("cluster=slurm", "resources.gpus_per_node=2"), info) == 8
    with pytest.raises(ConfigError, match=r"cluster\.partition='cpu' is invalid: allowed one of gpu"):
        node_cpus(compose_job("cluster=slurm", "cluster.partition=cpu", "resources.gpus_per_node=2"), info)


def test_a_local_gpu_job_gets_this_machines_cpus_over_its_gpus_said_once_and_kept_in_the_config() -> None:
    job = compose_job("cluster=local", "resources.gpus_per_node=2")
    cache: dict[object, object] = {}
    said = derive_cpus(job, LocalBackend(), cache)
    expected = max(1, min(GPU_RANK_CPUS_CAP, len(os.sched_getaffinity(0)) // 2))
    assert job.resources.cpus_per_task == expected and job.to_dict()["resources"]["cpus_per_task"] == expected
    assert said is None  # known CPUs: recorded in the config, not said


def test_gpu_ranks_on_nodes_of_unknown_cpus_get_one_said_once_a_sweep() -> None:
    """Kubernetes' nodes' CPUs are not known from here: one CPU a GPU rank, said on stderr (once a sweep)."""
    from gpujobs.backends import backend_named

    job = compose_job("cluster=kubernetes", "resources.gpus_per_node=2", "container.image=rec:1")
    cache: dict[object, object] = {}
    said = derive_cpus(job, backend_named("kubernetes"), cache)
    assert job.resources.cpus_per_task == 1
    assert said is not None and said.startswith("gpujobs: resources.cpus_per_task=null: 1 CPUs per rank ("), said
    again = compose_job("cluster=kubernetes", "resources.gpus_per_node=2", "container.image=rec:1")
    assert derive_cpus(again, backend_named("kubernetes"), cache) is None  # the next point: not said twice


def test_an_explicit_value_is_kept_as_it_is() -> None:
    job = compose_job("cluster=local", "resources.gpus_per_node=2", "resources.cpus_per_task=3")
    cpu_job = compose_job("cluster=local", "resources.procs_per_node=2")
    # an explicit value is kept, and CPU ranks get the former default, without a word
    assert derive_cpus(job, LocalBackend()) is None and derive_cpus(cpu_job, LocalBackend()) is None
    assert job.resources.cpus_per_task == 3 and cpu_job.resources.cpus_per_task == 1
