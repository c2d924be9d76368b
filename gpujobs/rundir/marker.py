"""The checkpoint marker, `checkpoints/step_<N>/COMPLETE`: one typed record, one reader (torch-free).

A step directory is a checkpoint only once its marker exists; the marker is written last and lists
every file of the step with its size and checksum. The job side's checkpointer (`gpujobs.rank.checkpoint`)
writes it through `Marker.to_json` and reads it back through `read_marker` when it resumes; the submit
side reads it through the same `read_marker` (`resume`: the same-run check, the plan history a replay
follows) without importing torch. The JSON keys are those of earlier gpujobs versions, so older run
dirs still resume: what an older marker lacks reads as None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.atomic import write_json_atomic
from gpujobs.rundir import CHECKPOINT_DIR, MARKER, STEP_PREFIX
from gpujobs.rundir.trust import read_own


class BadMarker(ValueError):
    """A marker file that is not a marker (torn, planted, of another shape): its step is no checkpoint."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint as its writer left it."""

    size: int
    """Bytes."""
    crc32: int
    """`zlib.crc32` of the whole file."""


@dataclass(frozen=True)
class SavedBalance:
    """How the saving run split its batches: the balancing mode and every plan it followed."""

    mode: str
    history: list[dict[str, Any]] = field(default_factory=list)
    """Plan records ({"step", "shares", "counts"}, as the balancer writes them), oldest first."""


@dataclass(frozen=True)
class SavedRun:
    """What the saving run says of itself in the marker (the trainer's part; the checkpointer adds the rest)."""

    config: Optional[dict[str, Any]] = None
    """The resolved config (`JobConfig.to_dict()`): what the same-run check compares."""
    global_batch_size: Optional[int] = None
    """Samples per step: what an elastic resume must keep."""
    samples: Optional[int] = None
    """Global samples trained up to this step."""
    balance: Optional[SavedBalance] = None


@dataclass(frozen=True)
class Marker:
    """The marker of one checkpoint."""

    step: int
    files: dict[str, FileEntry] = field(default_factory=dict)
    """Every file of the step by name; a file not listed is not part of it."""
    world_size: Optional[int] = None
    """The ranks that saved it (None: a marker too old to say)."""
    time: Optional[float] = None
    """When it was published (epoch seconds)."""
    run: SavedRun = field(default_factory=SavedRun)

    def to_json(self) -> dict[str, Any]:
        """The marker's JSON object (the keys earlier versions wrote; None values are left out)."""
        run = self.run
        payload: dict[str, Any] = {
            "step": self.step, "time": self.time, "world_size": self.world_size, "config": run.config,
            "global_batch_size": run.global_batch_size, "samples": run.samples,
            "files": {name: {"size": e.size, "crc32": e.crc32} for name, e in self.files.items()},
        }
        if run.balance is not None:
            payload["balance"] = {"mode": run.balance.mode, "history": run.balance.history}
        return {key: value for key, value in payload.items() if value is not None}

    @classmethod
    def from_json(cls, data: Any) -> Marker:
        """The marker a JSON object describes; BadMarker when it is not one."""
        if not isinstance(data, dict):
            raise BadMarker("the marker is no JSON object")
        balance = data.get("balance")
        return cls(
            step=_integer(data, "step"),
            files={str(name): _file_entry(name, entry) for name, entry in _mapping(data, "files").items()},
            world_size=_integer(data, "world_size", optional=True),
            time=float(data["time"]) if isinstance(data.get("time"), (int, float)) else None,
            run=SavedRun(
                config=data["config"] if isinstance(data.get("config"), dict) else None,
                global_batch_size=_integer(data, "global_batch_size", optional=True),
                samples=_integer(data, "samples", optional=True),
                balance=_balance(balance) if isinstance(balance, dict) else None,
            ),
        )


def _integer(data: dict[str, Any], key: str, optional: bool = False) -> Any:
    value = data.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadMarker(f"the marker's {key} is {value!r}, not a whole number")
    return value


def _mapping(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise BadMarker(f"the marker's {key} is no JSON object")
    return value


def _file_entry(name: str, entry: Any) -> FileEntry:
    if not isinstance(entry, dict):
        raise BadMarker(f"the marker's entry of {name} is no JSON object")
    return FileEntry(_integer(entry, "size"), _integer(entry, "crc32"))


def _balance(data: dict[str, Any]) -> SavedBalance:
    history = data.get("history")
    return SavedBalance(str(data.get("mode")), list(history) if isinstance(history, list) else [])


def step_dir(checkpoints: Path, step: int) -> Path:
    """The directory of the checkpoint of `step` under `checkpoints`."""
    return checkpoints / f"{STEP_PREFIX}{step:08d}"


def read_marker(path: Path) -> Marker:
    """The marker of the step directory `path`, read without following a link (`trust.read_own`).

    OSError when there is none (or it is a link: `Untrusted`); BadMarker when it is no marker.
    """
    text = read_own(path / MARKER)
    try:
        return Marker.from_json(json.loads(text))
    except ValueError as err:  # json's JSONDecodeError too
        raise BadMarker(f"{path / MARKER}: {err}") from None


def write_marker(path: Path, marker: Marker) -> None:
    """Publish the step directory `path`: its marker, written atomically (durable on return)."""
    write_json_atomic(path / MARKER, marker.to_json())


def newest_marker(run_dir: Path) -> Optional[tuple[Path, Marker]]:
    """The newest step directory of `run_dir` with a readable marker, and its marker (None if none).

    Not verified against its files (that needs the ranks and their files: `gpujobs.rank.checkpoint`)."""
    directory = run_dir / CHECKPOINT_DIR
    if not directory.is_dir():
        return None
    for entry in sorted(directory.glob(f"{STEP_PREFIX}*"), reverse=True):
        try:
            return entry, read_marker(entry)
        except (OSError, BadMarker):
            continue
    return None
