"""The typed records of a sample store (torch-free): columns, shards, the manifest, and the checks that
refuse a store training must not use.

The manifest is written last by a prepare: a store without one is unfinished. `check_store` is what
submit and training call; it costs O(shards) small reads and stats, never O(rows), unless asked to verify
every column's sha256 (`data.verify`: O(bytes)). Every file is read as `store_files` allows (no link
followed, no FIFO read).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpujobs.data.layout import COLUMN_NAME, SPLITS, StoreLayout, column_file_name
from gpujobs.data.store_files import (
    StoreError,
    check_store_dir,
    check_store_file,
    check_store_root,
    file_sha256,
    read_store_json,
)

FORMAT_VERSION = 1


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
    check_store_root(store)
    if not store.is_dir():
        raise StoreError(store, "no such directory: run gpujobs prepare with the same config")
    try:
        payload = read_store_json(store, layout.manifest)
    except FileNotFoundError:
        raise StoreError(store, NOT_PREPARED) from None
    except OSError as err:
        raise StoreError(store, f"its manifest.json cannot be read: {err.strerror}") from None
    if not isinstance(payload, dict) or "format_version" not in payload:
        raise StoreError(store, "its manifest.json is damaged: prepare it again")
    version = payload["format_version"]
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


def check_store(store: Path, parser: str, settings: dict[str, Any], verify: bool = False) -> Manifest:
    """The manifest of `store` when training may use it with `parser` and `settings`; else a StoreError.

    Refused: a missing or unfinished store, another format version, another parser, other settings, a folder
    or file that is not trusted (`store_files`), a shard whose shard.json is not the manifest's record of it
    (split, rows, columns, source), and a column file whose size or mtime is not what prepare recorded. With
    `verify`, also a column file whose sha256 is not (a change that kept its size and mtime): O(bytes).
    """
    manifest = read_manifest(store)
    if manifest.parser != parser:
        raise StoreError(store, f"prepared by parser {manifest.parser}, this job's parser is {parser}: "
                                f"prepare it again with this config, or point data.store elsewhere")
    difference = settings_difference(manifest.settings, settings)
    if difference:
        raise StoreError(store, f"{difference}: prepare it again with this config, or point data.store elsewhere")
    layout = StoreLayout(store)
    check_store_dir(store, layout.shards)
    specs = {spec.name: spec for spec in manifest.columns}
    for shard in manifest.shards:
        if sorted(column.name for column in shard.columns) != sorted(specs):
            raise StoreError(store, f"its manifest.json is damaged (shard {shard.name} does not hold the columns "
                                    f"{', '.join(specs)}): prepare it again")
        for column in shard.columns:
            _check_column_file(store, layout.shard_dir(shard.name), shard, column, specs.get(column.name), verify)
        _check_shard_record(store, layout, shard)
    return manifest


def _check_shard_record(store: Path, layout: StoreLayout, shard: ShardRecord) -> None:
    """Refuse a shard whose directory is not trusted, or whose shard.json is missing, damaged or not the
    manifest's record of it."""
    if not check_store_dir(store, layout.shard_dir(shard.name)):
        raise StoreError(store, f"shard {shard.name} is missing: prepare it again")
    try:
        found = shard_record_in(store, layout.shard_record(shard.name))
    except FileNotFoundError:
        raise StoreError(store, f"shard {shard.name}'s shard.json is missing: prepare it again") from None
    if found != shard:
        raise StoreError(store, f"shard {shard.name}'s shard.json is not the manifest's record of it (split, "
                                f"rows, columns or source): prepare it again")


def shard_record_in(store: Path, path: Path) -> ShardRecord | None:
    """The shard record in the shard.json `path` of `store`, None when it holds none (damaged); StoreError
    when it is not a trusted file (a link, a FIFO), FileNotFoundError when absent."""
    payload = read_store_json(store, path)
    try:
        return ShardRecord.from_json(payload) if isinstance(payload, dict) else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _check_column_file(store: Path, directory: Path, shard: ShardRecord, column: ColumnFile,
                       spec: ColumnSpec | None, verify: bool) -> None:
    """Refuse a column file that is missing, or not as prepare recorded it (size, mtime, rows x width; with
    `verify`, sha256)."""
    where = f"shard {shard.name}'s {column_file_name(column.name)}"
    if spec is None or column.size != shard.rows * spec.row_bytes():  # the reader's row offsets rely on it
        raise StoreError(store, f"its manifest.json is damaged ({where} does not hold {shard.rows} rows of "
                                f"the manifest's columns): prepare it again")
    path = directory / column_file_name(column.name)
    try:
        info = check_store_file(store, path)
    except FileNotFoundError:
        raise StoreError(store, f"{where} is missing: prepare it again") from None
    if info.st_size != column.size or info.st_mtime_ns != column.mtime_ns:
        raise StoreError(store, f"{where} changed after prepare: prepare it again")
    if verify and file_sha256(store, path) != column.sha256:
        raise StoreError(store, f"{where} changed after prepare (its sha256 is not the one recorded, though its "
                                f"size and mtime are): prepare it again")


def check_sources(store: Path, manifest: Manifest, split: str, key: str, files: tuple[Path, ...]) -> None:
    """Refuse (StoreError) a store whose `split` was not prepared from `files` as they are now (the config's
    `key`, globs expanded): its rows would not be the ones the config names."""
    prepared = [shard.source for shard in manifest.split_shards(split)]
    named = [SourceFile.of(path) for path in files]
    if [source.path for source in prepared] != [source.path for source in named]:
        missing = sorted({str(p) for p in files} - {s.path for s in prepared})
        extra = sorted({s.path for s in prepared} - {str(p) for p in files})
        what = (f"{key} names {missing[0]}, which it was not prepared from" if missing else
                f"it was prepared from {extra[0]}, which {key} does not name" if extra else
                f"its {split} files are not in the order of {key}")
        raise StoreError(store, f"{what}: prepare it again from this config's files")
    for before, now in zip(prepared, named, strict=True):
        if before != now:
            raise StoreError(store, f"{now.path} ({key}) changed after the store was prepared from it (size or "
                                    f"mtime): prepare it again")
