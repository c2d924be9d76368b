"""Criteo-format lines and `CriteoParser`, which prepares them into a sample store (numpy + numba, no torch).

A line: the label (0 or 1), 13 integer features, 26 categorical features (hex strings in the Criteo
release; any UTF-8 string works), tab-separated; every field but the label may be empty, meaning missing.
The rules for one line (`split_fields`, `label_value`, `integer_feature_value`, `category_index`) are the
ones `jobs.rec.criteo.read_criteo_tsv` applies; the parser applies the same rules to whole blocks in one
compiled pass (`jobs.rec.criteo_scan`), and falls back to them line by line only for a block with a line
the pass does not read (a damaged line, or a form only Python's `int()` reads, such as " 5" or "1_000").
The parser is torch-free so that prepare's worker processes start without importing torch.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from gpujobs.base.errors import GpujobsError
from gpujobs.data.manifest import ColumnSpec
from gpujobs.data.prepare import BAD_LINES, BadLineError, ParsedChunk
from jobs.rec.features import CRITEO_CATEGORICAL as NUM_CATEGORICAL
from jobs.rec.features import CRITEO_INTEGER as NUM_INTEGER
from jobs.rec.features import column_buckets

NUM_COLUMNS = 1 + NUM_INTEGER + NUM_CATEGORICAL

class CriteoFormatError(GpujobsError, ValueError):
    """A line of a Criteo-format file cannot be parsed; the message names the file and line."""


def split_fields(line: str, path: str | Path, number: int) -> list[str]:
    """The 40 fields of `line` (its line end stripped); CriteoFormatError if it has another count."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != NUM_COLUMNS:
        raise CriteoFormatError(
            f"{path}:{number}: expected {NUM_COLUMNS} tab-separated fields "
            f"(label, {NUM_INTEGER} integer, {NUM_CATEGORICAL} categorical), got {len(fields)}"
        )
    return fields


def label_value(text: str, path: str | Path, number: int) -> float:
    """The label "0" or "1" as a float; CriteoFormatError for anything else."""
    if text not in ("0", "1"):
        raise CriteoFormatError(f"{path}:{number}: label {text!r} is not 0 or 1")
    return float(text)


def integer_feature_value(text: str, path: str | Path, number: int, column: int) -> float:
    """log1p(max(x, 0)) of the integer `text` (counts are heavy-tailed; Criteo has a few negatives), 0 if empty."""
    if not text:
        return 0.0
    try:
        value = int(text)
    except ValueError:
        raise CriteoFormatError(f"{path}:{number}: integer feature I{column} is {text!r}, not an integer") from None
    return math.log1p(max(value, 0))


def category_index(value: str, hash_buckets: int) -> int:
    """1 + crc32(value) % hash_buckets, 0 if missing; crc32, unlike Python's salted hash(), is the same everywhere."""
    return 1 + zlib.crc32(value.encode()) % hash_buckets if value else 0


