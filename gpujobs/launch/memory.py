"""Will the model fit: the memory plan of a job, made before anything is queued (torch-free).

`plan_job` asks the job's model config for its shape (`shape(features)`, no torch) and makes the plan for the
configured topology: under `parallel=ddp` by arithmetic (`replicated_plan`), under `parallel=torchrec` with
TorchRec's planner in a child process (`python -m gpujobs.rank.parallel.plan`: this side never imports
torch). A model that does not fit is one ConfigError line naming the key to change, the bytes needed and
the bytes there. Submit keeps the plan in the run dir (plan.json); `gpujobs plan` prints it.

Memory comes from the config where it says (`resources.gpu_mem_gib`, `resources.host_mem_gib`, else
`resources.mem_gb` for a node), else from this machine where the job runs here (NVML for its GPUs, the
machine's memory); elsewhere it is unknown: a replicated model is then not checked against it, and a
sharded one needs it (the planner sizes the shards by it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Optional

from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.config.load import JobConfig
from gpujobs.config.memory import GIB, DoesNotFit, MemoryPlan, PlanRequest, check_replicated, replicated_plan
from gpujobs.config.model_shape import ModelShape
from gpujobs.rundir.resume import global_batch_of

#: The dense optimizer's name -> the fused table optimizer it implies (`optim.table_optimizer: null`).
TABLE_OPTIMIZER_OF = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}
#: How long TorchRec's planner may take (its import is most of it: ~4 s here).
PLAN_TIMEOUT_S = 120


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


def _local(job: JobConfig) -> bool:
    return job.cluster.name in ("local", "debug")


def gpu_memory(job: JobConfig) -> Optional[int]:
    """A GPU's memory in bytes: `resources.gpu_mem_gib`, else the smallest of this machine's GPUs (NVML) for a
    local job, else None."""
    if job.resources.gpu_mem_gib is not None:
        return int(job.resources.gpu_mem_gib * GIB)
    if not _local(job) or job.resources.gpus_per_node == 0:
        return None
    from gpujobs.base.nvml import NvmlUnavailable, nvml_session, visible_gpus

    try:
        with nvml_session() as nv:
            sizes = [int(nv.nvmlDeviceGetMemoryInfo(gpu.handle).total) for gpu in visible_gpus(nv)]
    except NvmlUnavailable:
        return None
    return min(sizes) if sizes else None


def host_memory(job: JobConfig) -> Optional[int]:
    """A node's memory for the ranks, in bytes: `resources.host_mem_gib`, else `resources.mem_gb` (Slurm's
    --mem), else this machine's for a local job, else None."""
    resources = job.resources
    if resources.host_mem_gib is not None:
        return int(resources.host_mem_gib * GIB)
    if resources.mem_gb is not None:
        return int(resources.mem_gb * 1000**3)
    if _local(job):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


def plan_request(job: JobConfig, shape: ModelShape) -> PlanRequest:
    """The request of `job`'s plan: its topology, memory, optimizers and sharding settings."""
    resources, parallel = job.resources, job.parallel
    batch = global_batch_of(job) or resources.world_size
    table_optimizer = job.optim.table_optimizer or TABLE_OPTIMIZER_OF[str(job.optim.name)]
    return PlanRequest(
        shape=shape, nodes=resources.nodes, ranks_per_node=resources.ranks_per_node,
        device="cuda" if resources.gpus_per_node else "cpu", gpu_mem=gpu_memory(job), host_mem=host_memory(job),
        parallel=str(parallel.name), dense_optimizer=str(job.optim.name), table_optimizer=str(table_optimizer),
        batch_per_rank=max(1, batch // (resources.world_size * job.trainer.grad_accum)),
        sharding_types=tuple(parallel.sharding_types) if parallel.sharding_types else None,
        compute_kernels=tuple(parallel.compute_kernels),
    )


def plan_job(job: JobConfig, cache: Optional[dict[Any, Any]] = None) -> Optional[MemoryPlan]:
    """The memory plan of `job`, or None where its model cannot describe itself; a ConfigError line when it
    does not fit. `cache`: a sweep's points of one request share one plan."""
    shape = model_shape(job)
    if shape is None:
        return None
    request = plan_request(job, shape)
    key = ("memory plan", json.dumps(request.to_json(), sort_keys=True))
    if cache is not None and key in cache:
        cached: MemoryPlan = cache[key]
        return cached
    try:
        if request.parallel == "ddp":
            check_replicated(request)
            plan = replicated_plan(request)
        else:
            plan = sharded_plan(request)
    except DoesNotFit as err:
        raise ConfigError(err.key, err.value, err.why) from None
    if cache is not None:
        cache[key] = plan
    return plan


def sharded_plan(request: PlanRequest) -> MemoryPlan:
    """TorchRec's plan of `request`, made in a child process (DoesNotFit with its line when none fits)."""
    command = [sys.executable, "-m", "gpujobs.rank.parallel.plan"]
    try:
        done = subprocess.run(command, input=json.dumps(request.to_json()), capture_output=True, text=True,
                              timeout=PLAN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise GpujobsError(f"TorchRec's planner did not answer within {PLAN_TIMEOUT_S} s") from None
    if done.returncode == 2:
        refusal = json.loads(done.stdout)
        raise DoesNotFit(refusal["key"], refusal["value"], refusal["why"])
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if "No module named 'torchrec'" in done.stderr or "No module named 'fbgemm_gpu'" in done.stderr:
            raise ConfigError("parallel", "torchrec", "installed TorchRec and FBGEMM (scripts/install-torchrec.sh "
                                                      "cpu|cuda; then pip install 'gpujobs[torchrec]')")
        raise GpujobsError(f"TorchRec's planner failed: {last}")
    return MemoryPlan.from_json(json.loads(done.stdout))

