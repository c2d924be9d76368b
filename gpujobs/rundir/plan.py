"""The run dir's memory plan (plan.json) and the request it is made from (torch-free).

Both sides make a job's `PlanRequest` here: the submit side to check that the model fits before anything is
queued (`gpujobs.launch.memory`), the ranks to shard the tables at start (`gpujobs.rank.parallel`). The plan
made at submit is kept as plan.json; the ranks shard by it where it was made for their world size and tables,
and plan again (rank 0 rewriting it) where not: an elastic start, a requeue on fewer nodes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from gpujobs.base.atomic import FsyncBatch, write_text_atomic
from gpujobs.base.errors import GpujobsError
from gpujobs.config.load import JobConfig
from gpujobs.config.memory import GIB, MemoryPlan, PlanRequest
from gpujobs.config.model_shape import ModelShape
from gpujobs.rundir import PLAN_FILE
from gpujobs.rundir.resume import global_batch_of
from gpujobs.rundir.trust import read_own


def model_shape(job: JobConfig) -> Optional[ModelShape]:
    """The model's shape from its config (None for a job whose model cannot say: a script, another task)."""
    if job.script is not None:
        return None
    features = getattr(job.data, "features", None)
    shape = getattr(job.model, "shape", None)
    if not callable(features) or not callable(shape):
        return None
    result: ModelShape = shape(features())
    return result


def gpu_memory(job: JobConfig, here: bool) -> Optional[int]:
    """A GPU's memory in bytes: `resources.gpu_mem_gib`, else, where the job's GPUs are this machine's (`here`),
    the smallest of them (NVML), else None."""
    if job.resources.gpu_mem_gib is not None:
        return int(job.resources.gpu_mem_gib * GIB)
    if not here or job.resources.gpus_per_node == 0:
        return None
    from gpujobs.base.nvml import NvmlUnavailable, nvml_session, visible_gpus

    try:
        with nvml_session() as nv:
            sizes = [int(nv.nvmlDeviceGetMemoryInfo(gpu.handle).total) for gpu in visible_gpus(nv)]
    except NvmlUnavailable:
        return None
    return min(sizes) if sizes else None


def host_memory(job: JobConfig, here: bool) -> Optional[int]:
    """A node's memory for the ranks, in bytes: `resources.host_mem_gib`, else `resources.mem_gb` (Slurm's
    --mem), else this machine's where the job runs on it (`here`), else None."""
    resources = job.resources
    if resources.host_mem_gib is not None:
        return int(resources.host_mem_gib * GIB)
    if resources.mem_gb is not None:
        return int(resources.mem_gb * 1000**3)
    if here:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def plan_request(job: JobConfig, shape: ModelShape, here: bool, nodes: Optional[int] = None) -> PlanRequest:
    """The request of `job`'s plan on `nodes` (default: resources.nodes): its topology, memory (this machine's
    where the config says none and the job runs `here`: a local job, or a rank on its node), optimizers and
    sharding settings."""
    resources, parallel = job.resources, job.parallel
    nodes = nodes or resources.nodes
    world = nodes * resources.ranks_per_node
    batch = global_batch_of(job, world) or world
    return PlanRequest(
        shape=shape, nodes=nodes, ranks_per_node=resources.ranks_per_node,
        device="cuda" if resources.gpus_per_node else "cpu", gpu_mem=gpu_memory(job, here),
        host_mem=host_memory(job, here),
        parallel=str(parallel.name), dense_optimizer=str(job.optim.name),
        table_optimizer=str(job.optim.table_optimizer),
        batch_per_rank=max(1, batch // (world * job.trainer.grad_accum)),
        sharding_types=tuple(parallel.sharding_types) if parallel.sharding_types else None,
        compute_kernels=tuple(parallel.compute_kernels),
    )


def write_plan(run_dir: Path, plan: MemoryPlan, batch: Optional[FsyncBatch] = None) -> Path:
    """Save a memory plan atomically as the run dir's `plan.json` (durable now, or with `batch`)."""
    path = run_dir / PLAN_FILE
    write_text_atomic(path, json.dumps(plan.to_json(), indent=2, sort_keys=True) + "\n", batch)
    return path


def read_plan(path: Path) -> Optional[MemoryPlan]:
    """The memory plan in `path` (a run dir's plan.json, or `parallel.plan`); None when there is none; a
    GpujobsError naming the file when it is no plan (damaged, or made by hand)."""
    try:
        text = read_own(path)
    except FileNotFoundError:
        return None
    try:
        return MemoryPlan.from_json(json.loads(text))
    except (ValueError, TypeError, KeyError) as err:
        raise GpujobsError(f"{path} holds no memory plan ({err}): remove it, or make one with "
                           "gpujobs plan --out") from None
