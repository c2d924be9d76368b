"""The memory plan of a job (torch-free): what each rank holds, and whether that fits the memory it has.

A request (`PlanRequest`) says what the model is (`ModelShape`), over how many nodes and ranks it runs, how
much memory a GPU and a node have, and how the tables may be sharded. Under `parallel=ddp` the plan is
arithmetic here (`replicated_plan`: every rank holds every parameter, its gradient and its optimizer state).
Under `parallel=torchrec` TorchRec's planner makes it on the rank side (`gpujobs.rank.parallel.plan`, run in
a child process by the submit side, which never imports torch); both answer with a `MemoryPlan`, kept in the
run dir as plan.json and printed by `gpujobs plan`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from gpujobs.config.model_shape import FP32_BYTES, ModelShape, Table

GIB = 1024**3
#: fp32 values of optimizer state per parameter, by dense optimizer (`optim.name`): Adam keeps two moments.
DENSE_STATE = {"adam": 2, "adamw": 2, "sgd": 1}


def table_state_values(optimizer: str, table: Table) -> int:
    """fp32 values of a fused table optimizer's state for `table` (`optim.table_optimizer`)."""
    if optimizer == "adam":
        return 2 * table.parameters
    if optimizer == "rowwise_adagrad":
        return table.rows
    return 0


@dataclass(frozen=True)
class PlanRequest:
    """What a memory plan is made for. Memory is in bytes; None where it is not known."""

    shape: ModelShape
    nodes: int
    ranks_per_node: int
    device: str
    """"cuda" for GPU ranks, "cpu" for CPU ranks (gloo)."""
    gpu_mem: Optional[int]
    host_mem: Optional[int]
    """A node's, shared by its ranks."""
    parallel: str
    dense_optimizer: str
    table_optimizer: str
    batch_per_rank: int
    sharding_types: Optional[tuple[str, ...]] = None
    compute_kernels: tuple[str, ...] = ("fused",)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def dense_bytes(self) -> int:
        """What every rank holds of the dense part, under either mode: parameters, gradients, optimizer state."""
        return self.shape.dense_parameters * FP32_BYTES * (2 + DENSE_STATE.get(self.dense_optimizer, 2))

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        payload["shape"] = {"tables": [asdict(t) for t in self.shape.tables],
                            "dense_parameters": self.shape.dense_parameters}
        return payload

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> PlanRequest:
        shape = ModelShape(tuple(Table(**t) for t in payload["shape"]["tables"]),
                           int(payload["shape"]["dense_parameters"]))
        rest = {k: v for k, v in payload.items() if k != "shape"}
        for key in ("sharding_types", "compute_kernels"):
            if rest.get(key) is not None:
                rest[key] = tuple(rest[key])
        return cls(shape=shape, **rest)


