"""Where a sample store keeps its files (torch-free); the one place their names are spelled.

```
STORE/manifest.json                      written last, atomically: its presence means "finished"
STORE/.prepare.lock                      flock'ed by the one prepare running; holds its pid and host
STORE/prepared_with.json                 the parser, settings and columns the shards were prepared with
STORE/shards/<split>-<NNNNN>/<col>.bin   raw little-endian fixed-width values, rows x width, C order
STORE/shards/<split>-<NNNNN>/shard.json  the shard's record, written last inside its directory
STORE/shards/.tmp-<split>-<NNNNN>-<pid>/ work in progress, renamed into place when complete
STORE/.prepare/                          a prepare queued as a job array: its task plan and logs
```

Prepare removes only entries of these names (`ours_in_store`, `ours_in_shards`, `ours_in_shard`): what
it finds of any other name is no store's, and is refused, never removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: The splits a store holds, in manifest order.
SPLITS = ("train", "eval")
#: A column's name is a file name stem.
COLUMN_NAME = re.compile(r"[a-z_][a-z0-9_]*")
#: What a dead prepare's work in progress is called; the next prepare removes it under the lock.
TEMP_PREFIX = ".tmp-"
#: The names in shards/: a published shard, a prepare's work in progress, an outdated shard moved aside.
_SHARD_NAME = rf"(?:{'|'.join(SPLITS)})-[0-9]{{5}}"
_SHARDS_ENTRY = re.compile(rf"{_SHARD_NAME}|{re.escape(TEMP_PREFIX)}{_SHARD_NAME}-[0-9]+(?:-replaced)?")
#: A file `gpujobs.base.atomic` writes before renaming it to its name.
_ATOMIC_TEMP = r"\.[^/]+\.tmp-[0-9a-f]{16}"
#: The names at the store's top: its records, the lock, shards/, a queued prepare's folder.
_STORE_ENTRY = re.compile(rf"manifest\.json|prepared_with\.json|\.prepare\.lock|shards|\.prepare|{_ATOMIC_TEMP}")
#: The names in a shard's directory: its column files, its record (and the record's temp file).
_SHARD_ENTRY = re.compile(rf"[a-z_][a-z0-9_]*\.bin|shard\.json|{_ATOMIC_TEMP}")


def ours_in_store(name: str) -> bool:
    """Whether `name` at the top of a store is one a prepare writes."""
    return bool(_STORE_ENTRY.fullmatch(name))


def ours_in_shards(name: str) -> bool:
    """Whether `name` in shards/ is one a prepare writes (a shard, or a temp dir of one)."""
    return bool(_SHARDS_ENTRY.fullmatch(name))


def ours_in_shard(name: str) -> bool:
    """Whether `name` in a shard's directory is one a prepare writes."""
    return bool(_SHARD_ENTRY.fullmatch(name))


def shard_name(split: str, index: int) -> str:
    """The name of the shard of input file `index` of `split`: "train-00003"."""
    return f"{split}-{index:05d}"


@dataclass(frozen=True)
class StoreLayout:
    """The paths of the store at `root`."""

    root: Path

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def lock(self) -> Path:
        return self.root / ".prepare.lock"

    @property
    def prepared_with(self) -> Path:
        """What the shards under shards/ were prepared with (parser, settings, columns), written by each
        prepare before its first shard: a prepare with anything else starts over."""
        return self.root / "prepared_with.json"

    @property
    def shards(self) -> Path:
        return self.root / "shards"

    def shard_dir(self, shard: str) -> Path:
        """The published directory of `shard`."""
        return self.shards / shard

    def temp_dir(self, shard: str, pid: int) -> Path:
        """Where process `pid` writes `shard` before publishing it."""
        return self.shards / f"{TEMP_PREFIX}{shard}-{pid}"

    def column_file(self, shard: str, column: str) -> Path:
        """The published values of `column` in `shard`."""
        return self.shard_dir(shard) / column_file_name(column)

    def shard_record(self, shard: str) -> Path:
        """The published record of `shard`."""
        return self.shard_dir(shard) / SHARD_RECORD


#: The record inside a shard's directory, written last.
SHARD_RECORD = "shard.json"


def column_file_name(column: str) -> str:
    """The file name of `column`'s values inside a shard directory."""
    return f"{column}.bin"
