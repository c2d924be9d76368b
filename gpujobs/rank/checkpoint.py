"""Agreed, self-describing checkpoints: `step_<N>/` counts only once its marker lists every file.

Layout of one checkpoint::

    checkpoints/step_00000100/state.pt      model, optimizer, scheduler, step, config (rank 0)
    checkpoints/step_00000100/rank_<r>.pt   per-rank state: RNG streams (every rank)
    checkpoints/step_00000100/COMPLETE      JSON marker, written last: every file with its size and CRC-32

A save is a collective with one outcome on every rank. Each rank writes its files into a temporary
directory and fsyncs them, checksumming as it writes; one all-gather tells rank 0 which files are
durable, and only if every rank's are does rank 0 rename the directory into place and write the
marker. A failure anywhere publishes nothing and prunes nothing, and every rank gets the same answer.

A resume is a collective too: the ranks take the newest step that verifies (sizes and checksums) for
every rank's files. A damaged or missing file makes that step unusable for all of them, and the
fallback to an older step is logged and reported, never silent.

A periodic save can run in the background (`save_async`, `checkpoint.async=true`): it blocks the
caller only while the state is copied to host memory; the write, the agreement and the publishing run
on a thread with dedicated gloo groups (`checkpoint_async`), at most one save in flight, and its
outcome, the same on every rank, comes from `poll` at a step boundary that all ranks share.

A checkpoint records the world size that saved it. A resume at another world size (elastic) loads
only the shared state: a rank's file belongs to a rank of the old layout, so `own` is empty.

The checksum is CRC-32, computed while fsync waits for the disk: it finds damaged or truncated files
at a fraction of sha256's cost (bench/bench_checkpoint.py), and the files are not a security boundary
(they load with `weights_only=True`).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch
import torch.distributed as dist

from gpujobs.base.atomic import fsync_path, write_json_atomic
from gpujobs.base.errors import GpujobsError
from gpujobs.rank import collectives
from gpujobs.rank.checkpoint_async import HostBuffers, InFlight, SaveGroups
from gpujobs.rundir import MARKER, STEP_PREFIX
from gpujobs.rundir.trust import check_own_dir, open_read, own_dir, read_own

log = logging.getLogger(__name__)

SHARED_FILE = "state.pt"
_TMP = ".tmp-"


class CheckpointNotSaved(GpujobsError):
    """A save failed on some rank: nothing was published; the message names the step and the last good one.

    Every rank raises it at the same step (the ranks decide together); `ranks` (its `culprit_ranks`) are
    those whose write failed (rank 0 where publishing failed)."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.culprit_ranks = list(ranks)


_CHUNK = 8 << 20


def _checksum(path: Path) -> tuple[int, int]:
    """Size and CRC-32 of a file (just written: its pages are still in the page cache)."""
    with open(path, "rb", buffering=0) as handle:
        return _checksum_of(handle)


def _checksum_of(handle: BinaryIO) -> tuple[int, int]:
    """Size and CRC-32 of what `handle` reads from where it stands to its end."""
    size, crc = 0, 0
    buffer = bytearray(min(_CHUNK, max(1, os.fstat(handle.fileno()).st_size)))
    view = memoryview(buffer)
    while read := handle.readinto(buffer):  # type: ignore[attr-defined]  # a raw or buffered reader has it
        crc = zlib.crc32(view[:read], crc)
        size += read
    return size, crc


