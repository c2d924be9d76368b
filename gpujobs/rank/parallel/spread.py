"""How the trainer's model is spread over the ranks (`parallel=`): one interface, two ways.

`Replicated` (`parallel=ddp`): every rank holds the whole model, DistributedDataParallel averages the
gradients. `Sharded` (`parallel=torchrec`): TorchRec shards the tables (`ShardedModel`), the rest is
data-parallel. The trainer asks a `Spread` for the model it steps and the one it evaluates, the parameters its
optimizer trains, the state it saves (shared by rank 0, and sharded by every rank) and the digest; it never
asks which way the model is spread.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gpujobs.backends.jobenv import DistInfo
from gpujobs.config.load import JobConfig
from gpujobs.rank import collectives
from gpujobs.rank.checkpoint_sharded import SHARDED_DIR, load_sharded
from gpujobs.rank.compute_clock import ComputeClock
from gpujobs.rank.metrics import param_digest, state_digest
from gpujobs.rank.step_settings import step_setting
from gpujobs.rundir import PLAN_FILE
from gpujobs.rundir.plan import model_shape, plan_request, read_plan, write_plan

log = logging.getLogger(__name__)


class Replicated:
    """parallel=ddp: the whole model on every rank, in DDP's wrapper within a process group (timed by the
    compute clock where `clock` is given)."""

    replicated = True
    sharded_state: Optional[Callable[[], dict[str, Any]]] = None

    def __init__(self, model: nn.Module, device: torch.device, clock: Optional[ComputeClock]) -> None:
        self.model = model.to(device)
        self.wrapped: nn.Module = self.model
        if dist.is_initialized():
            ids = [device.index] if device.type == "cuda" else None
            ddp = DistributedDataParallel(self.model, device_ids=ids,
                                          gradient_as_bucket_view=step_setting("gradient_as_bucket_view"),
                                          static_graph=step_setting("static_graph"))
            if clock is not None:
                clock.install(ddp)
            self.wrapped = ddp

    def trained_parameters(self) -> list[nn.Parameter]:
        """What the optimizer steps and the gradient clip measures: every parameter."""
        return list(self.model.parameters())

    def no_sync(self) -> AbstractContextManager[Any]:
        """Gradients kept local for a micro-step that is not the last."""
        if isinstance(self.wrapped, DistributedDataParallel):
            return self.wrapped.no_sync()
        return nullcontext()

    def model_state(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_model_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state)

    def load_sharded(self, path: Path) -> None:
        """Nothing is sharded."""

    def digest(self) -> str:
        return param_digest(self.model)


class Sharded:
    """parallel=torchrec: the task's model (its tables a `TableBags` on the meta device) sharded by the plan the
    ranks agree on: the run dir's plan.json (or `parallel.plan`) where it was made for this world size and these
    tables, else a new one, which rank 0 keeps as plan.json."""

    replicated = False

    def __init__(self, job: JobConfig, info: DistInfo, model: nn.Module, device: torch.device, run_dir: Path) -> None:
        from gpujobs.rank.parallel.sharded import ShardedModel, agreed_plan

        shape = model_shape(job)
        if shape is None:
            raise ValueError("parallel=torchrec needs a model config that describes its tables (shape(features))")
        # on its node, a rank reads the node's memory where the config names none
        request = plan_request(job, shape, here=True, nodes=max(1, info.world_size // job.resources.ranks_per_node))
        chosen = Path(job.parallel.plan) if job.parallel.plan else run_dir / PLAN_FILE
        memory, new = agreed_plan(request, read_plan(chosen), info.rank)
        if job.parallel.plan and new:
            raise ValueError(f"parallel.plan={job.parallel.plan} was not made for {info.world_size} ranks and "
                             "these tables: make it again with gpujobs plan --out, or leave parallel.plan unset")
        if new and info.is_main:
            write_plan(run_dir, memory)
            log.info("tables sharded by a new plan for %d ranks (kept as %s)", info.world_size, run_dir / PLAN_FILE)
        self.sharded_model = ShardedModel(model, memory, device, str(job.optim.table_optimizer), job.optim.lr,
                                          seed=job.trainer.seed % 2**63)
        self.model = self.sharded_model.model
        self.wrapped = self.sharded_model.wrapped
        self.sharded_state = self.sharded_model.sharded_state

    def trained_parameters(self) -> list[nn.Parameter]:
        """The dense part's parameters: the tables are trained by their fused optimizer, in their backward."""
        return list(self.sharded_model.dense_parameters)

    def no_sync(self) -> AbstractContextManager[Any]:
        return nullcontext()  # one micro-batch a step (the submit side refuses trainer.grad_accum > 1)

    def model_state(self) -> dict[str, Any]:
        return self.sharded_model.dense_state()

    def load_model_state(self, state: dict[str, Any]) -> None:
        self.sharded_model.load_dense_state(state)

    def load_sharded(self, path: Path) -> None:
        """Collective: the tables and their optimizer's state from the checkpoint at `path`, resharded to this
        plan where another saved them."""
        state = self.sharded_model.sharded_state()
        load_sharded(state, path / SHARDED_DIR)
        self.sharded_model.load_sharded_state(state)

    def digest(self) -> str:
        """sha256 over the dense part's digest and the logical tables' (collective; the same under any plan,
        on every rank)."""
        tables = self.sharded_model.table_digest()  # made on rank 0, which gathers the tables
        digest = hashlib.sha256(state_digest(self.sharded_model.dense_state()).encode())
        digest.update(tables.encode())
        result: str = collectives.all_gather_objects(digest.hexdigest())[0]
        return result


def spread(job: JobConfig, info: DistInfo, model: nn.Module, device: torch.device, clock: Optional[ComputeClock],
           run_dir: Path) -> Replicated | Sharded:
    """The model spread over the ranks as `parallel` says."""
    if job.parallel.name == "torchrec":
        return Sharded(job, info, model, device, run_dir)
    return Replicated(model, device, clock)
