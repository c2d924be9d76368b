"""The checkpointer of a run: when to save, in the background or not; resume from the newest agreed step.

The train loop reports each step boundary (`maybe_save`, torchtitan's `_should_save`): the manager
saves every `checkpoint.every_steps` steps and at the last step, and at a stop the ranks agreed on;
that one, and the last, synchronously. What a save and a resume do on disk, agreed by every rank, is
`checkpoint_dir.CheckpointDir`; one file with its checksum is `checkpoint_files`; the marker that
publishes a step is `gpujobs.rundir.marker`, which the submit side reads too.

A periodic save can run in the background (`save_async`, `checkpoint.async=true`): it blocks the
caller only while the state is copied to host memory; the write, the agreement and the publishing run
on a thread with dedicated gloo groups (`checkpoint_async`), at most one save in flight, and its
outcome, the same on every rank, comes from `poll` at a step boundary that all ranks share.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from gpujobs.rank import collectives
from gpujobs.rank.checkpoint_async import HostBuffers, InFlight, SaveGroups
from gpujobs.rank.checkpoint_dir import SHARED_FILE, CheckpointDir, CheckpointNotSaved, Loaded
from gpujobs.rundir.marker import SavedRun

log = logging.getLogger(__name__)

__all__ = ["SHARED_FILE", "CheckpointManager", "CheckpointNotSaved", "Checkpointed", "Loaded", "SaveTaken"]


@dataclass(frozen=True)
class Checkpointed:
    """What `maybe_save` saves, asked for only when a save is due."""

    shared: Callable[[], dict[str, Any]]
    """What every rank shares (model, optimizer, ...): written once, by rank 0."""
    own: Callable[[], dict[str, Any]]
    """This rank's own state (its random streams)."""
    run: Callable[[], SavedRun]
    """What the marker says of the run."""
    last_step: int
    """The run's last step: always saved, synchronously."""
    sharded: Optional[Callable[[], dict[str, Any]]] = None
    """State every rank holds a part of (parallel=torchrec's tables), saved by every rank through DCP: its
    saves are synchronous (the submit side refuses checkpoint.async with it)."""


@dataclass(frozen=True)
class SaveTaken:
    """A save that `maybe_save` made (or started, in the background), for the metrics."""

    step: int
    background: bool
    blocking_s: float
    """Seconds it held up the train loop."""


