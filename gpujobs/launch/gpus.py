"""What GPUs this machine has and which a local run should use, asked of NVML (torch-free).

Torch-free so the submit side stays fast; NVML itself is reached through `gpujobs.nvml`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpujobs.config import ResourcesConfig
from gpujobs.errors import ConfigError
from gpujobs.nvml import NvmlUnavailable, nvml_session, visible_gpus


def local_gpu_count() -> int:
    """Number of NVIDIA GPUs NVML sees here; 0 where there is no driver or no NVML."""
    try:
        with nvml_session() as nv:
            return int(nv.nvmlDeviceGetCount())
    except NvmlUnavailable:  # no libnvidia-ml: no NVIDIA GPU on this machine
        return 0


@dataclass(frozen=True)
class GpuLoad:
    """How busy one GPU is right now."""

    index: int
    """NVML's (PCI bus order) index: what CUDA_VISIBLE_DEVICES of the ranks will name."""
    util_pct: int
    free_gb: float


def gpu_loads() -> list[GpuLoad]:
    """Utilization and free memory of every GPU this process may use (CUDA_VISIBLE_DEVICES respected)."""
    with nvml_session() as nv:
        loads = []
        for gpu in visible_gpus(nv):
            mem = nv.nvmlDeviceGetMemoryInfo(gpu.handle)
            try:
                util = int(nv.nvmlDeviceGetUtilizationRates(gpu.handle).gpu)
            except nv.NVMLError:  # not reported: rank by free memory alone
                util = 0
            loads.append(GpuLoad(gpu.index, util, mem.free / 1e9))
        return loads


def pick_least_loaded(loads: list[GpuLoad], count: int, min_free_gb: float) -> list[int]:
    """The `count` least-busy GPUs with at least `min_free_gb` free (utilization, then free memory)."""
    fit = [gpu for gpu in loads if gpu.free_gb >= min_free_gb]
    if len(fit) < count:
        state = ", ".join(f"GPU {g.index}: {g.util_pct}% busy, {g.free_gb:.1f} GB free" for g in loads) or "none"
        raise ConfigError(
            "resources.gpus_per_node", count,
            f"at most {len(fit)} here: GPUs with >= {min_free_gb:g} GB free (resources.min_free_gpu_mem_gb); "
            f"now {state}",
        )
    chosen = sorted(fit, key=lambda g: (g.util_pct, -g.free_gb, g.index))[:count]
    return sorted(g.index for g in chosen)


def choose_local_gpus(res: ResourcesConfig) -> list[int]:
    """GPU indices for a local run: 0..gpus_per_node-1, or with `pick_gpus` the least-loaded ones."""
    if res.gpus_per_node == 0:
        return []
    if not res.pick_gpus:
        return list(range(res.gpus_per_node))
    return pick_least_loaded(gpu_loads(), res.gpus_per_node, res.min_free_gpu_mem_gb)
