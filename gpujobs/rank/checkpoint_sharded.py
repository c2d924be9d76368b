"""Sharded state in a checkpoint (`parallel=torchrec`'s tables): every rank's shards written through
`torch.distributed.checkpoint`, inside the agreed-checkpoint protocol.

`save_sharded` is collective (DCP plans the write on every rank, rank 0 writes its `.metadata`); each rank
then lists the files it wrote with their sizes and CRC-32s, which go into the marker with the rest, so
nothing is published until every rank's shards are durable, and a resume verifies them as it verifies
every other file (`verify_share`: each rank checks its share of the files, whatever world size wrote them).
`load_sharded` fills a state dict of this rank's shards from them, under whatever plan it has now: a
resume at another world size reshards.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from gpujobs.base.atomic import fsync_path
from gpujobs.rank.checkpoint_files import entry_of, verify_file
from gpujobs.rundir.marker import FileEntry, Marker

#: The directory of a checkpoint that holds its sharded state.
SHARDED_DIR = "sharded"
_METADATA = ".metadata"


def save_sharded(state: dict[str, Any], directory: Path, rank: int,
                 group: Optional[dist.ProcessGroup]) -> dict[str, FileEntry]:
    """Collective: write `state` (ShardedTensors and plain values) into `directory` through DCP, fsynced; the
    marker entries of the files this rank wrote (named `sharded/<file>`)."""
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=1)
    dcp.save(state, storage_writer=writer, process_group=group)
    fsync_path(directory)
    names = [name for name in os.listdir(directory) if name.startswith(f"__{rank}_")]
    if rank == 0:
        names.append(_METADATA)
    return {f"{SHARDED_DIR}/{name}": entry_of(directory / name) for name in sorted(names)}


def sharded_files(marker: Marker) -> list[str]:
    """The sharded state's files a marker lists, sorted."""
    return sorted(name for name in marker.files if name.startswith(f"{SHARDED_DIR}/"))


def verify_share(step_dir: Path, marker: Marker, rank: int, world_size: int) -> None:
    """Check this rank's share of the sharded files (every world_size-th, from `rank`) against the marker;
    ValueError or OSError saying which is wrong. Every file is checked by one rank."""
    for name in sharded_files(marker)[rank::world_size]:
        verify_file(step_dir / name, marker.files[name])


def load_sharded(state: dict[str, Any], directory: Path, group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective: fill `state` (this rank's shards, as the current plan lays them out) from `directory`."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(directory), process_group=group)
