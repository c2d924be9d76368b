"""The `parallel` section: how the model is spread over the ranks (torch-free).

`parallel=ddp` replicates the whole model on every rank (DistributedDataParallel). `parallel=torchrec`
shards the embedding tables over the ranks with TorchRec's planner and keeps the rest data-parallel, so
tables far larger than one GPU fit; `gpujobs plan` shows the plan before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from gpujobs.base.errors import ConfigError
from gpujobs.config.modes import Parallel
from gpujobs.config.validate import Checked, bounds

#: TorchRec's sharding types a table may get (`torchrec.distributed.types.ShardingType`, less data_parallel:
#: a replicated table would need the dense optimizer, not the fused one every table here trains with).
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "grid_shard")
#: TorchRec's compute kernels for a sharded table (`EmbeddingComputeKernel`): in GPU memory (fused), in host
#: memory read through unified memory (fused_uvm), or there with a GPU cache of its hot rows (fused_uvm_caching).
COMPUTE_KERNELS = ("fused", "fused_uvm", "fused_uvm_caching")


def _names_of(allowed: tuple[str, ...]) -> dict[str, Any]:
    return bounds(valid=lambda value: value is None or (bool(value) and all(v in allowed for v in value)),
                  allowed=f"null or a non-empty list of {', '.join(allowed)}")


@dataclass
class ParallelConfig(Checked):
    """How the model is spread over the ranks (`parallel=ddp|torchrec`)."""

    name: Parallel = Parallel.ddp
    """ddp: every rank holds the whole model | torchrec: the embedding tables are sharded over the ranks by
    TorchRec's planner, the rest stays data-parallel."""
    sharding_types: Optional[list[str]] = field(default=None, metadata=_names_of(SHARDING_TYPES))
    """torchrec: the sharding types the planner may give a table (null: any of them, the planner's choice).
    TorchRec offers row-wise types for GPU topologies only."""
    compute_kernels: list[str] = field(default_factory=lambda: ["fused"], metadata=_names_of(COMPUTE_KERNELS))
    """torchrec: where a table may live. fused: GPU memory only (the default); fused_uvm_caching: host memory
    with a cache of its hot rows in GPU memory, where GPU memory is short; fused_uvm: host memory."""
    plan: Optional[str] = field(default=None, metadata=bounds(valid=lambda value: value is None or bool(value.strip()),
                                                              allowed="null or the path of a plan.json"))
    """torchrec: a plan.json kept by an earlier run (or `gpujobs plan --out`) to use as it is, where it was made
    for the same tables and world size (null: plan at start)."""


def check_torchrec(job: Any) -> None:
    """Refuse (ConfigError naming the key) what `parallel=torchrec` cannot train as configured; `job` is the
    whole JobConfig (its sections are read, never changed)."""
    if job.parallel.name != Parallel.torchrec:
        return
    if job.script is not None:
        raise ConfigError("parallel", "torchrec", "ddp for a script job (a script builds and spreads its own model)")
    if not callable(getattr(job.model, "shape", None)) or not callable(getattr(job.data, "features", None)):
        raise ConfigError("parallel", "torchrec", f"ddp for model {type(job.model).__name__} (a model config must "
                          "describe its tables, shape(features), to shard them)")
    if job.trainer.grad_accum != 1:
        raise ConfigError("trainer.grad_accum", job.trainer.grad_accum, "1 under parallel=torchrec (the tables' "
                          "optimizer runs in their backward, once per micro-batch: no gradient is accumulated)")
    if job.checkpoint.background:
        raise ConfigError("checkpoint.async", True, "false under parallel=torchrec (its sharded saves are "
                          "synchronous in this version)")
    if job.trainer.balance != "off":
        raise ConfigError("trainer.balance", str(job.trainer.balance), "off under parallel=torchrec (uneven shares "
                          "of a step are not yet measured and split for sharded tables in this version)")
    if job.optim.table_optimizer == "adam" and not job.resources.gpus_per_node:
        raise ConfigError("optim.table_optimizer", "adam", "rowwise_adagrad or sgd for CPU ranks (FBGEMM's CPU "
                          "kernels have no fused Adam)")
