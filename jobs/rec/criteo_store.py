"""Criteo-format lines and `CriteoParser`, which prepares them into a sample store (numpy + pyarrow, no torch).

A line: the label (0 or 1), 13 integer features, 26 categorical features (hex strings in the Criteo
release; any UTF-8 string works), tab-separated; every field but the label may be empty, meaning missing.
The rules for one line (`split_fields`, `label_value`, `integer_feature_value`, `category_index`) are the
ones `jobs.rec.criteo.read_criteo_tsv` applies; the parser applies the same rules to whole blocks with
pyarrow's CSV reader and numpy, and falls back to them line by line only for a block pyarrow cannot read
exactly as they would (a damaged line, an integer Python reads and pyarrow does not, or the reverse).
The parser is torch-free so that prepare's worker processes start without importing torch.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.csv as pa_csv

from gpujobs.base.errors import GpujobsError
from gpujobs.data.manifest import ColumnSpec
from gpujobs.data.prepare import BAD_LINES, BadLineError, ParsedChunk

NUM_INTEGER = 13
NUM_CATEGORICAL = 26
NUM_COLUMNS = 1 + NUM_INTEGER + NUM_CATEGORICAL
MAX_HASH_BUCKETS = 2**31 - 2
"""The most hash buckets: an index 1 + crc % hash_buckets <= 2**31 - 2 fits the store's int32 column."""

_COLUMN_NAMES = [f"c{i}" for i in range(NUM_COLUMNS)]
# The label and the categoricals dictionary-encoded: a block has few distinct values per column, so hashing
# (and checking as UTF-8, as Python's decode does) the dictionary costs far less than doing it for every row.
_TEXT = pa.dictionary(pa.int32(), pa.binary())
_CONVERT = pa_csv.ConvertOptions(
    column_types={name: _TEXT if i == 0 or i > NUM_INTEGER else pa.int64() for i, name in enumerate(_COLUMN_NAMES)},
    null_values=[""],  # only an empty field is missing: pyarrow's default would also read "NA", "nan"... as null
    strings_can_be_null=False,
    quoted_strings_can_be_null=False,
)
# No quoting (a quote is data), and an empty line is a damaged line (1 field), as for read_criteo_tsv.
_PARSE = pa_csv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False, ignore_empty_lines=False)
# pyarrow reads "0x1f" as the integer 31; Python's int() refuses it. A block with such a field goes the slow way
# (found by a regular expression only in a block with an "x" at all: Criteo's hex strings have none).
_HEX_FIELD = re.compile(rb"(?:^|\t) *[+-]?0[xX]", re.MULTILINE)
_UTF8_BOM = b"\xef\xbb\xbf"  # pyarrow skips it at the start of a file; Python's utf-8 codec keeps it


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


def _crc32_table() -> np.ndarray:
    """The byte table of the reflected CRC-32 (polynomial 0xEDB88320) that zlib.crc32 computes."""
    crc = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        crc = np.where(crc & 1, (crc >> 1) ^ np.uint32(0xEDB88320), crc >> 1).astype(np.uint32)
    return crc


_CRC_TABLE = _crc32_table()


