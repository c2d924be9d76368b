"""The typed records of a sample store (torch-free): columns, shards, the manifest, and the checks that
refuse a store training must not use.

The manifest is written last by a prepare: a store without one is unfinished. `check_store` is what
submit and training call; it costs O(shards) file stats, never O(rows).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpujobs.base.errors import ConfigError
from gpujobs.data.layout import COLUMN_NAME, SPLITS, StoreLayout, column_file_name

FORMAT_VERSION = 1
#: The config key every store refusal names.
STORE_KEY = "data.store"


class StoreError(ConfigError):
    """The store at `data.store` cannot be used (or prepared); one line naming data.store and what is wrong."""

    def __init__(self, store: Path | str, what: str) -> None:
        super().__init__(STORE_KEY, str(store), what)
        self.args = (f"{STORE_KEY}={str(store)!r}: {what}",)

    def __reduce__(self) -> tuple[type[StoreError], tuple[object, ...]]:
        # rebuilt from (store, what), not from its message: it crosses from a prepare's worker processes
        return (type(self), (str(self.value), self.allowed))


@dataclass(frozen=True)
class ColumnSpec:
    """One column of every row: a file name stem, a little-endian numpy dtype string, values per row."""

    name: str
    dtype: str
    width: int

    def __post_init__(self) -> None:
        if not COLUMN_NAME.fullmatch(self.name):
            raise ValueError(f"column name {self.name!r} is not a file name stem [a-z_][a-z0-9_]*")
        if np.dtype(self.dtype).byteorder == ">" or np.dtype(self.dtype).str != self.dtype:
            raise ValueError(f"column {self.name}: dtype {self.dtype!r} is not a little-endian numpy dtype string "
                             f"(e.g. '<f4', '<i8', '|u1')")
        if self.width < 1:
            raise ValueError(f"column {self.name}: width {self.width} is not >= 1")

    def row_bytes(self) -> int:
        """Bytes one row of this column takes on disk."""
        return np.dtype(self.dtype).itemsize * self.width


@dataclass(frozen=True)
class SourceFile:
    """An input file as it was when prepared: a changed input is prepared again."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> SourceFile:
        """The input file at `path` as it is now."""
        info = path.stat()
        return cls(str(path), info.st_size, info.st_mtime_ns)


@dataclass(frozen=True)
class ColumnFile:
    """A column's file in a published shard, as prepare left it."""

    name: str
    size: int
    mtime_ns: int
    sha256: str


@dataclass(frozen=True)
class ShardRecord:
    """One published shard: the rows of one input file."""

    name: str
    split: str
    rows: int
    source: SourceFile
    bad_lines: int
    columns: tuple[ColumnFile, ...]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "split": self.split, "rows": self.rows, "source": vars(self.source),
                "bad_lines": self.bad_lines, "columns": [vars(c) for c in self.columns]}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> ShardRecord:
        return cls(str(payload["name"]), str(payload["split"]), int(payload["rows"]),
                   SourceFile(**payload["source"]), int(payload["bad_lines"]),
                   tuple(ColumnFile(**c) for c in payload["columns"]))


@dataclass(frozen=True)
class Manifest:
    """A finished store: how it was prepared, its columns, and its shards (train in order, then eval)."""

    format_version: int
    parser: str
    settings: dict[str, Any]
    columns: tuple[ColumnSpec, ...]
    shards: tuple[ShardRecord, ...]

    def rows(self, split: str) -> int:
        """The rows of `split` ("train" or "eval") in all its shards."""
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not one of {', '.join(SPLITS)}")
        return sum(shard.rows for shard in self.shards if shard.split == split)

    def split_shards(self, split: str) -> tuple[ShardRecord, ...]:
        """The shards of `split`, in order."""
        return tuple(shard for shard in self.shards if shard.split == split)

    def to_json(self) -> dict[str, Any]:
        return {"format_version": self.format_version, "parser": self.parser, "settings": self.settings,
                "columns": [vars(c) for c in self.columns], "shards": [s.to_json() for s in self.shards]}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> Manifest:
        return cls(int(payload["format_version"]), str(payload["parser"]), dict(payload["settings"]),
                   tuple(ColumnSpec(**c) for c in payload["columns"]),
                   tuple(ShardRecord.from_json(s) for s in payload["shards"]))


