"""Rows of a prepared store, read row by row with pread (torch-free).

Opening checks the store (`check_store`) and keeps per split only the shards' row offsets: O(shards),
never O(rows). A `take` of random rows reads each row of each column with one `preadv` into the batch's
own buffer, on a descriptor opened once per column file and advised POSIX_FADV_RANDOM (no read-ahead of
a window around each row). Not a memory map: a page fault of a mapped file maps a whole page-cache folio
(1 MB here), so a step's few hundred random rows would map hundreds of MB into the rank and its RSS would
grow with the store; read, the pages stay in the kernel's cache, shared by the node's ranks, and a rank
holds only its batch. `span` reads contiguous rows (the eval) in sequential reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpujobs.data.layout import SPLITS, StoreLayout
from gpujobs.data.manifest import ColumnSpec, Manifest, ShardRecord, check_store
from gpujobs.data.store_files import open_store_file


@dataclass(frozen=True)
class _SplitIndex:
    """A split's shards and where each begins: shard i holds global rows [starts[i], starts[i + 1])."""

    shards: tuple[ShardRecord, ...]
    starts: np.ndarray  # int64, len(shards) + 1

    @classmethod
    def of(cls, shards: tuple[ShardRecord, ...]) -> _SplitIndex:
        starts = np.zeros(len(shards) + 1, dtype=np.int64)
        np.cumsum([shard.rows for shard in shards], out=starts[1:])
        return cls(shards, starts)

    @property
    def rows(self) -> int:
        return int(self.starts[-1])


class SampleStore:
    """A finished store, opened for reading with the parser and settings it must have been prepared with."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.root = root
        self.manifest = manifest
        self._layout = StoreLayout(root)
        self._splits = {split: _SplitIndex.of(manifest.split_shards(split)) for split in SPLITS}
        self._fds: dict[tuple[str, str], int] = {}

    @classmethod
    def open(cls, store: Path, parser: str, settings: dict[str, Any], verify: bool = False) -> SampleStore:
        """The store at `store`, checked (`check_store`, every column's sha256 too with `verify`: a StoreError
        naming data.store when refused)."""
        return cls(store, check_store(store, parser, settings, verify))

    def __getstate__(self) -> dict[str, Any]:
        # a copy sent to another process (a data loader's worker) opens the files again there, on first use
        return {**self.__dict__, "_fds": {}}

    def close(self) -> None:
        """Close the column files opened so far (they open again on the next read)."""
        fds = getattr(self, "_fds", {})  # none when __init__ did not get that far
        for fd in fds.values():
            os.close(fd)
        fds.clear()

    def __del__(self) -> None:
        self.close()

    def rows(self, split: str) -> int:
        """The rows of `split`."""
        return self._split(split).rows

    def take(self, split: str, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Column name -> the values of the global rows `rows` of `split` (any order, repeats allowed),
        shaped [len(rows), width] ([len(rows)] for width 1), in the order asked."""
        index = self._split(split)
        rows = np.asarray(rows, dtype=np.int64).ravel()
        if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= index.rows):
            raise IndexError(f"rows of {split} must lie in [0, {index.rows}), got {int(rows.min())}..{int(rows.max())}")
        out = {spec.name: np.empty(_shape(spec, rows.size), dtype=spec.dtype) for spec in self.manifest.columns}
        # side="right": a row at a shard's start belongs to that shard, and empty shards are never chosen
        shard_of = np.searchsorted(index.starts, rows, side="right") - 1
        order = np.argsort(shard_of, kind="stable")
        bounds = np.searchsorted(shard_of[order], np.arange(len(index.shards) + 1))
        for number, shard in enumerate(index.shards):
            wanted = order[bounds[number]:bounds[number + 1]]
            if wanted.size == 0:
                continue
            local = (rows[wanted] - index.starts[number]).tolist()
            for spec in self.manifest.columns:
                out[spec.name][wanted] = self._gather(shard, spec, local)
        return out

    def span(self, split: str, start: int, stop: int) -> dict[str, np.ndarray]:
        """Column name -> the values of the contiguous global rows [start, stop) of `split`."""
        index = self._split(split)
        if not 0 <= start <= stop <= index.rows:
            raise IndexError(f"span [{start}, {stop}) of {split} is not within [0, {index.rows}]")
        out = {spec.name: np.empty(_shape(spec, stop - start), dtype=spec.dtype) for spec in self.manifest.columns}
        for number, shard in enumerate(index.shards):
            begin, end = int(index.starts[number]), int(index.starts[number + 1])
            low, high = max(start, begin), min(stop, end)
            if low >= high:
                continue
            for spec in self.manifest.columns:
                self._read(shard, spec, low - begin, out[spec.name][low - start:high - start])
        return out

    def _split(self, split: str) -> _SplitIndex:
        if split not in self._splits:
            raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        return self._splits[split]

    def _gather(self, shard: ShardRecord, spec: ColumnSpec, local: list[int]) -> np.ndarray:
        """The rows `local` of `spec`'s column in `shard`, in that order: one preadv per row."""
        part = np.empty(_shape(spec, len(local)), dtype=spec.dtype)
        view, size = part.data.cast("B"), spec.row_bytes()
        fd = self._fd(shard, spec)
        for number, row in enumerate(local):
            if os.preadv(fd, [view[number * size:(number + 1) * size]], row * size) != size:
                raise OSError(f"{self._layout.column_file(shard.name, spec.name)} ended early: prepare the store again")
        return part

    def _fd(self, shard: ShardRecord, spec: ColumnSpec) -> int:
        """The descriptor of `spec`'s column file in `shard`, opened on first use, advised random reads."""
        key = (shard.name, spec.name)
        if key not in self._fds:
            fd = open_store_file(self.root, self._layout.column_file(shard.name, spec.name))
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            self._fds[key] = fd
        return self._fds[key]

    def _read(self, shard: ShardRecord, spec: ColumnSpec, begin: int, into: np.ndarray) -> None:
        """Read `spec`'s rows of `shard` from row `begin` into `into` (contiguous), in sequential reads."""
        with os.fdopen(open_store_file(self.root, self._layout.column_file(shard.name, spec.name)), "rb") as handle:
            handle.seek(begin * spec.row_bytes())
            done = handle.readinto(into.data.cast("B"))
        if done != into.nbytes:
            raise OSError(f"{self._layout.column_file(shard.name, spec.name)} ended early: prepare the store again")


def _shape(spec: ColumnSpec, rows: int) -> tuple[int, ...]:
    """A column's array shape for `rows` rows: [rows] for width 1, else [rows, width]."""
    return (rows,) if spec.width == 1 else (rows, spec.width)