def crc32_of_strings(strings: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(zlib.crc32 of each string's UTF-8 bytes as uint32, each string's byte length), vectorised.

    Loops over byte positions (up to the longest string), not over strings: each step advances every
    string that is still that long by one byte, straight from the Arrow offsets and data buffers.
    """
    count = len(strings)
    _, offsets_buffer, data_buffer = strings.buffers()
    offsets = np.frombuffer(offsets_buffer, dtype=np.int32, count=count + 1, offset=strings.offset * 4)
    data = np.frombuffer(data_buffer, dtype=np.uint8) if data_buffer is not None and data_buffer.size else None
    starts, lengths = offsets[:-1], np.diff(offsets)
    crc = np.full(count, 0xFFFFFFFF, dtype=np.uint32)
    if data is None:
        return crc ^ np.uint32(0xFFFFFFFF), lengths
    last = len(data) - 1
    for position in range(int(lengths.max()) if count else 0):
        byte = data[np.minimum(starts + position, last)]
        advanced = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
        crc = np.where(lengths > position, advanced, crc)
    return crc ^ np.uint32(0xFFFFFFFF), lengths


@dataclass(frozen=True)
class CriteoParser:
    """The store's RowParser for Criteo-format files (plain, or compressed as their extension says: .gz).

    Columns: `label` |u1 (0 or 1: exact in one byte, a quarter of a float's disk and page cache; the
    reader makes it a float per batch), `dense` <f4 x 13 (log1p(max(x, 0)), missing 0), `sparse` <i4 x 26
    (1 + crc32(value) % hash_buckets, missing 0): the values `read_criteo_tsv` gives, sparse included.
    Only `hash_buckets` changes the output; `block_bytes` and `threads` change speed and memory.
    """

    hash_buckets: int
    block_bytes: int = 4 << 20
    """Decompressed bytes parsed at once (a few MB stay in cache): what a damaged line makes re-read in Python."""
    threads: int = 1
    """Blocks parsed at once, a thread each (pyarrow and numpy release the GIL): 1 where prepare runs a worker
    process per core; the cores a worker has to itself otherwise (one big file: one worker, all cores)."""

    name: ClassVar[str] = "jobs.rec.criteo_store:CriteoParser"

    def __post_init__(self) -> None:
        if not 1 <= self.hash_buckets <= MAX_HASH_BUCKETS:
            raise ValueError(
                f"hash_buckets={self.hash_buckets} is invalid: allowed 1..{MAX_HASH_BUCKETS} (int32 indices)")
        if self.block_bytes < 1:
            raise ValueError(f"block_bytes={self.block_bytes} is invalid: allowed >= 1")
        if self.threads < 1:
            raise ValueError(f"threads={self.threads} is invalid: allowed >= 1")

    def columns(self) -> tuple[ColumnSpec, ...]:
        """label, dense, sparse (see the class docstring)."""
        return (ColumnSpec("label", "|u1", 1), ColumnSpec("dense", "<f4", NUM_INTEGER),
                ColumnSpec("sparse", "<i4", NUM_CATEGORICAL))

    def settings(self) -> dict[str, Any]:
        """What changes the output, recorded in the manifest and compared when a store is opened."""
        return {"hash_buckets": self.hash_buckets, "hash": "crc32", "dense": "log1p"}

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
                else:  # pyarrow read every line as a row (a stray "\r" would have broken a row's 40 fields)
                    first_line += len(chunk.columns["label"])
                yield chunk
        except (OSError, pa.ArrowInvalid) as err:  # a damaged compressed file
            raise BadLineError(f"{path}:{first_line}: the file cannot be read from here on ({err})") from None

    def _fast_blocks(self, path: Path) -> Iterator[tuple[bytes, ParsedChunk | None]]:
        """Each block of the file with its `_fast_block` result, in order, up to `threads` blocks at once."""
        blocks = enumerate(_line_blocks(path, self.block_bytes))
        if self.threads == 1:
            yield from ((block, self._fast_block(block, number == 0)) for number, block in blocks)
            return
        with ThreadPoolExecutor(self.threads) as pool:
            pending: deque[tuple[bytes, Future[ParsedChunk | None]]] = deque()
            for number, block in blocks:
                pending.append((block, pool.submit(self._fast_block, block, number == 0)))
                if len(pending) > self.threads:  # bounded: memory stays a few blocks per thread
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()

    def _fast_block(self, block: bytes, first: bool) -> ParsedChunk | None:
        """The block's rows by pyarrow and numpy; None when the block needs the line-by-line rules."""
        if (first and block.startswith(_UTF8_BOM)) or (
            (b"x" in block or b"X" in block) and _HEX_FIELD.search(block)
        ):
            return None
        # One pyarrow block per block: threads, where wanted, parse whole blocks side by side instead.
        read = pa_csv.ReadOptions(column_names=_COLUMN_NAMES, use_threads=False, block_size=len(block) + 1)
        try:
            table = pa_csv.read_csv(pa.BufferReader(block), read_options=read, parse_options=_PARSE,
                                    convert_options=_CONVERT)
        except pa.ArrowInvalid:  # a damaged line somewhere: pyarrow does not say which line in the file
            return None
        labels = _labels(table.column(0))
        if labels is None:
            return None
        try:
            sparse = self._sparse(table)
        except pa.ArrowInvalid:  # a category that is not UTF-8 text
            return None
        return ParsedChunk(columns={"label": labels, "dense": _dense(table), "sparse": sparse}, bad_lines=0)

    def _sparse(self, table: pa.Table) -> np.ndarray:
        """[rows, 26] int32 category indices: each distinct string of the block hashed once, then gathered.

        The dictionaries of all 26 columns are hashed in one pass: per-call numpy overhead, not the bytes,
        is what a pass over a few thousand strings costs.
        """
        parts = [(j, chunk) for j in range(NUM_CATEGORICAL) for chunk in table.column(1 + NUM_INTEGER + j).chunks]
        # cast: ArrowInvalid if a category is not UTF-8 text
        strings = pa.concat_arrays([chunk.dictionary for _, chunk in parts]).cast(pa.string())
        crc, lengths = crc32_of_strings(strings)
        index = np.where(lengths == 0, 0, 1 + crc.astype(np.int64) % self.hash_buckets).astype(np.int32)
        by_column = np.empty((NUM_CATEGORICAL, table.num_rows), dtype=np.int32)  # contiguous writes, then one transpose
        rows = [0] * NUM_CATEGORICAL  # each column's next row: its chunks come in order
        first = 0  # where the part's dictionary starts in `strings`
        for j, chunk in parts:
            np.take(index, first + chunk.indices.to_numpy(), out=by_column[j, rows[j] : rows[j] + len(chunk)])
            rows[j] += len(chunk)
            first += len(chunk.dictionary)
        return np.ascontiguousarray(by_column.T)

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
        categories = [category_index(value, self.hash_buckets) for value in fields[1 + NUM_INTEGER :]]
        return label, integers, categories


def _labels(column: pa.ChunkedArray) -> np.ndarray | None:
    """The labels as uint8 0/1 from their dictionary-encoded text; None if any is not "0" or "1"."""
    parts = []
    for chunk in column.chunks:
        codes = {b"0": 0, b"1": 1}
        values = chunk.dictionary.to_pylist()  # a handful of distinct strings per block
        if any(value not in codes for value in values):
            return None
        parts.append(np.array([codes[value] for value in values], dtype=np.uint8)[chunk.indices.to_numpy()])
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.uint8)


def _dense(table: pa.Table) -> np.ndarray:
    """[rows, 13] float32 log1p(max(x, 0)), missing 0, computed in float64 as math.log1p does."""
    out = np.empty((table.num_rows, NUM_INTEGER), dtype=np.float32)
    for j in range(NUM_INTEGER):
        counts = table.column(1 + j).to_numpy()  # float64 with NaN where missing, or int64 where none is
        out[:, j] = np.log1p(np.fmax(counts, 0))  # fmax: NaN (missing) -> 0; log1p in float64, then float32
    return out


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

