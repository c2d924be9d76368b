"""TorchRec's sharding plan of a job's tables, made on meta tensors: no GPU, no process group, no data.

`plan_tables` builds the model's `EmbeddingBagCollection` on the meta device, attaches the fused table
optimizer (its state counts in the memory), and asks TorchRec's `EmbeddingShardingPlanner` for a plan over
the target topology (nodes x ranks a node, a GPU's and a node's memory). What the submit side and
`gpujobs plan` read is the `MemoryPlan` (per table: sharding type, kernel, bytes by rank; per rank: GPU and
host bytes); the trainer will shard with the `ShardingPlan` itself. A model that fits nowhere is `DoesNotFit`,
naming the key to change with the bytes needed and available.

`python -m gpujobs.rank.parallel.plan` reads a `PlanRequest` as JSON on stdin and writes the `MemoryPlan` as
JSON on stdout (exit 0), or `DoesNotFit`'s key, value and why as JSON (exit 2): how the submit side, which
never imports torch, asks.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import warnings
from typing import Any, Optional

import torch

from gpujobs.config.memory import (
    GIB,
    DoesNotFit,
    MemoryPlan,
    PlanRequest,
    RankBytes,
    TablePlacement,
    table_state_values,
)
from gpujobs.config.model_shape import FP32_BYTES, ModelShape
from gpujobs.config.parallel import SHARDING_TYPES

#: The share of each device's memory TorchRec's planner keeps free of tables (activations, input batches,
#: the dense part): its own default reservation.
RESERVED = 0.15
#: The share of a fused_uvm_caching table's rows cached in GPU memory (TorchRec's default cache_load_factor).
CACHE_LOAD_FACTOR = 0.2
#: Sharding types that split a table's rows: TorchRec offers them for GPU topologies only.
ROW_SPLITTING = ("row_wise", "table_row_wise", "grid_shard")


def embedding_bags(shape: ModelShape, device: torch.device, init_std: Optional[float] = None) -> Any:
    """The model's tables as one TorchRec `EmbeddingBagCollection` (sum pooling of one index per feature);
    `init_std`: their values drawn uniformly with this standard deviation where they are made (TorchRec's
    sharded kernels draw uniformly between two bounds; None: its own, 1/sqrt(rows))."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    bound = {} if init_std is None else {"weight_init_max": 3**0.5 * init_std, "weight_init_min": -(3**0.5) * init_std}
    tables = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows, feature_names=[t.feature],
                                 **bound) for t in shape.tables]
    return EmbeddingBagCollection(tables=tables, device=device)


def fuse_table_optimizer(module: torch.nn.Module, optimizer: str, lr: float = 0.01) -> None:
    """Attach the fused table optimizer (`optim.table_optimizer`) to `module`'s tables: TorchRec's sharder
    fuses it into the backward, and its planner counts its state."""
    from torchrec.optim import SGD, Adam, RowWiseAdagrad
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    kind = {"rowwise_adagrad": RowWiseAdagrad, "adam": Adam, "sgd": SGD}[optimizer]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "deprecated, use torch's _apply_optimizer_in_backward": the same call
        apply_optimizer_in_backward(kind, module.parameters(), {"lr": lr})


def _sharding_types(request: PlanRequest) -> list[str]:
    allowed = list(request.sharding_types or SHARDING_TYPES)
    if request.device == "cpu":
        allowed = [kind for kind in allowed if kind not in ROW_SPLITTING]
    return allowed


def plan_tables(request: PlanRequest) -> tuple[Any, MemoryPlan]:
    """TorchRec's `ShardingPlan` of the request's tables and the `MemoryPlan` it makes; DoesNotFit when none fits."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
    from torchrec.distributed.planner.types import PlannerError

    logging.getLogger("torchrec.distributed.planner").setLevel(logging.ERROR)  # its tables of proposals
    kinds = _sharding_types(request)
    if not kinds:
        raise DoesNotFit("parallel.sharding_types", list(request.sharding_types or ()),
                         "at least one of table_wise, column_wise, table_column_wise for CPU ranks (TorchRec plans "
                         "row-wise types for GPUs only)")
    module = embedding_bags(request.shape, torch.device("meta"))
    fuse_table_optimizer(module, request.table_optimizer)
    topology = Topology(world_size=request.world_size, compute_device=request.device,
                        local_world_size=request.ranks_per_node, **_caps(request))
    constraints = {t.name: ParameterConstraints(sharding_types=kinds, compute_kernels=list(request.compute_kernels))
                   for t in request.shape.tables}
    planner = EmbeddingShardingPlanner(topology=topology, batch_size=request.batch_per_rank, constraints=constraints,
                                       storage_reservation=FixedPercentageStorageReservation(RESERVED))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = planner.plan(module, [EmbeddingBagCollectionSharder()])
    except PlannerError:
        raise _does_not_fit(request) from None
    return plan, memory_plan(request, plan)


def _caps(request: PlanRequest) -> dict[str, int]:
    """The Topology's per-device capacities: a GPU's memory and its share of the node's host memory."""
    host = None if request.host_mem is None else request.host_mem // request.ranks_per_node
    if request.device == "cuda":
        if request.gpu_mem is None:
            raise DoesNotFit("resources.gpu_mem_gib", None, "a GPU's memory in GiB (required: the job's GPUs are "
                                                            "not this machine's, and the plan sizes the tables by it)")
        return {"hbm_cap": request.gpu_mem, **({"ddr_cap": host} if host is not None else {})}
    if host is None:
        raise DoesNotFit("resources.host_mem_gib", None, "a node's host memory in GiB (required for CPU ranks where "
                                                         "the nodes are not this machine)")
    return {"ddr_cap": host}


