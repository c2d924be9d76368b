"""`sweep.json`: the points of a sweep dir (number, overrides, run dir), for the management commands.

The launcher writes it (`gpujobs.launch.sweep`) once the points are planned, and `status`, `logs`,
`cancel` and `resubmit` read it. It is written whole (atomically), so a file that reads otherwise was
made by hand or by another tool: a GpujobsError naming the file, never a guess.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from gpujobs.base.atomic import write_json_atomic
from gpujobs.base.errors import GpujobsError

SWEEP_FILE = "sweep.json"


class ListedPoint(Protocol):
    """What `sweep.json` keeps of a point (`gpujobs.launch.sweep.Point`)."""

    num: int
    overrides: list[str]
    run_dir: Path


def write_sweep_file(sweep_dir: Path, points: Sequence[ListedPoint]) -> None:
    """`sweep.json`: every point's number, overrides and run dir, for the management commands."""
    existing = read_sweep_file(sweep_dir)
    known = {entry["num"]: entry for entry in existing}
    for point in points:
        known[point.num] = {"num": point.num, "overrides": point.overrides, "run_dir": str(point.run_dir)}
    write_json_atomic(sweep_dir / SWEEP_FILE, {"points": [known[num] for num in sorted(known)]})


def unlist(sweep_dir: Path, nums: set[int]) -> None:
    """Take points out of `sweep.json` (the file goes when none is left)."""
    left = [entry for entry in read_sweep_file(sweep_dir) if entry["num"] not in nums]
    if left:
        write_json_atomic(sweep_dir / SWEEP_FILE, {"points": left})
    else:
        (sweep_dir / SWEEP_FILE).unlink(missing_ok=True)


def read_sweep_file(sweep_dir: Path) -> list[dict[str, Any]]:
    """The points `sweep.json` lists (empty when there is none), each {"num", "overrides", "run_dir"}.

    It is written whole (atomically), so anything else in it (not JSON, another shape, an unreadable
    file) was made by hand or by another tool: a GpujobsError naming the file, never a guess.
    """
    path = sweep_dir / SWEEP_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as err:  # a directory in its place, no permission
        raise GpujobsError(f"{path} cannot be read: {err.strerror}") from None
    try:
        document = json.loads(data)
    except ValueError as err:  # not JSON, or not UTF-8
        raise GpujobsError(f"{path} is damaged: not JSON ({err})") from None
    points = document.get("points") if isinstance(document, dict) else None
    if not isinstance(points, list):
        found = (f"it is {_shape(document)}" if not isinstance(document, dict) else
                 'it has no "points"' if "points" not in document else f'"points" is {_shape(points)}')
        raise GpujobsError(f'{path} is damaged: expected {{"points": [...]}}, {found}')
    for at, entry in enumerate(points):
        if not _is_entry(entry):
            raise GpujobsError(f'{path} is damaged: point {at} is not {{"num": int, "overrides": [str...], '
                               f'"run_dir": str}}: {json.dumps(entry)[:80]}')
    return list(points)


def _is_entry(entry: Any) -> bool:
    """One point as `write_sweep_file` writes it."""
    if not isinstance(entry, dict):
        return False
    num, overrides, run_dir = entry.get("num"), entry.get("overrides"), entry.get("run_dir")
    return (isinstance(num, int) and not isinstance(num, bool) and isinstance(run_dir, str) and bool(run_dir)
            and isinstance(overrides, list) and all(isinstance(o, str) for o in overrides))


def _shape(value: Any) -> str:
    """What a JSON value is, in a word (for the error line)."""
    if value is None:
        return "null"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(type(value), "a number")