def _save_file(obj: Any, path: Path) -> dict[str, int]:
    """`torch.save` + fsync; returns the file's size and CRC-32 as the marker lists them.

    The checksum reads the file back while fsync waits for the disk: both release the GIL, so on
    any disk slower than memory the checksum costs next to nothing (bench/bench_checkpoint.py).
    """
    with open(path, "wb") as handle:
        try:
            torch.save(obj, handle)
        except RuntimeError as err:
            # A disk that fills mid-file: torch's zip writer, closing after the failed write, raises
            # "unexpected pos N vs M" over the OSError that says what happened. Report the cause.
            if isinstance(err.__context__, OSError):
                raise err.__context__ from err
            raise
        handle.flush()
        if handle.tell() < _CHUNK:  # a small file (a rank's RNG state): a thread would cost more than it saves
            os.fsync(handle.fileno())
            size, crc = _checksum(path)
        else:
            with ThreadPoolExecutor(max_workers=1) as pool:
                synced = pool.submit(os.fsync, handle.fileno())
                size, crc = _checksum(path)
                synced.result()
    return {"size": size, "crc32": crc}


def _load_verified(path: Path, entry: Optional[dict[str, Any]], map_location: Any) -> Any:
    """Load `path` after checking it against its marker entry; raises ValueError saying what is wrong.

    The check reads the file in chunks and the load reads it again (from the page cache by then), so a
    rank never holds more than the loaded state in memory.
    """
    if entry is None:
        raise ValueError(f"{path.name} is not listed in the marker")
    # FileNotFoundError (an OSError) when missing; Untrusted for a planted symlink: what is checked is loaded
    with open_read(path) as handle:
        size, crc = _checksum_of(handle)
        if size != entry["size"]:
            raise ValueError(f"{path.name} has {size} bytes, the marker says {entry['size']}")
        if crc != entry["crc32"]:
            raise ValueError(f"{path.name} fails its checksum")
        handle.seek(0)
        return torch.load(handle, map_location=map_location, weights_only=True)


@dataclass
class Loaded:
    """The checkpoint the ranks agreed to resume from."""

    step: int
    shared: dict[str, Any]
    own: dict[str, Any]
    path: str
    meta: dict[str, Any]
    """What the marker records besides the files (the saving run's config and world size)."""


