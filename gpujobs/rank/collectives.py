"""Every collective of gpujobs goes through here, on a device the process group's backend serves.

A group made with `backend="nccl"` serves CUDA tensors only: a CPU tensor handed to it fails with "No
backend type associated with device type cpu". gpujobs therefore makes its group device-aware on CUDA
(`cpu:gloo,cuda:nccl`, see `distributed.backend_for`): DDP's gradient buckets, on the GPU, go to NCCL,
and the small host-side collectives (timing, flags, checkpoint agreement) go to gloo without a
device copy or a stream sync. These helpers still put each tensor on `collective_device(group)`, so a
group that serves CUDA only (a user's `nccl` group, say) works too. No call site builds its own.

Without a process group (one rank) every helper answers for this rank alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

T = TypeVar("T")


def active() -> bool:
    """Whether this process is in a process group."""
    return dist.is_available() and dist.is_initialized()


def served_device_types(group: Optional[dist.ProcessGroup] = None) -> set[str]:
    """The device types (`cpu`, `cuda`) that `group`'s backends take tensors on."""
    pg = group if group is not None else dist.group.WORLD
    return {device.type for device in pg._device_types}  # type: ignore[union-attr]


def collective_device_type(group: Optional[dist.ProcessGroup] = None) -> str:
    """`cpu` when a backend of `group` serves the CPU (no copy, no stream sync), else `cuda`."""
    return "cpu" if "cpu" in served_device_types(group) else "cuda"


def collective_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """Where a small host-side tensor must be for a collective of `group`: the CPU when a backend of
    the group serves it, else this rank's current CUDA device (set by `distributed.init_process_group`)."""
    if collective_device_type(group) == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _reduce(values: torch.Tensor, op: Any, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    if not active():
        return values
    placed = values.to(collective_device(group))
    dist.all_reduce(placed, op=op, group=group)
    return placed.cpu()


class Pending(Generic[T]):
    """A collective started without waiting for it: the caller goes on (the next step's compute, say)
    while the backend's thread exchanges the values; `wait` gives the answer, waiting only if the
    collective has not finished by then. Every rank must start the same collectives in the same order."""

    def __init__(self, work: Optional[dist.Work], answer: Callable[[], T]) -> None:
        self._work = work
        self._answer = answer

    def wait(self) -> T:
        """The collective's answer (the same on every rank); blocks until every rank has taken part."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._answer()


def start_any_true(flag: bool) -> Pending[bool]:
    """`any_true`, started: its `wait()` is True on every rank once any rank said true."""
    values = torch.tensor([int(flag)], dtype=torch.int32)
    if not active():
        return Pending(None, lambda: bool(values.item()))
    placed = values.to(collective_device())
    work = dist.all_reduce(placed, op=dist.ReduceOp.MAX, async_op=True)
    return Pending(work, lambda: bool(placed.cpu().item()))


def any_true(flag: bool) -> bool:
    """True on every rank once any rank says true (one tiny all-reduce)."""
    return start_any_true(flag).wait()


def all_true(flag: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True on every rank only when every rank says true (one tiny all-reduce, on `group` if given)."""
    return bool(_reduce(torch.tensor([int(flag)], dtype=torch.int32), dist.ReduceOp.MIN, group).item())


def sum_across(values: torch.Tensor) -> torch.Tensor:
    """`values` summed over the ranks, on the CPU (one all-reduce, on the device the group serves: a
    large CPU tensor, such as the eval's histograms, goes to gloo on a device-aware group and to the GPU
    on a CUDA-only one); `values` may hold the sum afterwards. Without a group, `values` itself."""
    return _reduce(values, dist.ReduceOp.SUM)


def rank_and_world() -> tuple[int, int]:
    """This process's rank in the group and the group's size; (0, 1) without a group."""
    if not active():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def sum_in_place(tensor: torch.Tensor) -> None:
    """Sum a large `tensor` over the ranks, in place on its own device (the health check's bandwidth
    probe times exactly this: a copy to another device would be timed with it). The group must serve
    that device type (a CUDA tensor: NCCL; a CPU tensor: gloo)."""
    if not active():
        return
    if tensor.device.type not in served_device_types():
        raise ValueError(f"the process group serves {sorted(served_device_types())} tensors, not {tensor.device.type}")
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def start_all_gather_rows(row: torch.Tensor) -> Pending[torch.Tensor]:
    """`all_gather_rows`, started: its `wait()` is the table. `row` must not change until then."""
    if not active():
        return Pending(None, lambda: row.unsqueeze(0))
    placed = row.to(collective_device())
    gathered = [torch.zeros_like(placed) for _ in range(dist.get_world_size())]
    work = dist.all_gather(gathered, placed, async_op=True)
    return Pending(work, lambda: torch.stack(gathered).cpu())


def all_gather_rows(row: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D `row`, stacked in rank order on the CPU (shape: world size x len(row))."""
    return start_all_gather_rows(row).wait()


def all_gather_objects(obj: Any, group: Optional[dist.ProcessGroup] = None) -> list[Any]:
    """Every rank's picklable `obj`, in rank order (of `group` if given)."""
    if not active():
        return [obj]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone


def barrier() -> None:
    """Wait until every rank is here."""
    if not active():
        return
    device = collective_device()
    if device.type == "cpu":
        dist.barrier()  # torch sends it to the CPU backend when the group has one
    else:
        # Without device_ids torch guesses the GPU (rank % device count) and warns; a wrong guess
        # makes NCCL build a second communicator on another rank's GPU, or hang.
        dist.barrier(device_ids=[device.index])


def average_gradient_bucket(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's own gradient all-reduce of one bucket (divide by the world size, sum), for a communication
    hook that also does something else (`compute_clock`). The bucket lives on the model's device, which
    DDP's group serves."""
    return default_hooks.allreduce_hook(dist.group.WORLD, bucket)  # type: ignore[arg-type]
