"""What GPUs this machine has, asked of NVML (torch-free, so the submit side stays fast)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def local_gpu_count() -> int:
    """Number of NVIDIA GPUs NVML sees here; 0 where there is no driver or no NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no libnvidia-ml: no NVIDIA GPU on this machine
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