class CheckpointManager:
    """Owns the save policy and the on-disk format; the train loop only reports its step."""

    def __init__(
        self,
        directory: Path,
        every_steps: int,
        keep: int,
        rank: int = 0,
        *,
        world_size: Optional[int] = None,
        async_save: bool = False,
    ) -> None:
        """`world_size` defaults to the process group's (1 without one): a default of 1 in a bigger
        group would take every same-size resume for an elastic one. `async_save` (the run saves in
        the background) makes the constructor collective: it creates the background saves' groups
        now, on every rank at the same point, rather than at the first `save_async`."""
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.keep = keep
        self.rank = rank
        self.world_size = world_size if world_size is not None else (
            dist.get_world_size() if collectives.active() else 1
        )
        self.async_save = async_save
        self.last_blocking_s = 0.0
        """Seconds the last `save` / `save_async` blocked its caller (for metrics.jsonl)."""
        self._flight: Optional[InFlight] = None
        self._buffers = HostBuffers()
        self._groups: Optional[SaveGroups] = SaveGroups.create() if async_save else None

    # ------------------------------------------------------------------ policy
    def should_save(self, step: int, max_steps: int) -> bool:
        """Every `every_steps` steps, and always at the last step."""
        return step == max_steps or (self.every_steps > 0 and step % self.every_steps == 0)

    # ------------------------------------------------------------------ reading
    def complete_steps(self) -> list[int]:
        """Steps with a marker (not yet verified), oldest first."""
        if not self.directory.is_dir():
            return []
        steps = []
        for entry in self.directory.iterdir():
            if entry.name.startswith(STEP_PREFIX) and (entry / MARKER).is_file():
                try:
                    steps.append(int(entry.name[len(STEP_PREFIX):]))
                except ValueError:
                    continue
        return sorted(steps)

    def path_for(self, step: int) -> Path:
        """Directory of the checkpoint of `step`."""
        return self.directory / f"{STEP_PREFIX}{step:08d}"

    def _verified(self, step: int, map_location: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """This rank's view of `step`: (shared state, own state, marker) once its files verify.

        Saved at another world size, a `rank_<r>.pt` belongs to the old layout (or does not exist):
        only the shared state is verified and loaded, and `own` is empty.
        """
        path = self.path_for(step)
        check_own_dir(path)  # a planted step dir (a symlink, another user's) would load what it points to
        marker = json.loads(read_own(path / MARKER))
        files = marker.get("files", {})
        shared = _load_verified(path / SHARED_FILE, files.get(SHARED_FILE), map_location)
        if marker.get("world_size", self.world_size) != self.world_size:
            return shared, {}, marker
        own = _load_verified(path / f"rank_{self.rank}.pt", files.get(f"rank_{self.rank}.pt"), "cpu")
        return shared, own, marker

    def load_latest(self, map_location: str | torch.device = "cpu") -> tuple[Optional[Loaded], list[dict[str, Any]]]:
        """Collective: the newest checkpoint that verifies on every rank, and the newer steps skipped
        ({"step", "why"} each).

        Every rank returns the same step (or None: start from scratch) and the same skipped list.
        """
        listings = collectives.all_gather_objects(self.complete_steps())
        common = sorted(set.intersection(*(set(steps) for steps in listings)), reverse=True)
        skipped: list[dict[str, Any]] = []
        for step in common:
            problem: Optional[str] = None
            try:
                shared, own, marker = self._verified(step, map_location)
            except Exception as err:  # damaged, truncated, missing, unpicklable: this step is not usable
                problem = f"rank {self.rank}: {err}"
            problems = [p for p in collectives.all_gather_objects(problem) if p]
            if not problems:
                meta = {k: v for k, v in marker.items() if k != "files"}
                saved_world = meta.get("world_size", self.world_size)
                if saved_world != self.world_size and self.rank == 0:
                    log.warning("checkpoint %s was saved by %s ranks, resuming with %d: per-rank state is not"
                                " restored", self.path_for(step), saved_world, self.world_size)
                return Loaded(step, shared, own, str(self.path_for(step)), meta), skipped
            why = "; ".join(problems)
            log.error("checkpoint %s is unusable (%s): trying an older one", self.path_for(step), why)
            skipped.append({"step": step, "why": why})
        if skipped:
            log.error("no checkpoint verifies on every rank: starting from scratch")
        return None, skipped

    # ------------------------------------------------------------------ writing
    def save(
        self,
        step: int,
        shared: Callable[[], dict[str, Any]],
        own: dict[str, Any],
        meta: Optional[dict[str, Any]] = None,
    ) -> Path:
        """Collective save: every rank writes its file, rank 0 also `shared()`, and rank 0 publishes
        only when every rank's files are durable. Returns the checkpoint's path on every rank, or
        raises CheckpointNotSaved on every rank (nothing published, nothing pruned).

        A background save in flight is waited for first (`wait`, raising its failure): a save at a
        preemption or at the end is synchronous and comes after the one in flight."""
        start = time.perf_counter()
        try:
            self.wait()
            return self._write_and_agree(step, shared, lambda: own, meta or {}, None)
        finally:
            self.last_blocking_s = time.perf_counter() - start

    def save_async(
        self,
        step: int,
        shared: Callable[[], dict[str, Any]],
        own: dict[str, Any],
        meta: Optional[dict[str, Any]] = None,
    ) -> None:
        """Collective, every rank at the same step: waits for the save in flight (raising its failure
        as `save` would), copies `shared()` (rank 0) and `own` to host memory, and returns; a thread
        then does what `save` does. Its outcome comes from `poll` or `wait`, the same on every rank."""
        start = time.perf_counter()
        self.wait()
        if self._groups is None:
            self._groups = SaveGroups.create()  # collective: every rank's first save_async is at the same step
        parts, shared_now, own_now = self._snapshot(shared, own)
        meta_now, group = copy.deepcopy(meta or {}), self._groups.agreement
        work = lambda: self._write_and_agree(step, shared_now, own_now, meta_now, group)  # noqa: E731
        self._flight = InFlight(step, work, (CheckpointNotSaved,), parts)
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
            return flight.result()  # every rank's thread ended with the outcome rank 0 shared
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

    def _write_and_agree(
        self,
        step: int,
        shared: Callable[[], dict[str, Any]],
        own: Callable[[], dict[str, Any]],
        meta: dict[str, Any],
        group: Optional[dist.ProcessGroup],
    ) -> Path:
        """The save itself (see `save`), its collectives on `group` (the training group if None)."""
        tmp = self.directory / f"{_TMP}{STEP_PREFIX}{step:08d}"
        report: dict[str, Any] = {"rank": self.rank, "files": {}, "error": None}
        try:
            if self.rank == 0:
                self._sweep_temporaries(keep=tmp)
            # a link planted as checkpoints/ or as this temp dir is refused (the save fails), never written through
            own_dir(self.directory.parent, self.directory.name, tmp.name)
            report["files"][f"rank_{self.rank}.pt"] = _save_file(own(), tmp / f"rank_{self.rank}.pt")
            if self.rank == 0:
                report["files"][SHARED_FILE] = _save_file(shared(), tmp / SHARED_FILE)
        except Exception as err:  # a full disk, a quota, a vanished mount: report it, decide together
            report["error"] = f"rank {self.rank}: {err}"
        reports = collectives.all_gather_objects(report, group)
        outcome: Optional[tuple[str, list[int]]] = None
        if self.rank == 0:
            errors = [r["error"] for r in reports if r["error"]]
            failed = [int(r["rank"]) for r in reports if r["error"]]
            if not errors:
                files = {name: e for r in reports for name, e in r["files"].items()}
                try:
                    self._publish(step, tmp, files, {**meta, "world_size": self.world_size})
                except Exception as err:  # not only OSError: the other ranks wait for this answer
                    errors.append(f"rank 0 publishing: {err}")
                    failed = [0]
            if errors:
                shutil.rmtree(tmp, ignore_errors=True)
                outcome = ("; ".join(errors), failed)
        outcome = collectives.all_gather_objects(outcome, group)[0]  # rank 0's word, on every rank
        if outcome is not None:
            older = [s for s in self.complete_steps() if s < step]
            last_good = f"step {older[-1]} ({self.path_for(older[-1])})" if older else "none"
            raise CheckpointNotSaved(f"checkpoint at step {step} not saved ({outcome[0]}); last good: {last_good}",
                                     ranks=outcome[1])
        if self.rank == 0:
            self._prune(step)
        return self.path_for(step)

    def _publish(self, step: int, tmp: Path, files: dict[str, dict[str, int]], meta: dict[str, Any]) -> None:
        final = self.path_for(step)
        for extra in tmp.iterdir():  # files of an earlier attempt at this step that nobody wrote now
            if extra.name not in files:
                extra.unlink()
        fsync_path(tmp)
        if final.exists():  # a leftover without marker (it would not be listed otherwise): not a checkpoint
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.directory)
        write_json_atomic(final / MARKER, {**meta, "step": step, "time": round(time.time(), 3), "files": files})

    def _sweep_temporaries(self, keep: Path) -> None:
        if not self.directory.is_dir():
            return
        for entry in self.directory.iterdir():
            unpublished = entry.name.startswith(STEP_PREFIX) and not (entry / MARKER).exists()
            if entry != keep and (entry.name.startswith(_TMP) or unpublished):
                shutil.rmtree(entry, ignore_errors=True)

    def _prune(self, published: int) -> None:
        """Keep the `keep` newest checkpoints up to the one just published; never a newer one's fate,
        never the one just published."""
        older = [s for s in self.complete_steps() if s < published]
        for step in older[: max(0, len(older) - (self.keep - 1))]:
            path = self.path_for(step)
            # Unpublish first (marker gone = not a checkpoint), then delete at leisure.
            (path / MARKER).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
