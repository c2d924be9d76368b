"""Atomic, self-describing checkpoints: `step_<N>/` counts only once its marker file exists.

Layout of one checkpoint::

    checkpoints/step_00000100/state.pt      model, optimizer, scheduler, step, config (rank 0)
    checkpoints/step_00000100/rank_<r>.pt   per-rank state: RNG streams (every rank)
    checkpoints/step_00000100/COMPLETE      JSON marker, written last

A save writes into a temporary directory, fsyncs every file, renames the directory into place,
then writes the marker. A crash at any moment leaves either the previous checkpoints untouched or a
directory without marker, which `load_latest` skips and the next save sweeps away.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from gpujobs.atomic import fsync_path, write_json_atomic

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
_PREFIX = "step_"


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


class CheckpointManager:
    """Owns the save policy and the on-disk format; the train loop only reports its step."""

    def __init__(self, directory: Path, every_steps: int, keep: int, rank: int = 0) -> None:
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.keep = keep
        self.rank = rank

    # ------------------------------------------------------------------ policy
    def should_save(self, step: int, max_steps: int) -> bool:
        """Every `every_steps` steps, and always at the last step."""
        return step == max_steps or (self.every_steps > 0 and step % self.every_steps == 0)

    # ------------------------------------------------------------------ reading
    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first."""
        if not self.directory.is_dir():
            return []
        steps = []
        for entry in self.directory.iterdir():
            if entry.name.startswith(_PREFIX) and (entry / MARKER).is_file():
                try:
                    steps.append(int(entry.name[len(_PREFIX):]))
                except ValueError:
                    continue
        return sorted(steps)

    def path_for(self, step: int) -> Path:
        """Directory of the checkpoint of `step`."""
        return self.directory / f"{_PREFIX}{step:08d}"

    def load_latest(self, map_location: str | torch.device = "cpu") -> Optional[dict[str, Any]]:
        """The newest complete checkpoint as {"shared": ..., "rank": ..., "step": N}, or None."""
        for step in reversed(self.complete_steps()):
            path = self.path_for(step)
            try:
                shared = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
                rank_file = path / f"rank_{self.rank}.pt"
                own = torch.load(rank_file, map_location="cpu", weights_only=True) if rank_file.exists() else {}
            except Exception as err:  # a damaged complete checkpoint: say so, fall back to an older one
                log.error("checkpoint %s is unreadable (%s); trying an older one", path, err)
                continue
            return {"step": step, "shared": shared, "rank": own, "path": str(path)}
        return None

    # ------------------------------------------------------------------ writing
    def save(
        self,
        step: int,
        shared: Callable[[], dict[str, Any]],
        own: dict[str, Any],
        barrier: Callable[[], None] = lambda: None,
    ) -> Optional[Path]:
        """Collective save: every rank calls it; rank 0 writes `shared()` and publishes the step.

        Returns the checkpoint's path, or None when the save failed (the previous checkpoints are
        untouched and the failure is logged). Every rank returns the same way.
        """
        if (self.path_for(step) / MARKER).is_file():
            return self.path_for(step)  # this step is already safe on disk
        tmp = self.directory / f".tmp-{_PREFIX}{step:08d}"
        ok = True
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._sweep_temporaries()
                tmp.mkdir()
            except OSError as err:
                log.error("checkpoint at step %d not saved: %s", step, err)
                ok = False
        barrier()  # the temp dir exists before anyone writes into it
        try:
            if tmp.is_dir():
                _save_file(own, tmp / f"rank_{self.rank}.pt")
                if self.rank == 0:
                    _save_file(shared(), tmp / "state.pt")
        except Exception as err:
            log.error("checkpoint at step %d not saved (rank %d): %s", step, self.rank, err)
            ok = False
        barrier()  # every rank's file is on disk
        if self.rank != 0:
            return self.path_for(step) if ok else None
        if not ok or not (tmp / "state.pt").exists():
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        try:
            final = self.path_for(step)
            if final.exists():  # an incomplete leftover (no marker) of an earlier attempt
                shutil.rmtree(final)
            fsync_path(tmp)
            os.replace(tmp, final)
            write_json_atomic(final / MARKER, {"step": step, "time": time.time()})
        except OSError as err:
            log.error("checkpoint at step %d not published: %s", step, err)
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        self._prune()
        return final

    def _sweep_temporaries(self) -> None:
        for entry in self.directory.iterdir():
            if entry.name.startswith(".tmp-") or (entry.name.startswith(_PREFIX) and not (entry / MARKER).exists()):
                shutil.rmtree(entry, ignore_errors=True)

    def _prune(self) -> None:
        for step in self.complete_steps()[: -self.keep]:
            path = self.path_for(step)
            # Unpublish first (marker gone = not a checkpoint), then delete at leisure.
            (path / MARKER).unlink(missing_ok=True)
            shutil.rmtree(path, ignore_errors=True)
