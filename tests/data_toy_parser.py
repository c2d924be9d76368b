"""A toy row parser for the store's tests: "label<TAB>count<TAB>word" lines, plain or gzip.

It stands in for a job's parser (jobs.rec.criteo) so the generic store is tested apart from any job.
Columns: label (|u1), count (<i8), word (<i8 x 2: crc32(word) % buckets, and the word's length).
Damaged lines: another number of fields, a label that is not 0 or 1, a count that is not an integer.
TOY_PARSER_DELAY (seconds, per chunk) slows it down, so a test can kill a prepare mid-way.

Importable by spawned worker processes: they inherit the parent's sys.path, where pytest put tests/.
"""

from __future__ import annotations

import gzip
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from gpujobs.data.manifest import ColumnSpec
from gpujobs.data.prepare import BadLineError, ParsedChunk


@dataclass(frozen=True)
class ToyParser:
    """The toy format's parser; `buckets` changes its output, `chunk_rows` only its pace."""

    buckets: int = 1000
    chunk_rows: int = 100
    name: str = "data_toy_parser:ToyParser"

    def columns(self) -> tuple[ColumnSpec, ...]:
        return (ColumnSpec("label", "|u1", 1), ColumnSpec("count", "<i8", 1), ColumnSpec("word", "<i8", 2))

    def settings(self) -> dict[str, Any]:
        return {"buckets": self.buckets, "hash": "crc32"}

    def parse(self, path: Path, bad_lines: str) -> Iterator[ParsedChunk]:
        delay = float(os.environ.get("TOY_PARSER_DELAY", "0"))
        rows: list[tuple[int, int, int, int]] = []
        bad = 0
        with _open(path) as lines:
            for number, line in enumerate(lines, start=1):
                try:
                    rows.append(self._row(line))
                except ValueError as err:
                    if bad_lines == "fail":
                        raise BadLineError(f"{path.name}:{number}: {err}") from None
                    bad += 1
                if len(rows) == self.chunk_rows:
                    yield self._chunk(rows, bad)
                    rows, bad = [], 0
                    time.sleep(delay)
        if rows or bad:
            yield self._chunk(rows, bad)

    def _row(self, line: str) -> tuple[int, int, int, int]:
        fields = line.rstrip("\n").split("\t")
        if len(fields) != 3:
            raise ValueError(f"expected 3 tab-separated fields, got {len(fields)}")
        if fields[0] not in ("0", "1"):
            raise ValueError(f"label {fields[0]!r} is not 0 or 1")
        try:
            count = int(fields[1])
        except ValueError:
            raise ValueError(f"count {fields[1]!r} is not an integer") from None
        return int(fields[0]), count, zlib.crc32(fields[2].encode()) % self.buckets, len(fields[2])

    def _chunk(self, rows: list[tuple[int, int, int, int]], bad: int) -> ParsedChunk:
        table = np.array(rows, dtype=np.int64).reshape(-1, 4)
        return ParsedChunk({"label": table[:, 0].astype(np.uint8), "count": table[:, 1].copy(),
                            "word": table[:, 2:].copy()}, bad)


def _open(path: Path) -> IO[str]:
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", newline="\n")
    return open(path, encoding="utf-8", newline="\n")


def write_toy_file(path: Path, rows: int, seed: int, damaged: dict[int, str] | None = None) -> Path:
    """A toy input file of `rows` lines from `seed` (gzip when the name ends in .gz); `damaged`: line
    number (1-based) -> the text put there instead."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    lines = [f"{rng.integers(0, 2)}\t{rng.integers(-50, 10**6)}\t{words[rng.integers(0, len(words))]}{i % 7}"
             for i in range(rows)]
    for number, text in (damaged or {}).items():
        lines[number - 1] = text
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def main(spec_json: str) -> int:
    """Prepare a store in this process as `spec_json` says (the tests' subprocess driver); 2 on a
    GpujobsError, printed as one line, as the CLI would.

    Spec: store, train, eval (lists of paths), workers, bad_lines, chunk_rows, and fsize_limit (bytes, or
    null): the largest file this process may write, as a full disk (SIGXFSZ ignored, a write raises EFBIG).
    """
    import json
    import resource
    import signal
    import sys

    from gpujobs.base.errors import GpujobsError
    from gpujobs.data.prepare import PreparePlan, prepare_store

    spec = json.loads(spec_json)
    if spec.get("fsize_limit"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], spec["fsize_limit"]))
    plan = PreparePlan(Path(spec["store"]), {split: tuple(Path(p) for p in spec[split]) for split in ("train", "eval")},
                       ToyParser(chunk_rows=spec.get("chunk_rows", 100)), spec.get("bad_lines", "fail"))
    try:
        prepare_store(plan, spec.get("workers", 1), log=lambda line: print(line, flush=True))
    except GpujobsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
