"""The background half of `CheckpointManager.save_async`: host snapshots, the save's thread, its groups.

A background save runs the same write-fsync-agree-publish sequence as a synchronous one (it is the
same code, `CheckpointManager._write_and_agree`), on a thread, from a snapshot of the state in host
memory: training mutates the parameters in place right after the snapshot is taken.

Two dedicated gloo groups keep the thread's collectives out of the way of the training loop's:

* `agreement`, used by the save's thread only (the all-gathers of the reports and of the outcome);
* `flags`, used by the main thread only (`poll`'s tiny all-reduce of the ranks' done flags).

Why two and not one: collectives on one group must be issued in the same order on every rank. If the
main thread's poll shared the thread's group, rank 0 could issue its poll's all-reduce while rank 1's
thread issues its report gather on the same group, and the two would be matched with each other.
Why not the training group for the flags: it may be NCCL-only (a CPU flag would then cost a host sync
of a CUDA tensor at every step), and DDP's collectives are the ones to keep free of checkpoint work.
"""

from __future__ import annotations

import copy
import datetime
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from gpujobs.rank import collectives

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ snapshots
_Key = tuple[torch.Size, torch.dtype, bool]


class HostBuffers:
    """Host memory for snapshots, kept from one save to the next.

    A snapshot of a large state into fresh memory costs mostly page faults (or cudaHostAlloc), not the
    copy: half a second for 1 GB on a small VM, 0.2x the whole synchronous save. The tensors of the
    last snapshot, once its save is over, become the next snapshot's buffers, so a steady run copies
    into memory already mapped. The price is one host copy of the state kept between saves.
    """

    def __init__(self) -> None:
        self._free: dict[_Key, list[torch.Tensor]] = {}

    def snapshot(self, state: Any) -> Any:
        """A copy of `state` in host memory that nothing else references.

        Every tensor is copied: a CUDA tensor into pinned host memory (an asynchronous copy, then
        one `torch.cuda.synchronize()` for all of them), a CPU tensor into host memory. Dicts
        (including a state_dict's OrderedDict and its `_metadata`), lists and tuples are rebuilt
        around the copies; other values are deep-copied (they are small: steps, configs, positions).
        """
        copied_from_cuda: list[bool] = []
        try:
            snapshot = self._copy(state, copied_from_cuda)
            if copied_from_cuda:
                torch.cuda.synchronize()  # the non-blocking copies are done once this returns
        finally:
            self._free.clear()  # buffers this snapshot did not take fit no tensor of the state now
        return snapshot

    def recycle(self, snapshot: Any) -> None:
        """Once the save of `snapshot` is over: its tensors are the next snapshot's buffers."""
        for tensor in _tensors(snapshot):
            self._free.setdefault((tensor.shape, tensor.dtype, tensor.is_pinned()), []).append(tensor)

    def _copy(self, obj: Any, copied_from_cuda: list[bool]) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj.detach(), copied_from_cuda)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # same type and instance attributes (a state_dict's `_metadata`)
            for key, value in obj.items():
                out[key] = self._copy(value, copied_from_cuda)
            return out
        if isinstance(obj, list):
            return [self._copy(value, copied_from_cuda) for value in obj]
        if type(obj) is tuple:
            return tuple(self._copy(value, copied_from_cuda) for value in obj)
        return copy.deepcopy(obj)

    def _copy_tensor(self, tensor: torch.Tensor, copied_from_cuda: list[bool]) -> torch.Tensor:
        if tensor.layout != torch.strided or tensor.device.type not in ("cpu", "cuda"):
            return tensor.to("cpu", copy=True)  # sparse, or another device: a plain synchronous copy
        pinned = tensor.is_cuda  # pinned memory lets the device copy run as DMA, asynchronously
        free = self._free.get((tensor.shape, tensor.dtype, pinned))
        host = free.pop() if free else torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        host.copy_(tensor, non_blocking=pinned)
        if pinned:
            copied_from_cuda.append(True)
        return host


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of a snapshot (as `HostBuffers.snapshot` builds them), in no particular order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return [tensor for value in values for tensor in _tensors(value)]


# ------------------------------------------------------------------ groups
@dataclass(frozen=True)
class SaveGroups:
    """The dedicated gloo groups of background saves (None, None without a process group)."""

    agreement: Optional[dist.ProcessGroup]
    """Used only by the save's thread."""
    flags: Optional[dist.ProcessGroup]
    """Used only by the main thread (`poll`)."""

    @classmethod
    def create(cls) -> SaveGroups:
        """Collective over the training group: every rank at the same point, from the main thread."""
        if not collectives.active():
            return cls(None, None)
        timeout = _training_group_timeout()
        return cls(dist.new_group(backend="gloo", timeout=timeout), dist.new_group(backend="gloo", timeout=timeout))


def _training_group_timeout() -> Optional[datetime.timedelta]:
    """The training group's timeout, so a dead rank ends a background save as soon as it ends training.

    torch has no public getter; the backend's options carry it. None (torch's default) if they do not.
    """
    world = dist.group.WORLD
    for device_type in sorted(collectives.served_device_types(world)):
        try:
            timeout = world._get_backend(torch.device(device_type)).options._timeout  # type: ignore[union-attr]
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


# ------------------------------------------------------------------ the save in flight
class InFlight:
    """One save running on its own thread; whatever it ends with (a path or any exception) is kept
    as its outcome and handed to whoever asks, never lost."""

    def __init__(
        self, step: int, work: Callable[[], Path], expected: tuple[type[Exception], ...] = (), snapshot: Any = None
    ) -> None:
        self.step = step
        self.snapshot = snapshot
        """The host copy the thread writes (for `HostBuffers.recycle` once it is over)."""
        self._expected = expected  # failures the caller reports itself; anything else is logged at once too
        self._outcome: Path | BaseException | None = None
        self._done = threading.Event()
        # A daemon: a process that exits without `CheckpointManager.close()` is not held up by a
        # save whose peers are gone; its temp dir is swept by the next save, as after a kill.
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Path]) -> None:
        try:
            self._outcome = work()
        except BaseException as err:  # any failure is this save's outcome, never lost
            if not isinstance(err, self._expected):
                log.error("background checkpoint of step %d failed: %r", self.step, err)
            self._outcome = err
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        """Whether this rank's part of the save is over (its outcome is known)."""
        return self._done.is_set()

    def result(self) -> Path:
        """Block until the thread is over; its path, or its exception raised here."""
        self._thread.join()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        assert self._outcome is not None  # the thread always sets one of the two
        return self._outcome