def _does_not_fit(request: PlanRequest) -> DoesNotFit:
    """The one line of a plan that found no room: the tables' bytes (with their optimizer state) against what
    the ranks have for them, and the nodes that would hold them."""
    need = sum((t.parameters + table_state_values(request.table_optimizer, t)) * FP32_BYTES
               for t in request.shape.tables)
    on_gpu = request.device == "cuda"
    per_rank = (request.gpu_mem if on_gpu else request.host_mem // request.ranks_per_node) or 0  # type: ignore[operator]
    room = int(per_rank * (1 - RESERVED))
    have = room * request.world_size
    nodes = max(request.nodes + 1, math.ceil(need / max(1, room * request.ranks_per_node)))
    where = "GPU" if on_gpu else "host"
    hint = ""
    if on_gpu and "fused_uvm_caching" not in request.compute_kernels:
        hint = ", or let tables live in host memory: parallel.compute_kernels=[fused,fused_uvm_caching]"
    return DoesNotFit("resources.nodes", request.nodes,
                      f"the tables and their {request.table_optimizer} state need {need / GIB:.1f} GiB of {where} "
                      f"memory; {request.nodes} node(s) x {request.ranks_per_node} ranks hold {have / GIB:.1f} GiB "
                      f"for tables ({1 - RESERVED:.0%} of {per_rank / GIB:.1f} GiB a rank): at least {nodes} nodes "
                      f"(TorchRec's planner found no plan){hint}")


def memory_plan(request: PlanRequest, plan: Any) -> MemoryPlan:
    """What `plan` puts where: each table's bytes by rank (its shards, with their optimizer state) and each
    rank's GPU and host bytes (the dense part replicated on every rank)."""
    dims = {t.name: t for t in request.shape.tables}
    on_gpu = request.device == "cuda"
    gpu = dict.fromkeys(range(request.world_size), request.dense_bytes() if on_gpu else 0)
    host = dict.fromkeys(range(request.world_size), 0 if on_gpu else request.dense_bytes())
    tables = []
    for module_plan in plan.plan.values():
        for name, sharding in module_plan.items():
            table = dims[name]
            per_value = FP32_BYTES * (1 + table_state_values(request.table_optimizer, table) / table.parameters)
            by_rank: dict[int, int] = {}
            shards = []
            for shard in sharding.sharding_spec.shards:
                rank = shard.placement.rank()
                shards.append((rank, *shard.shard_offsets, *shard.shard_sizes))
                size = int(math.prod(shard.shard_sizes) * per_value)
                by_rank[rank] = by_rank.get(rank, 0) + size
                kernel = sharding.compute_kernel
                if not on_gpu or kernel in ("fused_uvm", "fused_uvm_caching"):
                    host[rank] += size
                if on_gpu and kernel == "fused":
                    gpu[rank] += size
                elif on_gpu and kernel == "fused_uvm_caching":
                    gpu[rank] += int(size * CACHE_LOAD_FACTOR)
            tables.append(TablePlacement(name, table.rows, table.dim, sharding.sharding_type, sharding.compute_kernel,
                                         by_rank, tuple(shards)))
    ranks = tuple(RankBytes(rank, gpu[rank], host[rank]) for rank in range(request.world_size))
    return MemoryPlan("torchrec", request.world_size, request.ranks_per_node, request.device, request.gpu_mem,
                      request.host_mem, tuple(sorted(tables, key=lambda t: _table_number(t.name))), ranks)


def _table_number(name: str) -> tuple[int, str]:
    digits = "".join(ch for ch in name if ch.isdigit())
    return (int(digits) if digits else -1, name)


def main() -> int:
    """Read a PlanRequest (JSON) on stdin; write its MemoryPlan (JSON) on stdout, or DoesNotFit's parts (exit 2)."""
    request = PlanRequest.from_json(json.load(sys.stdin))
    try:
        _, plan = plan_tables(request)
    except DoesNotFit as err:
        json.dump({"key": err.key, "value": err.value, "why": err.why}, sys.stdout)
        return 2
    json.dump(plan.to_json(), sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
