"""A stand-in `pynvml` for tests: this machine has no NVIDIA GPU and no NVML, so there is nothing real to ask.

Only GPU-side facts are faked (what the driver would report); everything above it (the sampler thread,
gpu.jsonl, picking, the report) runs for real. Install with `install(monkeypatch, gpus)`.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest


@dataclass
class FakeGpu:
    """What one fake GPU reports."""

    util: int = 10
    used_gb: float = 1.0
    total_gb: float = 80.0
    power_limit: bool = True
    """False: nvmlDeviceGetEnforcedPowerLimit raises NotSupported (as on some boards)."""
    xids: list[int] = field(default_factory=list)


def install(monkeypatch: pytest.MonkeyPatch, gpus: list[FakeGpu]) -> types.ModuleType:
    """Put a fake `pynvml` reporting `gpus` into sys.modules for this test."""
    nv = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # pynvml's own spelling
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    def not_supported(*_: Any) -> Any:
        raise NVMLError_NotSupported("Not Supported")

    def handle(i: int) -> int:
        if not 0 <= i < len(gpus):
            raise NVMLError("Invalid Argument")
        return i

    pending = [(i, x) for i, gpu in enumerate(gpus) for x in gpu.xids]

    def wait(_events: Any, _timeout_ms: int) -> Any:
        if not pending:
            raise NVMLError_Timeout("Timeout")
        index, xid = pending.pop(0)
        return types.SimpleNamespace(device=index, eventData=xid)

    def power_limit(h: int) -> int:
        if not gpus[h].power_limit:
            raise NVMLError_NotSupported("Not Supported")
        return 700_000

    nv.__dict__.update(
        NVMLError=NVMLError,
        NVMLError_NotSupported=NVMLError_NotSupported,
        NVML_TEMPERATURE_GPU=0,
        NVML_CLOCK_SM=1,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlEventTypeXidCriticalError=8,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetHandleByUUID=lambda uuid: handle(int(uuid.rsplit("-", 1)[1])),
        nvmlDeviceGetIndex=lambda h: h,
        nvmlDeviceGetUUID=lambda h: f"GPU-fake-{h}",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=gpus[h].util, memory=gpus[h].util // 2),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            used=int(gpus[h].used_gb * 1e9), total=int(gpus[h].total_gb * 1e9),
            free=int((gpus[h].total_gb - gpus[h].used_gb) * 1e9),
        ),
        nvmlDeviceGetTemperature=lambda h, _kind: 40 + h,
        nvmlDeviceGetPowerUsage=lambda h: 250_000 + 1000 * h,
        nvmlDeviceGetEnforcedPowerLimit=power_limit,
        nvmlDeviceGetClockInfo=lambda h, _kind: 1980,
        nvmlDeviceGetTotalEccErrors=not_supported,
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x1 | 0x4,  # idle + sw power cap
        nvmlEventSetCreate=lambda: object(),
        nvmlDeviceRegisterEvents=lambda h, kind, events: None,
        nvmlEventSetWait_v2=wait,
        nvmlEventSetFree=lambda events: None,
    )
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    return nv
