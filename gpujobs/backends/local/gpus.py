"""What GPUs this machine has and which a local run should use, asked of NVML (torch-free).

Torch-free so the submit side stays fast; NVML itself is reached through `gpujobs.base.nvml`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpujobs.base.errors import ConfigError
from gpujobs.base.nvml import NvmlUnavailable, nvml_session, visible_gpus
from gpujobs.config.load import ResourcesConfig


def local_gpu_count() -> int:
    """Number of GPUs this process may use here (those CUDA_VISIBLE_DEVICES names, else every GPU NVML
    sees); 0 where there is no driver or no NVML."""
    try:
        with nvml_session() as nv:
            return len(visible_gpus(nv))
    except NvmlUnavailable:  # no libnvidia-ml: no NVIDIA GPU on this machine
        return 0


@dataclass(frozen=True)
class GpuLoad:
    """How busy one GPU is right now."""

    index: int
    """NVML's (PCI bus order) index, for the user to read."""
    uuid: str
    """What CUDA_VISIBLE_DEVICES of the ranks will name (`GPU-...`, or `MIG-...` for a slice)."""
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
            loads.append(GpuLoad(gpu.index, gpu.uuid, util, mem.free / 1e9))
        return loads


def pick_least_loaded(loads: list[GpuLoad], count: int, min_free_gb: float) -> list[GpuLoad]:
    """The `count` least-busy GPUs with at least `min_free_gb` free (utilization, then free memory), in
    NVML's order."""
    fit = [gpu for gpu in loads if gpu.free_gb >= min_free_gb]
    if len(fit) < count:
        state = ", ".join(f"GPU {g.index}: {g.util_pct}% busy, {g.free_gb:.1f} GB free" for g in loads) or "none"
        raise ConfigError(
            "resources.gpus_per_node", count,
            f"at most {len(fit)} here: GPUs with >= {min_free_gb:g} GB free (resources.min_free_gpu_mem_gb); "
            f"now {state}",
        )
    chosen = sorted(fit, key=lambda g: (g.util_pct, -g.free_gb, g.index))[:count]
    return sorted(chosen, key=lambda g: g.index)


def choose_local_gpus(res: ResourcesConfig) -> list[GpuLoad]:
    """The GPUs of a local run, among those this process may use (CUDA_VISIBLE_DEVICES honoured): the
    first gpus_per_node of them in its order, or with `pick_gpus` the least-loaded ones."""
    if res.gpus_per_node == 0:
        return []
    loads = gpu_loads()
    if not res.pick_gpus:
        return loads[: res.gpus_per_node]
    return pick_least_loaded(loads, res.gpus_per_node, res.min_free_gpu_mem_gb)
