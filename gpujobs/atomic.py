"""Writes that matter are atomic: temp file, fsync, rename, fsync the directory (torch-free)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text`: readers see the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """`write_text_atomic` of indented, key-sorted JSON."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
