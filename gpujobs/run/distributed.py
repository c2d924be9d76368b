"""The process group and each rank's device (the job environment itself is read in `jobenv`)."""

from __future__ import annotations

import datetime
import gc
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from gpujobs.nccl import NcclSettings
from gpujobs.run.jobenv import DistInfo, export_torchrun_env


def device_for(info: DistInfo) -> torch.device:
    """One GPU per rank where CUDA exists, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", info.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_process_group(info: DistInfo, nccl: NcclSettings, timeout_s: int) -> Optional[str]:
    """Apply NCCL settings, then join the group (nccl on CUDA, gloo otherwise); None for one rank."""
    os.environ.update(nccl.to_env())  # before the group exists: NCCL reads them at init
    if info.world_size == 1:
        return None
    export_torchrun_env(info)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device_for(info))
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return backend


def destroy_process_group() -> None:
    """Leave the group if we joined one. Call after dropping every DDP wrapper (see below)."""
    if dist.is_available() and dist.is_initialized():
        # Gloo's worker threads free finished work (and its tensors) after the caller has moved on,
        # and need the GIL to do so. If the group's destructor runs while one of them still holds such
        # work, the destructor waits for the worker's lock holding the GIL the worker waits for: a
        # deadlock seen at the end of resumed runs. Collect, then block briefly without the GIL so the
        # workers go idle before the last reference goes.
        gc.collect()
        time.sleep(0.1)
        dist.destroy_process_group()


def gather_ranks(info: DistInfo) -> list[dict[str, Any]]:
    """Every rank's place (node, local rank, visible GPUs), in rank order; one all-gather at start."""
    mine = {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "node": info.node,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * info.world_size
    dist.all_gather_object(everyone, mine)
    return everyone