class CheckpointManager:
    """Owns the save policy and the on-disk format; the train loop only reports its step (`maybe_save`)."""

    def __init__(
        self,
        directory: Path,
        every_steps: int,
        keep: int,
        rank: int = 0,
        *,
        world_size: Optional[int] = None,
        background: bool = False,
    ) -> None:
        """`world_size` defaults to the process group's (1 without one): a default of 1 in a bigger
        group would take every same-size resume for an elastic one. `background` (the run saves in
        the background) makes the constructor collective: it creates the background saves' groups
        now, on every rank at the same point, rather than at the first `save_async`."""
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.keep = keep
        self.rank = rank
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if collectives.active() else 1
        )
        self.background = background
        self.last_blocking_s = 0.0
        """Seconds the last `save` / `save_async` blocked its caller (for metrics.jsonl)."""
        self.published: Optional[Path] = None
        """The newest checkpoint this run published (or resumed from)."""
        self.saved_step = -1
        """The step of the last save made or started (or resumed from): the same on every rank."""
        self.files = CheckpointDir(self.directory, keep, rank, self.world_size)
        self._source: Optional[Checkpointed] = None
        self._flight: Optional[InFlight] = None
        self._buffers = HostBuffers()
        self._groups: Optional[SaveGroups] = SaveGroups.create() if background else None

    # ------------------------------------------------------------------ policy
    def track(self, source: Checkpointed) -> None:
        """What `maybe_save` saves from now on."""
        self._source = source

    def should_save(self, step: int, last_step: int) -> bool:
        """Every `every_steps` steps, and always at the last step."""
        return step == last_step or (self.every_steps > 0 and step % self.every_steps == 0)

    def maybe_save(self, step: int, *, stop: bool = False) -> Optional[SaveTaken]:
        """At every step boundary, on every rank alike (`stop`: the ranks agreed to stop after `step`).

        Takes the outcome of a background save that is over, then saves the tracked state when due:
        every `every_steps` steps and at the last step, and at a stop. The save of a stop or of the last
        step is synchronous (the requeue and the result wait for it); a periodic one runs in the
        background with `background`. Returns what it cost the caller, or None when none was due;
        CheckpointNotSaved on every rank when a save (this one, or the one in flight) failed.
        """
        if stop:
            self.wait()  # a stop's checkpoint is published when this returns, even one started at this step
        elif self._flight is not None:
            self.poll()
        source = self._source
        if source is None or step == self.saved_step or not (stop or self.should_save(step, source.last_step)):
            return None
        background = self.background and not stop and step < source.last_step and source.sharded is None
        if background:
            self.save_async(step, source.shared, source.own(), source.run())
        else:
            self.save(step, source.shared, source.own(), source.run(), source.sharded)
        return SaveTaken(step, background, self.last_blocking_s)

    # ------------------------------------------------------------------ reading
    def complete_steps(self) -> list[int]:
        """Steps with a marker (not yet verified), oldest first."""
        return self.files.complete_steps()

    def path_for(self, step: int) -> Path:
        """Directory of the checkpoint of `step`."""
        return self.files.path_for(step)

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[Optional[Loaded], list[dict[str, Any]]]:
        """Collective: the newest checkpoint that verifies on every rank (from which the run goes on), and
        the newer steps skipped ({"step", "why"} each); the same on every rank."""
        found, skipped = self.files.load_latest(map_location)
        if found is not None:
            self.published, self.saved_step = Path(found.path), found.step
        return found, skipped

    # ------------------------------------------------------------------ writing
    def save(
        self,
        step: int,
        shared: Callable[[], dict[str, Any]],
        own: dict[str, Any],
        run: Optional[SavedRun] = None,
        sharded: Optional[Callable[[], dict[str, Any]]] = None,
    ) -> Path:
        """Collective save: every rank writes its file (and its shards of `sharded()`), rank 0 also `shared()`,
        and rank 0 publishes only when every rank's files are durable, with `run` in the marker. Returns the
        checkpoint's path on every rank, or raises CheckpointNotSaved on every rank (nothing published, nothing
        pruned).

        A background save in flight is waited for first (`wait`, raising its failure): a save at a
        preemption or at the end is synchronous and comes after the one in flight."""
        start = time.perf_counter()
        try:
            self.wait()
            self.published = self.files.write_and_agree(step, shared, lambda: own, run or SavedRun(), None, sharded)
            self.saved_step = step
            return self.published
        finally:
            self.last_blocking_s = time.perf_counter() - start

    def save_async(
        self,
        step: int,
        shared: Callable[[], dict[str, Any]],
        own: dict[str, Any],
        run: Optional[SavedRun] = None,
    ) -> None:
        """Collective, every rank at the same step: waits for the save in flight (raising its failure
        as `save` would), copies `shared()` (rank 0) and `own` to host memory, and returns; a thread
        then does what `save` does. Its outcome comes from `poll` or `wait`, the same on every rank."""
        start = time.perf_counter()
        self.wait()
        if self._groups is None:
            self._groups = SaveGroups.create()  # collective: every rank's first save_async is at the same step
        parts, shared_now, own_now = self._snapshot(shared, own)
        run_now, group = copy.deepcopy(run or SavedRun()), self._groups.agreement  # the plan history grows on
        work = lambda: self.files.write_and_agree(step, shared_now, own_now, run_now, group)  # noqa: E731
        self._flight = InFlight(step, work, (CheckpointNotSaved,), parts)
        self.saved_step = step
        self.last_blocking_s = time.perf_counter() - start

    def _snapshot(
        self, shared: Callable[[], dict[str, Any]], own: dict[str, Any]
    ) -> tuple[Any, Callable[[], dict[str, Any]], Callable[[], dict[str, Any]]]:
        """Host copies of what this rank writes, and the writers' view of them. A failure to take
        them (`shared()` raising, host memory short) fails this rank's write in the background
        instead, so every rank learns of it at the agreement, as in a synchronous save."""
        try:
            parts = self._buffers.snapshot({"shared": shared() if self.rank == 0 else None, "own": own})
        except Exception as err:
            error = err  # `err` is unbound once the except clause ends

            def failed() -> dict[str, Any]:
                raise error

            return None, failed, failed
        return parts, (lambda: parts["shared"]), (lambda: parts["own"])

    @property
    def in_flight(self) -> Optional[int]:
        """The step of the background save in flight (its outcome not yet taken), or None."""
        return None if self._flight is None else self._flight.step

    def poll(self) -> Optional[Path]:
        """Every rank, at every step boundary. No save in flight: None, and no collective (the ranks
        started it at the same step, so they agree on that). Else one tiny all-reduce of the ranks'
        done flags: all done, the published path, or CheckpointNotSaved, on every rank at this same
        step; not all done, None."""
        if self._flight is None:
            return None
        flags = self._groups.flags if self._groups is not None else None
        if not collectives.all_true(self._flight.done, group=flags):
            return None
        return self._take_outcome()

    def wait(self) -> Optional[Path]:
        """Collective: blocks until the save in flight, if any, is over; then its outcome as `poll`
        gives it (the path, or CheckpointNotSaved raised). None when there was none."""
        if self._flight is None:
            return None
        return self._take_outcome()

    def _take_outcome(self) -> Path:
        flight, self._flight = self._flight, None
        assert flight is not None
        try:
            self.published = flight.result()  # every rank's thread ended with the outcome rank 0 shared
            return self.published
        finally:
            self._buffers.recycle(flight.snapshot)  # the thread is over: nothing reads them now

    def close(self) -> None:
        """On the way out: let a save in flight finish, published or removed, never half-written.
        Its failure is logged, not raised: close runs at exit, often under another exception."""
        if self._flight is None:
            return
        step = self._flight.step
        try:
            log.info("checkpoint of step %d, in flight at exit, is published: %s", step, self.wait())
        except Exception as err:
            log.error("checkpoint of step %d, in flight at exit, is not saved: %s", step, err)

