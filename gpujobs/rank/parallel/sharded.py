"""`parallel=torchrec` on a rank: the model's tables sharded over the ranks by TorchRec, the rest data-parallel.

The task builds its model around `TableBags` on the meta device (its tables never exist whole on a rank).
`ShardedModel` then fuses the table optimizer into the tables' backward, takes the plan (the run dir's
plan.json where it was made for this world size and these tables, else TorchRec's planner on rank 0, every
rank sharding by the same plan) and wraps the model in `DistributedModelParallel`, which shards the tables
and wraps the dense part in DDP. Batches reach the tables as `KeyedJaggedTensor`s (`to_kjt`).

State: the dense part (its parameters, the dense optimizer) is shared state, saved by rank 0 as under DDP;
the tables and the fused optimizer's state are sharded state, saved by every rank through
`torch.distributed.checkpoint` (`sharded_state`), which loads them into whatever plan the ranks have then:
an elastic resume reshards them. `table_digest` hashes the logical tables, whatever the plan.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any, Optional

import torch
from torch import nn

from gpujobs.config.memory import MemoryPlan, PlanRequest
from gpujobs.config.model_shape import ModelShape
from gpujobs.rank import collectives
from gpujobs.rank.parallel.plan import embedding_bags, fuse_table_optimizer, plan_tables

log = logging.getLogger(__name__)

#: Rows a table's values are drawn for at once, from a generator of their own (`ShardedModel._init_tables`).
INIT_BLOCK = 4096


def to_kjt(sparse: torch.Tensor, keys: Sequence[str]) -> Any:
    """Indices [B, S] (one value per feature per sample) as TorchRec's `KeyedJaggedTensor`: feature-major values,
    every length 1."""
    from torchrec import KeyedJaggedTensor

    lengths = torch.ones(sparse.shape[0] * sparse.shape[1], dtype=torch.int32, device=sparse.device)
    return KeyedJaggedTensor(keys=list(keys), values=sparse.t().reshape(-1), lengths=lengths)


class TableBags(nn.Module):
    """A model's tables as one TorchRec `EmbeddingBagCollection`: categorical indices (a KJT, or [B, S]) to
    their vectors [B, S, d], in the shape's feature order (every table of one dimension).

    `scale` multiplies the vectors (the values are stored divided by it: a model's `embedding_lr_scale`),
    `init_std` is their spread where the sharded tables are made."""

    def __init__(self, shape: ModelShape, device: torch.device, scale: float = 1.0,
                 init_std: Optional[float] = None) -> None:
        super().__init__()
        dims = {table.dim for table in shape.tables}
        if len(dims) != 1:
            raise ValueError(f"TableBags needs tables of one dimension, not {sorted(dims)}")
        self.keys = [table.feature for table in shape.tables]
        self.dim = dims.pop()
        self.scale = scale
        self.init_std = init_std if init_std is not None else 1.0 / max(t.rows for t in shape.tables) ** 0.5
        self.bags = embedding_bags(shape, device, init_std)

    def forward(self, sparse: Any) -> torch.Tensor:
        kjt = to_kjt(sparse, self.keys) if isinstance(sparse, torch.Tensor) else sparse
        # a KeyedTensor [B, S * d] whose features come in the order the sharding grouped them (not the tables'):
        # taken by name
        by_feature = self.bags(kjt).to_dict()
        vectors = torch.stack([by_feature[key] for key in self.keys], dim=1)
        return vectors * self.scale if self.scale != 1.0 else vectors


def tables_of(model: nn.Module) -> tuple[str, TableBags]:
    """The path and module of the one `TableBags` in `model` (ValueError when there is none, or several)."""
    found = [(name, module) for name, module in model.named_modules() if isinstance(module, TableBags)]
    if len(found) != 1:
        raise ValueError(f"a model under parallel=torchrec holds one TableBags, this one {len(found)}")
    return found[0]


def sharding_plan(memory: MemoryPlan, path: str, device: torch.device) -> Any:
    """TorchRec's `ShardingPlan` of `memory` (its tables' shards as recorded) for the collection at `path`."""
    from torchrec.distributed.types import (
        EmbeddingModuleShardingPlan,
        EnumerableShardingSpec,
        ParameterSharding,
        ShardingPlan,
        ShardMetadata,
    )

    def place(rank: int) -> str:
        return f"rank:{rank}/cuda:{rank % memory.ranks_per_node}" if device.type == "cuda" else f"rank:{rank}/cpu"

    params = EmbeddingModuleShardingPlan()
    for table in memory.tables:
        shards = [ShardMetadata(shard_offsets=[row, col], shard_sizes=[rows, cols], placement=place(rank))
                  for rank, row, col, rows, cols in table.shards]
        params[table.name] = ParameterSharding(
            sharding_type=table.sharding_type, compute_kernel=table.compute_kernel,
            ranks=[shard[0] for shard in table.shards], sharding_spec=EnumerableShardingSpec(shards))
    return ShardingPlan({f"{path}.bags" if path else "bags": params})


def fits(memory: Optional[MemoryPlan], request: PlanRequest) -> bool:
    """Whether `memory` was made for this request's world size and tables (and may be applied as it is)."""
    if memory is None or memory.parallel != "torchrec" or memory.world_size != request.world_size:
        return False
    return sorted((t.name, t.rows, t.dim) for t in memory.tables) == sorted(
        (t.name, t.rows, t.dim) for t in request.shape.tables) and all(t.shards for t in memory.tables)


