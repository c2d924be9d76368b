"""The fake GPUs behind both stand-in `pynvml`s of the tests (this machine has no NVIDIA GPU and no NVML).

Only GPU-side facts are faked (what the driver would report); everything above them runs for real.
`namespace(gpus)` is the module body of a `pynvml` reporting `gpus`: tests/fake_nvml.py installs it in
the test's own process, tests/fake_pynvml/pynvml.py in the ranks of a real run (through PYTHONPATH).
Torch-free and pytest-free, so that a rank can import it.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field, fields
from typing import Any, Optional

# NVML's bits of nvmlDeviceGetCurrentClocksEventReasons (gpujobs.base.nvml.THROTTLE_REASONS, plus gpu_idle)
_THROTTLE_BITS = {
    "gpu_idle": 0x1, "applications_clocks": 0x2, "sw_power_cap": 0x4, "hw_slowdown": 0x8, "sync_boost": 0x10,
    "sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80, "display_clocks": 0x100,
}


@dataclass
class FakeGpu:
    """What one fake GPU reports."""

    util: int = 10
    used_gb: float = 1.0
    total_gb: float = 80.0
    power_limit: bool = True
    """False: nvmlDeviceGetEnforcedPowerLimit raises NotSupported (as on some boards)."""
    xids: list[int] = field(default_factory=list)
    """XID events pending from the start (each reported once)."""
    temp_c: Optional[int] = None
    """The temperature; None: 40 + its index."""
    ecc_uncorrected: Optional[int] = None
    """Volatile uncorrectable ECC errors; None: NotSupported (a board without ECC)."""
    retired_pending: Optional[bool] = None
    """Retired pages waiting for a reset; None: NotSupported."""
    remap_pending: bool = False
    remap_failure: bool = False
    remap_supported: bool = False
    """False: nvmlDeviceGetRemappedRows raises NotSupported (pre-Ampere boards); the two above need it."""
    throttle: list[str] = field(default_factory=lambda: ["gpu_idle", "sw_power_cap"])
    """Throttle reasons, by gpujobs.base.nvml's names."""
    mig_of: Optional[int] = None
    """A MIG slice of the GPU of this index: NVML reaches it by its uuid (MIG-fake-<i>) only, not by index
    or count. List slices after every whole GPU."""

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> FakeGpu:
        """A fake GPU from a JSON object of its fields (unknown keys are an error: a typo fakes nothing)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown fake GPU fields {unknown}; known: {sorted(known)}")
        return cls(**values)


def namespace(gpus: list[FakeGpu]) -> dict[str, Any]:
    """The names a `pynvml` module reporting `gpus` holds."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # pynvml's own spelling
        pass

    class NVMLError_Timeout(NVMLError):
        pass

    def not_supported() -> Any:
        raise NVMLError_NotSupported("Not Supported")

    boards = sum(1 for gpu in gpus if gpu.mig_of is None)

    def handle(i: int) -> int:
        if not 0 <= i < boards:
            raise NVMLError("Invalid Argument")
        return i

    def uuid_of(h: int) -> str:
        return f"{'MIG' if gpus[h].mig_of is not None else 'GPU'}-fake-{h}"

    def by_uuid(uuid: str) -> int:
        number = uuid.rpartition("-")[2]
        if not number.isdigit() or int(number) >= len(gpus) or uuid_of(int(number)) != uuid:
            raise NVMLError("Not Found")  # another machine's GPU: not among these
        return int(number)

    def index(h: int) -> int:
        if gpus[h].mig_of is not None:
            raise NVMLError("Invalid Argument")  # a slice has no index of its own
        return h

    def board(h: int) -> int:
        parent = gpus[h].mig_of
        if parent is None:
            raise NVMLError("Invalid Argument")
        return parent

    pending = [(i, x) for i, gpu in enumerate(gpus) for x in gpu.xids]

    def wait(_events: Any, _timeout_ms: int) -> Any:
        if not pending:
            raise NVMLError_Timeout("Timeout")
        index, xid = pending.pop(0)
        return types.SimpleNamespace(device=index, eventData=xid)

    def power_limit(h: int) -> int:
        return 700_000 if gpus[h].power_limit else not_supported()

    def ecc(h: int, _kind: int, _counter: int) -> int:
        count = gpus[h].ecc_uncorrected
        return count if count is not None else not_supported()

    def retired_pending(h: int) -> int:
        pending = gpus[h].retired_pending
        return int(pending) if pending is not None else not_supported()

    def remapped_rows(h: int) -> tuple[int, int, int, int]:
        gpu = gpus[h]
        if not gpu.remap_supported:
            return not_supported()  # type: ignore[no-any-return]
        return (0, int(gpu.remap_failure or gpu.remap_pending), int(gpu.remap_pending), int(gpu.remap_failure))

    def temperature(h: int, _kind: int) -> int:
        temp = gpus[h].temp_c
        return temp if temp is not None else 40 + h

    def throttle(h: int) -> int:
        mask = 0
        for name in gpus[h].throttle:
            mask |= _THROTTLE_BITS[name]
        return mask

    return dict(
        NVMLError=NVMLError,
        NVMLError_NotSupported=NVMLError_NotSupported,
        NVML_TEMPERATURE_GPU=0,
        NVML_CLOCK_SM=1,
        NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0,
        nvmlEventTypeXidCriticalError=8,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: boards,
        nvmlDeviceGetHandleByIndex=handle,
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetIndex=index,
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle=board,
        nvmlDeviceGetUUID=uuid_of,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=gpus[h].util, memory=gpus[h].util // 2),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(
            used=int(gpus[h].used_gb * 1e9), total=int(gpus[h].total_gb * 1e9),
            free=int((gpus[h].total_gb - gpus[h].used_gb) * 1e9),
        ),
        nvmlDeviceGetTemperature=temperature,
        nvmlDeviceGetPowerUsage=lambda h: 250_000 + 1000 * h,
        nvmlDeviceGetEnforcedPowerLimit=power_limit,
        nvmlDeviceGetClockInfo=lambda h, _kind: 1980,
        nvmlDeviceGetTotalEccErrors=ecc,
        nvmlDeviceGetRetiredPagesPendingStatus=retired_pending,
        nvmlDeviceGetRemappedRows=remapped_rows,
        nvmlDeviceGetCurrentClocksEventReasons=throttle,
        nvmlEventSetCreate=lambda: object(),
        nvmlDeviceRegisterEvents=lambda h, kind, events: None,
        nvmlEventSetWait_v2=wait,
        nvmlEventSetFree=lambda events: None,
    )