NOT_PREPARED = "not prepared, or its prepare did not finish: run gpujobs prepare with the same config"


def read_manifest(store: Path) -> Manifest:
    """The manifest of the finished store at `store`, or a StoreError naming data.store and what is wrong."""
    layout = StoreLayout(store)
    if not store.is_dir():
        what = "is not a directory" if store.exists() else "no such directory"
        raise StoreError(store, f"{what}: run gpujobs prepare with the same config")
    try:
        text = layout.manifest.read_text()
    except FileNotFoundError:
        raise StoreError(store, NOT_PREPARED) from None
    except OSError as err:
        raise StoreError(store, f"its manifest.json cannot be read: {err.strerror}") from None
    try:
        payload = json.loads(text)
        version = payload["format_version"]
    except (ValueError, TypeError, KeyError):
        raise StoreError(store, "its manifest.json is damaged: prepare it again") from None
    if version != FORMAT_VERSION:
        raise StoreError(store, f"it has store format version {version!r}, this gpujobs reads version "
                                f"{FORMAT_VERSION}: prepare it again")
    try:
        return Manifest.from_json(payload)
    except (ValueError, TypeError, KeyError, AttributeError):
        raise StoreError(store, "its manifest.json is damaged: prepare it again") from None


def _as_json(settings: dict[str, Any]) -> dict[str, Any]:
    """`settings` as the manifest holds them (tuples become lists)."""
    result: dict[str, Any] = json.loads(json.dumps(settings, sort_keys=True))
    return result


def settings_difference(prepared: dict[str, Any], wanted: dict[str, Any]) -> str:
    """"" when equal, else "prepared with k=a, this job has k=b" over the keys that differ."""
    prepared, wanted = _as_json(prepared), _as_json(wanted)
    keys = sorted(k for k in prepared.keys() | wanted.keys() if prepared.get(k, None) != wanted.get(k, None))
    if not keys:
        return ""

    def show(values: dict[str, Any]) -> str:
        return ", ".join(f"{k}={json.dumps(values[k])}" if k in values else f"no {k}" for k in keys)

    return f"prepared with {show(prepared)}, this job has {show(wanted)}"


def check_store(store: Path, parser: str, settings: dict[str, Any]) -> Manifest:
    """The manifest of `store` when training may use it with `parser` and `settings`; else a StoreError.

    Refused: a missing or unfinished store, another format version, another parser, other settings, and
    a column file whose size or mtime is not what prepare recorded (changed after prepare).
    """
    manifest = read_manifest(store)
    if manifest.parser != parser:
        raise StoreError(store, f"prepared by parser {manifest.parser}, this job's parser is {parser}: "
                                f"prepare it again with this config, or point data.store elsewhere")
    difference = settings_difference(manifest.settings, settings)
    if difference:
        raise StoreError(store, f"{difference}: prepare it again with this config, or point data.store elsewhere")
    layout = StoreLayout(store)
    specs = {spec.name: spec for spec in manifest.columns}
    for shard in manifest.shards:
        if sorted(column.name for column in shard.columns) != sorted(specs):
            raise StoreError(store, f"its manifest.json is damaged (shard {shard.name} does not hold the columns "
                                    f"{', '.join(specs)}): prepare it again")
        for column in shard.columns:
            _check_column_file(store, layout.shard_dir(shard.name), shard, column, specs.get(column.name))
    return manifest


def _check_column_file(store: Path, directory: Path, shard: ShardRecord, column: ColumnFile,
                       spec: ColumnSpec | None) -> None:
    """Refuse a column file that is missing, or not as prepare recorded it (size, mtime, rows x width)."""
    where = f"shard {shard.name}'s {column_file_name(column.name)}"
    if spec is None or column.size != shard.rows * spec.row_bytes():  # the reader's row offsets rely on it
        raise StoreError(store, f"its manifest.json is damaged ({where} does not hold {shard.rows} rows of "
                                f"the manifest's columns): prepare it again")
    try:
        info = os.stat(directory / column_file_name(column.name))
    except FileNotFoundError:
        raise StoreError(store, f"{where} is missing: prepare it again") from None
    if info.st_size != column.size or info.st_mtime_ns != column.mtime_ns:
        raise StoreError(store, f"{where} changed after prepare: prepare it again")
