"""GPU telemetry in the run dir: one JSON-lines file a node, `gpu.<node>.jsonl`, and their readers.

Each node's sampler appends to a file of its own: appends from several NFS clients to one file are not atomic
(O_APPEND holds on one machine only), so one shared gpu.jsonl could interleave or lose lines. Readers take every
node's file, and the single `gpu.jsonl` that run dirs of earlier versions hold.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpujobs.base.atomic import JsonlTail, read_jsonl
from gpujobs.rundir import GPU_FILE

_NODE_FILE = re.compile(r"gpu\.[A-Za-z0-9._-]+\.jsonl")


def gpu_file(run_dir: Path, node: str) -> Path:
    """The file node `node`'s sampler appends to (its name kept to letters, digits and ._-)."""
    return Path(run_dir) / f"gpu.{re.sub(r'[^A-Za-z0-9._-]', '_', node) or '_'}.jsonl"


def gpu_files(run_dir: Path) -> list[Path]:
    """Every node's file of GPU samples in `run_dir` (and an earlier version's shared one), by name."""
    try:
        names = sorted(p.name for p in Path(run_dir).iterdir())
    except FileNotFoundError:
        return []
    return [Path(run_dir) / n for n in names if n == GPU_FILE or _NODE_FILE.fullmatch(n)]


def read_gpu_samples(run_dir: Path) -> list[dict[str, Any]]:
    """Every node's samples, oldest first (by their `time`; stable: a file's own order where times tie)."""
    samples = [s for path in gpu_files(run_dir) for s in read_jsonl(path)]
    return sorted(samples, key=lambda s: s["time"] if isinstance(s.get("time"), (int, float)) else 0)


class GpuFilesTail:
    """The samples appended to every node's file since this tail began (`poll`); a node's file that appears
    later is read from its start, as all of it was written since."""

    def __init__(self, run_dir: Path, skip: frozenset[Path] = frozenset()) -> None:
        self.run_dir, self.skip = Path(run_dir), skip
        self._tails = {p: JsonlTail(p, from_end=True) for p in gpu_files(run_dir) if p not in skip}

    def poll(self) -> Iterator[dict[str, Any]]:
        """New complete samples since the last call, file by file."""
        for path in gpu_files(self.run_dir):
            if path not in self.skip and path not in self._tails:
                self._tails[path] = JsonlTail(path)
        for tail in self._tails.values():
            yield from tail.poll()