def agreed_plan(request: PlanRequest, saved: Optional[MemoryPlan], rank: int) -> tuple[MemoryPlan, bool]:
    """The plan every rank shards by: `saved` where it fits the request, else rank 0's new plan (collective);
    and whether it is new."""
    if fits(saved, request):
        assert saved is not None
        return saved, False
    made = plan_tables(request)[1].to_json() if rank == 0 else None
    return MemoryPlan.from_json(collectives.all_gather_objects(made)[0]), True


class ShardedModel:
    """`model` (its tables a `TableBags` on the meta device) sharded over the ranks by `memory`."""

    def __init__(self, model: nn.Module, memory: MemoryPlan, device: torch.device, table_optimizer: str,
                 lr: float, seed: int = 0) -> None:
        from torchrec.distributed import DistributedModelParallel
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        path, tables = tables_of(model)
        fuse_table_optimizer(tables.bags, table_optimizer, lr)
        self.memory = memory
        prefix = f"{path}.bags" if path else "bags"
        self.table_keys = {f"{prefix}.embedding_bags.{t.name}.weight" for t in memory.tables}
        self.wrapped = DistributedModelParallel(model, device=device, plan=sharding_plan(memory, path, device),
                                                sharders=[EmbeddingBagCollectionSharder()])
        self.model: nn.Module = self.wrapped.module  # the model itself, its tables sharded: eval and the digest
        table_ids = {id(p) for name, p in self.wrapped.named_parameters() if _plain(name) in self.table_keys}
        self.dense_parameters = [p for p in self.wrapped.parameters() if id(p) not in table_ids]
        self._init_tables(seed, tables.init_std)

    def _init_tables(self, seed: int, std: float) -> None:
        """Every table's values, drawn uniformly with `std` in blocks of `INIT_BLOCK` rows, each block from a
        generator seeded by (seed, table, block): a shard takes its rows and columns of them, so the tables
        start the same under any plan and world size (TorchRec's own init draws each shard from its rank's
        stream)."""
        bound = 3**0.5 * std
        names = sorted(t.name for t in self.memory.tables)
        with torch.no_grad():
            for key, value in self._state().items():
                if key not in self.table_keys:
                    continue
                number = names.index(key.split(".")[-2])
                for shard in value.local_shards():
                    (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    for first in range(row - row % INIT_BLOCK, row + rows, INIT_BLOCK):
                        block = first // INIT_BLOCK
                        generator = torch.Generator().manual_seed(((seed * 1_000_003 + number) * 1_000_003 + block)
                                                                  % 2**63)
                        values = torch.rand(INIT_BLOCK, value.size(1), generator=generator) * (2 * bound) - bound
                        low, high = max(first, row), min(first + INIT_BLOCK, row + rows)
                        shard.tensor[low - row:high - row].copy_(values[low - first:high - first, col:col + cols])

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The model's dense parameters and buffers (every rank holds the same): the shared state's model."""
        return {name: value for name, value in self._state().items() if name not in self.table_keys}

    def load_dense_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load the dense part saved by `dense_state` (the tables stay as they are)."""
        missing = set(self.dense_state()) - set(state)
        if missing:
            raise KeyError(f"the checkpoint lacks the dense parameters {sorted(missing)}")
        with torch.no_grad():
            for name, value in self.dense_state().items():
                value.copy_(state[name])

    def sharded_state(self) -> dict[str, Any]:
        """The tables (ShardedTensors) and the fused optimizer's state, as torch.distributed.checkpoint saves
        them from every rank and loads them into this plan, whatever the plan that saved them."""
        tables = {name: value for name, value in self._state().items() if name in self.table_keys}
        return {"tables": tables, "table_optimizer": self.wrapped.fused_optimizer.state_dict()}

    def load_sharded_state(self, state: dict[str, Any]) -> None:
        """Take in what `torch.distributed.checkpoint.load` filled into a `sharded_state()`."""
        self.wrapped.fused_optimizer.load_state_dict(state["table_optimizer"])

    def _state(self) -> dict[str, Any]:
        return {_plain(name): value for name, value in self.wrapped.state_dict().items()}

    def table_digest(self) -> str:
        """sha256 over the logical tables, by name, each gathered whole to rank 0 in turn (collective): the same
        for the same values under any plan. Empty on the other ranks."""
        digest = hashlib.sha256()
        rank = collectives.rank_and_world()[0]
        for name, full in self.whole_tables():
            if rank == 0:
                digest.update(name.encode())  # the table's name, whatever module holds it
                digest.update(full.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest() if rank == 0 else ""

    def whole_tables(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective: (table name, the whole table) for each table in name order, gathered to rank 0 one table
        at a time (an empty tensor on the other ranks)."""
        rank = collectives.rank_and_world()[0]
        state = self._state()
        for name in sorted(self.table_keys):
            sharded = state[name]
            full = torch.empty(sharded.size(), dtype=sharded.dtype) if rank == 0 else None
            sharded.gather(dst=0, out=full)
            yield name.split(".")[-2], full if full is not None else torch.empty(0)


def _plain(name: str) -> str:
    """A state-dict or parameter name without its wrappers' prefixes (DistributedModelParallel's
    `_dmp_wrapped_module.`, DDP's `module.`)."""
    for prefix in ("_dmp_wrapped_module.", "module."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name
