"""A run's checkpoint directory: agreed saves into it, agreed resumes from it (`CheckpointManager` uses it).

Layout of one checkpoint::

    checkpoints/step_00000100/state.pt      model, optimizer, scheduler, step, config (rank 0)
    checkpoints/step_00000100/rank_<r>.pt   per-rank state: RNG streams (every rank)
    checkpoints/step_00000100/sharded/      sharded state (parallel=torchrec's tables), every rank's shards
                                            written through torch.distributed.checkpoint (`checkpoint_sharded`)
    checkpoints/step_00000100/COMPLETE      the marker, written last: every file with its size and CRC-32

A save is a collective with one outcome on every rank. Each rank writes its files into a temporary
directory, fsyncs them and checksums them; one all-gather tells rank 0 which files are durable, and
only if every rank's are does rank 0 write the marker into that directory and rename it into place.
A failure anywhere publishes nothing and prunes nothing, and every rank gets the same answer.

A resume is a collective too: the ranks take the newest step that verifies (sizes and checksums) for
every rank's files. A damaged or missing file makes that step unusable for all of them, and the
fallback to an older step is logged and reported, never silent. A checkpoint records the world size
that saved it; a resume at another world size (elastic) loads only the shared state, as a rank's file
belongs to a rank of the old layout (`own` is empty).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from gpujobs.base.atomic import fsync_path
from gpujobs.base.errors import GpujobsError
from gpujobs.rank import collectives
from gpujobs.rank.checkpoint_files import load_verified, save_file
from gpujobs.rank.checkpoint_sharded import SHARDED_DIR, save_sharded, verify_share
from gpujobs.rundir import MARKER, STEP_PREFIX
from gpujobs.rundir.marker import Marker, SavedRun, read_marker, step_dir, write_marker
from gpujobs.rundir.trust import check_own_dir, own_dir

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


@dataclass
class Loaded:
    """The checkpoint the ranks agreed to resume from."""

    step: int
    shared: dict[str, Any]
    own: dict[str, Any]
    path: str
    marker: Marker
    """What the marker records (the saving run's config and world size, its files)."""


class CheckpointDir:
    """The checkpoints of one run as this rank sees them: listed, verified, loaded, written, pruned."""

    def __init__(self, directory: Path, keep: int, rank: int, world_size: int) -> None:
        self.directory = directory
        self.keep = keep
        self.rank = rank
        self.world_size = world_size

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
        return step_dir(self.directory, step)

    def verified(self, step: int, map_location: Any) -> tuple[dict[str, Any], dict[str, Any], Marker]:
        """This rank's view of `step`: (shared state, own state, marker) once its files verify.

        Saved at another world size, a `rank_<r>.pt` belongs to the old layout (or does not exist):
        only the shared state is verified and loaded, and `own` is empty.
        """
        path = self.path_for(step)
        check_own_dir(path)  # a planted step dir (a symlink, another user's) would load what it points to
        marker = read_marker(path)
        shared = load_verified(path / SHARED_FILE, marker.files.get(SHARED_FILE), map_location)
        verify_share(path, marker, self.rank, self.world_size)  # sharded state: loaded by its owner, resharded
        if (marker.world_size or self.world_size) != self.world_size:
            return shared, {}, marker
        own = load_verified(path / f"rank_{self.rank}.pt", marker.files.get(f"rank_{self.rank}.pt"), "cpu")
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
                shared, own, marker = self.verified(step, map_location)
            except Exception as err:  # damaged, truncated, missing, unpicklable: this step is not usable
                problem = f"rank {self.rank}: {err}"
            problems = [p for p in collectives.all_gather_objects(problem) if p]
            if not problems:
                saved_world = marker.world_size or self.world_size
                if saved_world != self.world_size and self.rank == 0:
                    log.warning("checkpoint %s was saved by %s ranks, resuming with %d: per-rank state is not"
                                " restored", self.path_for(step), saved_world, self.world_size)
                return Loaded(step, shared, own, str(self.path_for(step)), marker), skipped
            why = "; ".join(problems)
            log.error("checkpoint %s is unusable (%s): trying an older one", self.path_for(step), why)
            skipped.append({"step": step, "why": why})
        if skipped:
            log.error("no checkpoint verifies on every rank: starting from scratch")
        return None, skipped

    def write_and_agree(
        self,
        step: int,
        shared: Callable[[], dict[str, Any]],
        own: Callable[[], dict[str, Any]],
        run: SavedRun,
        group: Optional[dist.ProcessGroup],
        sharded: Optional[Callable[[], dict[str, Any]]] = None,
    ) -> Path:
        """Collective: every rank writes its files into a temp dir and fsyncs them (and, with `sharded`, its
        shards of that state through DCP); rank 0 publishes the step only when every rank's are durable. The
        step's path on every rank, or CheckpointNotSaved on every rank (nothing published, nothing pruned).
        Its collectives go over `group` (None: the training group's)."""
        tmp = self.directory / f"{_TMP}{STEP_PREFIX}{step:08d}"
        report: dict[str, Any] = {"rank": self.rank, "files": {}, "error": None}
        try:
            if self.rank == 0:
                self._sweep_temporaries(keep=tmp)
            # a link planted as checkpoints/ or as this temp dir is refused (the save fails), never written through
            own_dir(self.directory.parent, self.directory.name, tmp.name)
            report["files"][f"rank_{self.rank}.pt"] = save_file(own(), tmp / f"rank_{self.rank}.pt")
            if self.rank == 0:
                report["files"][SHARED_FILE] = save_file(shared(), tmp / SHARED_FILE)
        except Exception as err:  # a full disk, a quota, a vanished mount: report it, decide together
            report["error"] = f"rank {self.rank}: {err}"
        if sharded is not None:
            self._write_sharded(sharded, tmp, report, group)
        reports = collectives.all_gather_objects(report, group)
        outcome: Optional[tuple[str, list[int]]] = None
        if self.rank == 0:
            errors = [r["error"] for r in reports if r["error"]]
            failed = [int(r["rank"]) for r in reports if r["error"]]
            if not errors:
                files = {name: e for r in reports for name, e in r["files"].items()}
                try:
                    self._publish(tmp, Marker(step, files, self.world_size, round(time.time(), 3), run))
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

    def _write_sharded(self, sharded: Callable[[], dict[str, Any]], tmp: Path, report: dict[str, Any],
                       group: Optional[dist.ProcessGroup]) -> None:
        """Every rank's shards through DCP, a collective of its own: entered only when every rank got this far
        (one tiny all-gather first), so a rank whose files failed leaves no other waiting in DCP's. DCP's
        own failure on any rank raises on every rank."""
        ready = collectives.all_gather_objects(report["error"] is None, group)
        if not all(ready):
            return
        try:
            directory = own_dir(tmp, SHARDED_DIR)
            report["files"].update(save_sharded(sharded(), directory, self.rank, group))
        except Exception as err:
            report["error"] = f"rank {self.rank}: sharded state: {err}"

    def _publish(self, tmp: Path, marker: Marker) -> None:
        """Write the marker into the temp dir, once every file it lists is durable, then rename the temp dir
        into place: the step appears whole with its marker, or not at all.

        Five fsyncs in all, what durability needs: each file's (done by its writer), the marker's, the temp
        dir's (its entries, the marker's included; `write_marker` does both), and the checkpoints dir's
        (the rename)."""
        final = self.path_for(marker.step)
        for extra in [*tmp.iterdir(), *(tmp / SHARDED_DIR).glob("*")]:  # an earlier attempt's, nobody's now
            name = str(extra.relative_to(tmp))
            if name in marker.files or (name == SHARDED_DIR and extra.is_dir() and not extra.is_symlink()):
                continue
            if extra.is_dir() and not extra.is_symlink():
                shutil.rmtree(extra)
            else:
                extra.unlink()
        write_marker(tmp, marker)
        if final.exists():  # a leftover without marker (it would not be listed otherwise): not a checkpoint
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.directory)

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