@dataclass(frozen=True)
class CriteoParser:
    """The store's RowParser for Criteo-format files (plain, or compressed as their extension says: .gz).

    Columns: `label` |u1 (0 or 1: exact in one byte, a quarter of a float's disk and page cache; the
    reader makes it a float per batch), `dense` <f4 x 13 (log1p(max(x, 0)), missing 0), `sparse` <i4 x 26
    (1 + crc32(value) % buckets[c] in column c, missing 0): the values `read_criteo_tsv` gives, sparse
    included. Only `hash_buckets` changes the output; `block_bytes` and `threads` change speed and memory.
    """

    hash_buckets: int | Sequence[int]
    """Buckets of every categorical column, or of each (26 counts): `jobs.rec.features.column_buckets`."""
    block_bytes: int = 4 << 20
    """Decompressed bytes parsed at once (a few MB stay in cache): what a damaged line makes re-read in Python."""
    threads: int = 1
    """Blocks parsed at once, a thread each (pyarrow and numpy release the GIL): 1 where prepare runs a worker
    process per core; the cores a worker has to itself otherwise (one big file: one worker, all cores)."""
    _buckets: np.ndarray = field(init=False, repr=False, compare=False)
    """int64 [26]: each column's buckets, as the compiled scan reads them (set from hash_buckets)."""

    name: ClassVar[str] = "jobs.rec.criteo_store:CriteoParser"

    def __post_init__(self) -> None:
        buckets = column_buckets(self.hash_buckets)  # ValueError naming hash_buckets
        if not isinstance(self.hash_buckets, int):
            object.__setattr__(self, "hash_buckets", buckets)  # a tuple: the parser stays frozen and hashable
        object.__setattr__(self, "_buckets", np.array(buckets, dtype=np.int64))  # what the compiled scan reads
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes={self.block_bytes} is invalid: allowed >= 1")
        if self.threads < 1:
            raise ValueError(f"threads={self.threads} is invalid: allowed >= 1")

    def columns(self) -> tuple[ColumnSpec, ...]:
        """label, dense, sparse (see the class docstring)."""
        return (ColumnSpec("label", "|u1", 1), ColumnSpec("dense", "<f4", NUM_INTEGER),
                ColumnSpec("sparse", "<i4", NUM_CATEGORICAL))

    def settings(self) -> dict[str, Any]:
        """What changes the output, recorded in the manifest and compared when a store is opened: hash_buckets
        as one count where every column has it (what an int config has always recorded), else the list."""
        buckets = column_buckets(self.hash_buckets)
        recorded = buckets[0] if len(set(buckets)) == 1 else list(buckets)
        return {"hash_buckets": recorded, "hash": "crc32", "dense": "log1p"}

    def parse(self, path: Path, bad_lines: str) -> Iterator[ParsedChunk]:
        """The rows of the file at `path`, a block at a time; an empty file has none.

        bad_lines "fail": BadLineError "path:line: what is wrong" at the first damaged line; "skip": damaged
        lines are left out and counted in the chunk's `bad_lines`.
        """
        if bad_lines not in BAD_LINES:
            raise ValueError(f"bad_lines={bad_lines!r} is invalid: allowed {' or '.join(BAD_LINES)}")
        first_line = 1
        try:
            for block, chunk in self._fast_blocks(path):
                if chunk is None:
                    chunk = self._careful_block(path, block, first_line, bad_lines)
                    first_line += block.count(b"\n")
                else:  # a row per line (the last one may lack its line end, but no line follows it)
                    first_line += len(chunk.columns["label"])
                yield chunk
        except (OSError, pa.ArrowInvalid) as err:  # a damaged compressed file
            raise BadLineError(f"{path}:{first_line}: the file cannot be read from here on ({err})") from None

    def _fast_blocks(self, path: Path) -> Iterator[tuple[bytes, ParsedChunk | None]]:
        """Each block of the file with its `_fast_block` result, in order, up to `threads` blocks at once."""
        blocks = _line_blocks(path, self.block_bytes)
        if self.threads == 1:
            yield from ((block, self._fast_block(block)) for block in blocks)
            return
        with ThreadPoolExecutor(self.threads) as pool:
            pending: deque[tuple[bytes, Future[ParsedChunk | None]]] = deque()
            for block in blocks:
                pending.append((block, pool.submit(self._fast_block, block)))
                if len(pending) > self.threads:  # bounded: memory stays a few blocks per thread
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()

    def _fast_block(self, block: bytes) -> ParsedChunk | None:
        """The block's rows in one compiled pass; None when a line needs the line-by-line rules.

        A block that is not all ASCII is checked as UTF-8 text first, as Python's decode does (the pass reads a
        category's bytes as its text's `encode()`); a byte-order mark fails the pass, as its label is not 0/1.
        """
        from jobs.rec.criteo_scan import CRC_TABLE, LOG1P_TABLE, scan_block

        if not block.isascii():
            try:
                block.decode("utf-8")
            except UnicodeDecodeError:
                return None
        rows = block.count(b"\n") + (not block.endswith(b"\n"))
        label = np.empty(rows, dtype=np.uint8)
        dense = np.empty((rows, NUM_INTEGER), dtype=np.float32)
        sparse = np.empty((rows, NUM_CATEGORICAL), dtype=np.int32)
        data = np.frombuffer(block, dtype=np.uint8)
        if scan_block(data, self._buckets, CRC_TABLE, LOG1P_TABLE, label, dense, sparse) != rows:
            return None
        return ParsedChunk(columns={"label": label, "dense": dense, "sparse": sparse}, bad_lines=0)

    def _careful_block(self, path: Path, block: bytes, first_line: int, bad_lines: str) -> ParsedChunk:
        """The block line by line with the rules of `read_criteo_tsv`: names the damaged line, or skips it."""
        labels: list[float] = []
        dense: list[float] = []
        sparse: list[int] = []
        skipped = 0
        lines = block.split(b"\n")
        if block.endswith(b"\n"):
            lines.pop()  # the empty text after the last line end is not a line
        for number, raw in enumerate(lines, start=first_line):
            try:
                label, integers, categories = self._line(raw, path, number)
            except CriteoFormatError as err:
                if bad_lines == "fail":
                    raise BadLineError(str(err)) from None
                skipped += 1
                continue
            labels.append(label)
            dense.extend(integers)
            sparse.extend(categories)
        return ParsedChunk(
            columns={"label": np.array(labels, dtype=np.uint8),
                     "dense": np.array(dense, dtype=np.float32).reshape(-1, NUM_INTEGER),
                     "sparse": np.array(sparse, dtype=np.int32).reshape(-1, NUM_CATEGORICAL)},
            bad_lines=skipped,
        )

    def _line(self, raw: bytes, path: Path, number: int) -> tuple[float, list[float], list[int]]:
        """(label, 13 dense values, 26 indices) of one line; CriteoFormatError naming path:number if damaged."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise CriteoFormatError(f"{path}:{number}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        fields = split_fields(text, path, number)
        label = label_value(fields[0], path, number)
        integers = [integer_feature_value(fields[c], path, number, c) for c in range(1, 1 + NUM_INTEGER)]
        categories = [category_index(value, int(buckets))
                      for value, buckets in zip(fields[1 + NUM_INTEGER :], self._buckets, strict=True)]
        return label, integers, categories


def _line_blocks(path: Path, block_bytes: int) -> Iterator[bytes]:
    """Whole lines of about `block_bytes` of the decompressed file (compressed as its extension says), in order."""
    carry = b""
    with pa.input_stream(str(path), compression="detect") as stream:
        while piece := stream.read(block_bytes):
            data = carry + piece
            cut = data.rfind(b"\n") + 1  # 0: no line end yet, a line longer than a block: read on
            block, carry = data[:cut], data[cut:]
            if block:
                yield block
    if carry:
        yield carry  # the last line, without a line end

