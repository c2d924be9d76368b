"""Tiny Criteo-format day files, and sample stores prepared from them, for the tests that train from a store.

The clicks follow a hidden rule on a few categorical features (so a model learns: its AUC means something)
and the files are made by a seeded generator, so every test run prepares the same store.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpujobs.data.layout import StoreLayout, shard_name
from gpujobs.data.manifest import (
    FORMAT_VERSION,
    ColumnFile,
    ColumnSpec,
    Manifest,
    ShardRecord,
    SourceFile,
)
from gpujobs.data.prepare import PreparePlan, prepare_store
from jobs.rec.criteo_store import CriteoParser

#: Values each categorical feature takes in the generated files (then hashed into data.hash_buckets).
VOCABULARY = 40


def criteo_text(rows: int, seed: int) -> str:
    """`rows` Criteo-format lines: label, 13 counts (some missing), 26 hex categoricals (some missing)."""
    rng = np.random.default_rng(seed)
    cats = rng.integers(0, VOCABULARY, size=(rows, 26))
    counts = rng.poisson(3.0, size=(rows, 13))
    weights = np.random.default_rng(1234).normal(0.0, 1.5, size=(4, VOCABULARY))  # the same rule in every file
    logit = sum(weights[k, cats[:, k]] for k in range(4)) + 0.2 * counts[:, 0] - 1.5
    labels = (rng.random(rows) < 1.0 / (1.0 + np.exp(-logit))).astype(int)
    lines = []
    for row in range(rows):
        ints = ["" if (row + k) % 7 == 0 else str(counts[row, k]) for k in range(13)]
        hexes = ["" if (row + k) % 11 == 0 else f"{cats[row, k] * 2654435761 % 2**32:08x}" for k in range(26)]
        lines.append("\t".join([str(labels[row]), *ints, *hexes]))
    return "\n".join(lines) + "\n"


def write_days(folder: Path, name: str, days: int, rows: int, seed: int = 0) -> list[Path]:
    """`days` gzip files `<name>_<d>.gz` of `rows` lines each, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for day in range(days):
        path = folder / f"{name}_{day}.gz"
        path.write_bytes(gzip.compress(criteo_text(rows, seed * 1000 + day).encode(), mtime=0))
        paths.append(path)
    return paths


def prepare(store: Path, train: list[Path], eval: list[Path], hash_buckets: int) -> Manifest:
    """The store of these files, prepared by `prepare_store` with the rec job's parser (one worker)."""
    plan = PreparePlan(store=store, splits={"train": tuple(train), "eval": tuple(eval)},
                       parser=CriteoParser(hash_buckets), bad_lines="fail")
    return prepare_store(plan, workers=1, log=lambda line: None)


def store_from_arrays(
    root: Path, parser: str, settings: dict[str, Any], columns: Sequence[ColumnSpec],
    splits: Mapping[str, Sequence[Mapping[str, np.ndarray] | int]],
) -> Manifest:
    """A finished store at `root` written from arrays, as prepare publishes one: each split's shards (column
    name -> array of the column's dtype, rows first; or a number of rows, all zero, as sparse files that
    take no disk), their records, then the manifest last.

    For tests that need a store of chosen values, or of billions of rows, without parsing any text."""
    layout, shards = StoreLayout(root), []
    for split, parts in splits.items():
        for index, arrays in enumerate(parts):
            name = shard_name(split, index)
            layout.shard_dir(name).mkdir(parents=True)
            files = []
            rows = arrays if isinstance(arrays, int) else len(arrays[columns[0].name])
            for spec in columns:
                path = layout.column_file(name, spec.name)
                if isinstance(arrays, int):
                    path.touch()
                    os.truncate(path, rows * spec.row_bytes())
                    digest = "not computed"
                else:
                    data = np.ascontiguousarray(arrays[spec.name], dtype=spec.dtype).tobytes()
                    path.write_bytes(data)
                    digest = hashlib.sha256(data).hexdigest()
                info = path.stat()
                files.append(ColumnFile(spec.name, info.st_size, info.st_mtime_ns, digest))
            record = ShardRecord(name, split, rows, SourceFile(f"/arrays/{name}", 0, 0), 0, tuple(files))
            layout.shard_record(name).write_text(json.dumps(record.to_json()))
            shards.append(record)
    manifest = Manifest(FORMAT_VERSION, parser, settings, tuple(columns), tuple(shards))
    layout.manifest.write_text(json.dumps(manifest.to_json()))
    return manifest