@dataclass(frozen=True)
class TablePlacement:
    """Where one table lives: its sharding type, compute kernel, and its bytes on each rank that holds a part."""

    name: str
    rows: int
    dim: int
    sharding_type: str
    compute_kernel: str
    bytes_by_rank: dict[int, int]
    shards: tuple[tuple[int, int, int, int, int], ...] = ()
    """Each shard as (rank, first row, first column, rows, columns): enough to shard the same way again
    (`parallel.plan`)."""

    @property
    def ranks(self) -> list[int]:
        return sorted(self.bytes_by_rank)


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds: in its GPU's memory and in its node's host memory (CPU ranks: host only)."""

    rank: int
    gpu: int
    host: int


@dataclass(frozen=True)
class MemoryPlan:
    """A plan that fits: per table where it lives, per rank what it holds, and the memory it was made for."""

    parallel: str
    world_size: int
    ranks_per_node: int
    device: str
    gpu_mem: Optional[int]
    host_mem: Optional[int]
    tables: tuple[TablePlacement, ...]
    ranks: tuple[RankBytes, ...]
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        payload = asdict(self)
        for table in payload["tables"]:
            table["bytes_by_rank"] = {str(rank): size for rank, size in table["bytes_by_rank"].items()}
        return payload

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> MemoryPlan:
        tables = tuple(TablePlacement(**{
            **t, "bytes_by_rank": {int(r): int(b) for r, b in t["bytes_by_rank"].items()},
            "shards": tuple(tuple(int(v) for v in shard) for shard in t.get("shards", ()))}) for t in payload["tables"])
        ranks = tuple(RankBytes(**r) for r in payload["ranks"])
        rest = {k: v for k, v in payload.items() if k not in ("tables", "ranks", "notes")}
        return cls(tables=tables, ranks=ranks, notes=tuple(payload.get("notes", ())), **rest)

    def render(self) -> str:
        """The plan as `gpujobs plan` prints it: a line per table, then a line per rank."""
        lines = [f"memory plan: parallel={self.parallel}, {self.world_size} ranks ({self.ranks_per_node} a node, "
                 f"{self.device}); a GPU {_size(self.gpu_mem)}, a node's host memory {_size(self.host_mem)}"]
        width = max([len(t.name) for t in self.tables] + [5])
        if self.parallel == "ddp":  # every table alike: on every rank
            each = sum(t.bytes_by_rank.get(0, 0) for t in self.tables)
            lines.append(f"  {len(self.tables)} tables on every rank: {_size(each)} a rank with their gradients and "
                         "optimizer state")
        else:
            lines.append(f"  {'table':<{width}}  {'rows x dim':>16}  {'sharding':<17}  {'kernel':<17}  {'bytes':>9}  "
                         "ranks")
        for table in self.tables if self.parallel != "ddp" else ():
            lines.append(f"  {table.name:<{width}}  {f'{table.rows} x {table.dim}':>16}  {table.sharding_type:<17}  "
                         f"{table.compute_kernel:<17}  {_size(sum(table.bytes_by_rank.values())):>9}  "
                         f"{_ranks(table.ranks)}")
        lines.append(f"  {'rank':>4}  {'GPU':>9}  {'host':>9}")
        lines += [f"  {r.rank:>4}  {_size(r.gpu):>9}  {_size(r.host):>9}" for r in self.ranks]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def _size(count: Optional[int]) -> str:
    if count is None:
        return "unknown"
    return f"{count / GIB:.2f} GiB" if count >= GIB // 10 else f"{count / 1024**2:.1f} MiB"


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def replicated_plan(request: PlanRequest) -> MemoryPlan:
    """The plan of `parallel=ddp`: each rank holds every table and the dense part, with gradients and the dense
    optimizer's state (DDP trains the tables with it too)."""
    values = 2 + DENSE_STATE.get(request.dense_optimizer, 2)
    tables = tuple(TablePlacement(t.name, t.rows, t.dim, "replicated", "dense",
                                  dict.fromkeys(range(request.world_size), t.parameters * FP32_BYTES * values))
                   for t in request.shape.tables)
    each = request.shape.parameters * FP32_BYTES * values
    on_gpu = request.device == "cuda"
    ranks = tuple(RankBytes(rank, each if on_gpu else 0, 0 if on_gpu else each) for rank in range(request.world_size))
    return MemoryPlan("ddp", request.world_size, request.ranks_per_node, request.device, request.gpu_mem,
                      request.host_mem, tables, ranks)


def sharded_estimate(request: PlanRequest) -> int:
    """About what a rank holds with the tables spread evenly over all ranks (their fused optimizer's state
    too) and the dense part replicated: the hint that `parallel=torchrec` would fit."""
    tables = sum(t.parameters + table_state_values(request.table_optimizer, t) for t in request.shape.tables)
    return math.ceil(tables * FP32_BYTES / request.world_size) + request.dense_bytes()


class DoesNotFit(Exception):
    """The model does not fit: `key` is what to change, `why` the needed and available bytes."""

    def __init__(self, key: str, value: Any, why: str) -> None:
        super().__init__(f"{key}={value!r}: {why}")
        self.key, self.value, self.why = key, value, why


def check_replicated(request: PlanRequest) -> None:
    """DoesNotFit when a replicated model does not fit: on a GPU, one rank's bytes against a GPU's memory;
    CPU ranks, the node's ranks together against its host memory. Unknown memory is not checked."""
    plan = replicated_plan(request)
    each = max(r.gpu + r.host for r in plan.ranks)
    if request.device == "cuda":
        need, have, what = each, request.gpu_mem, "of a GPU's memory (resources.gpu_mem_gib)"
    else:
        need, have, what = each * request.ranks_per_node, request.host_mem, \
            f"of a node's host memory (resources.host_mem_gib), {request.ranks_per_node} ranks a node"
    if have is None or need <= have:
        return
    hint = ""
    sharded = sharded_estimate(request)
    room = have if request.device == "cuda" else have // request.ranks_per_node
    if sharded <= room:
        hint = f"; parallel=torchrec would fit (about {_size(sharded)} a rank, the tables sharded)"
    raise DoesNotFit("parallel", "ddp", f"every rank holds the whole model: {_size(each)} a rank (parameters, "
                     f"gradients, optimizer state of {request.shape.parameters} parameters) needs {_size(need)} "
                     f"{what}, {_size(have)} there{hint}")
