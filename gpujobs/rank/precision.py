"""The precision a job trains in: `trainer.amp` and the compute capability of the job's GPUs.

`amp=auto` means bf16 autocast where the GPUs compute in bf16 natively: Ampere (compute capability 8.0)
and newer. Before Ampere (V100 7.0, T4 7.5) bf16 is emulated and a step is several times slower than in
fp32, so `auto` trains those in fp32. It does not switch to fp16 there: fp16 needs a gradient scaler,
whose state every checkpoint would have to carry and whose overflow-skipped steps a run would have to
report, and a job requeued from an A100 onto a V100 would change its numerics class mid-run. fp32 keeps
the checkpoint format and the loss curve's kind whatever the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from gpujobs.rank import collectives

log = logging.getLogger(__name__)

BF16_CAPABILITY = (8, 0)
"""The first CUDA compute capability (Ampere) with bf16 tensor cores."""


def autocast_dtype(amp: str, capabilities: Sequence[tuple[int, int]]) -> Optional[torch.dtype]:
    """The autocast dtype of a job (None: fp32, no autocast) for `trainer.amp`, given the compute capability
    of every rank's GPU (empty for CPU ranks).

    auto: bf16 when every GPU of the job has native bf16, else fp32 (a mixed job trains in one precision on
    all ranks, as a job on its slowest GPUs would); bf16: bf16 wherever it runs; off: fp32.
    """
    if amp == "bf16":
        return torch.bfloat16
    if amp == "auto" and capabilities and min(capabilities) >= BF16_CAPABILITY:
        return torch.bfloat16
    return None


def describe(dtype: Optional[torch.dtype], capabilities: Sequence[tuple[int, int]]) -> str:
    """The precision chosen and the GPUs it was chosen for, for the log: "bf16 (compute capability 9.0)"."""
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    if not capabilities:
        return f"{name} (CPU)"
    seen = ", ".join(f"{major}.{minor}" for major, minor in sorted(set(capabilities)))
    return f"{name} (compute capability {seen})"


def emulated_bf16(amp: str, capabilities: Sequence[tuple[int, int]]) -> Optional[str]:
    """What to warn of when the job's GPUs lack native bf16 (None when they have it, or on CPU): `auto`
    chose fp32 for the user, or `bf16` asked for the slow emulation."""
    older = sorted({c for c in capabilities if c < BF16_CAPABILITY})
    if not older or amp == "off":
        return None
    seen = ", ".join(f"{major}.{minor}" for major, minor in older)
    if amp == "auto":
        return (f"trainer.amp=auto trains in fp32: GPUs of compute capability {seen} have no native bf16 "
                f"(8.0, Ampere, and newer do)")
    return (f"trainer.amp=bf16 on GPUs of compute capability {seen}: bf16 is emulated there, slower than fp32 "
            f"(trainer.amp=auto trains them in fp32)")


def gpu_capabilities(device: torch.device) -> list[tuple[int, int]]:
    """Every rank's CUDA compute capability (empty on CPU ranks), so that all ranks choose one precision;
    collective on a GPU rank (every rank of a job has the same kind of device)."""
    if device.type != "cuda":
        return []
    mine = tuple(torch.cuda.get_device_capability(device))
    return [(int(major), int(minor)) for major, minor in collectives.all_gather_objects(mine)]


def job_autocast(amp: str, device: torch.device, is_main: bool) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """What the train step enters around its forward pass: `torch.autocast` in the job's precision, or
    nothing (fp32). Rank 0 logs the choice, and warns where bf16 is emulated."""
    capabilities = gpu_capabilities(device)
    dtype = autocast_dtype(amp, capabilities)
    if is_main:
        log.info("precision: %s", describe(dtype, capabilities))
        if warning := emulated_bf16(amp, capabilities):
            log.warning("%s", warning)
    if dtype is None:
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype)
