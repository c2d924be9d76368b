"""NVML, asked carefully: which GPUs a process sees and what one GPU reads now (torch-free).

Both sides use it: the submit side to pick free GPUs for a local run, the job side's per-node sampler
for gpu.jsonl and the health check at start (`gpu_faults`). Every query is guarded, because drivers and
GPU models differ in what they report (consumer cards have no ECC counters, some report no power
limit): a field NVML cannot give is left out, and a check it cannot make is passed over.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Optional

# Bits of nvmlDeviceGetCurrentClocksEventReasons (NVML's documented values); gpu_idle is left out:
# an idle GPU is not a throttled one.
THROTTLE_REASONS = {
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}


#: What every rank's environment holds: CUDA numbers GPUs in PCI bus order, as NVML and Slurm do (CUDA's
#: own default, fastest first, may put another GPU behind a numeric CUDA_VISIBLE_DEVICES entry).
CUDA_ORDER_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


class NvmlUnavailable(RuntimeError):
    """No NVML here (no NVIDIA driver, or no libnvidia-ml)."""


@contextmanager
def nvml_session() -> Iterator[Any]:
    """Yield the initialised `pynvml` module; raises NvmlUnavailable where there is no NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as err:  # pynvml raises NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise NvmlUnavailable(str(err) or type(err).__name__) from None
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


@dataclass(frozen=True)
class VisibleGpu:
    """One GPU (or MIG slice) a process may use: NVML's index (the board's, for a MIG slice), its uuid.

    No CUDA index: it means something only inside one process's CUDA_VISIBLE_DEVICES (Slurm's device
    cgroups renumber from 0 while NVML keeps the node's numbers), so a GPU crosses processes by uuid.
    """

    index: int
    uuid: str
    handle: Any


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible_gpus(nv: Any) -> list[VisibleGpu]:
    """The GPUs CUDA_VISIBLE_DEVICES names (indices or UUIDs), in its order; all GPUs when unset.

    NVML numbers GPUs in PCI bus order; numeric CUDA_VISIBLE_DEVICES entries are read as those
    numbers, which is what CUDA uses with CUDA_DEVICE_ORDER=PCI_BUS_ID (gpujobs exports it to every rank).
    """
    return listed_gpus(nv, os.environ.get("CUDA_VISIBLE_DEVICES"))


def listed_gpus(nv: Any, listed: Optional[str]) -> list[VisibleGpu]:
    """The GPUs a CUDA_VISIBLE_DEVICES value `listed` names, in its order (see `visible_gpus`); all GPUs
    for None. Entries: NVML indices, `GPU-<uuid>` or `MIG-<uuid>`. As CUDA does, it stops at the first
    entry it cannot find (a typo or another machine's GPU hides every GPU after it)."""
    if listed is None:
        listed = ",".join(str(i) for i in range(int(nv.nvmlDeviceGetCount())))
    found = []
    for entry in (e.strip() for e in listed.split(",")):
        gpu = _lookup(nv, entry) if entry else None
        if gpu is None:
            break
        found.append(gpu)
    return found


def gpus_by_uuid(nv: Any, uuids: list[str]) -> list[VisibleGpu]:
    """The GPUs of `uuids` (as ranks report them, `rank_gpu_uuid`), in that order, each once; a uuid
    NVML does not know (another node's, a GPU gone) is left out."""
    found: list[VisibleGpu] = []
    for uuid in uuids:
        gpu = _lookup(nv, uuid)
        if gpu is None and uuid.startswith("GPU-"):  # torch names a MIG slice by its bare uuid, too
            gpu = _lookup(nv, "MIG-" + uuid[len("GPU-"):])
        if gpu is not None and gpu.uuid not in {g.uuid for g in found}:
            found.append(gpu)
    return found


def rank_gpu_uuid(torch_uuid: str) -> str:
    """NVML's name for the GPU whose uuid torch reports (`get_device_properties(i).uuid`, no prefix)."""
    text = str(torch_uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


def _lookup(nv: Any, entry: str) -> Optional[VisibleGpu]:
    if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
        return None
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit() else nv.nvmlDeviceGetHandleByUUID(entry)
        uuid = _text(nv.nvmlDeviceGetUUID(handle))
    except nv.NVMLError:  # a stale entry or another node's uuid: nothing here to read
        return None
    board = handle
    if uuid.startswith("MIG-"):  # a slice has no index of its own: its board's
        board = _guarded(nv, lambda: nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)) or handle
    index = _guarded(nv, lambda: nv.nvmlDeviceGetIndex(board))
    return VisibleGpu(index=int(index) if index is not None else -1, uuid=uuid, handle=handle)


def _guarded(nv: Any, query: Callable[[], Any]) -> Optional[Any]:
    try:
        return query()
    except (nv.NVMLError, AttributeError):  # NotSupported, NoPermission, a binding too old for it: leave it out
        return None


def read_gpu(nv: Any, handle: Any) -> dict[str, Any]:
    """What one GPU reads now; fields NVML does not report on this GPU are absent."""
    out: dict[str, Any] = {}
    util = _guarded(nv, lambda: nv.nvmlDeviceGetUtilizationRates(handle))
    if util is not None:
        out["util_pct"] = int(util.gpu)
        out["mem_util_pct"] = int(util.memory)
    mem = _guarded(nv, lambda: nv.nvmlDeviceGetMemoryInfo(handle))
    if mem is not None:
        out["mem_used_mib"] = round(mem.used / 2**20, 1)
        out["mem_total_mib"] = round(mem.total / 2**20, 1)
    scalars: dict[str, tuple[Callable[[], Any], float]] = {
        "temp_c": (lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU), 1.0),
        "power_w": (lambda: nv.nvmlDeviceGetPowerUsage(handle), 1e-3),
        "power_limit_w": (lambda: nv.nvmlDeviceGetEnforcedPowerLimit(handle), 1e-3),
        "sm_clock_mhz": (lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM), 1.0),
        "ecc_uncorrected": (
            lambda: nv.nvmlDeviceGetTotalEccErrors(
                handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC
            ),
            1.0,
        ),
    }
    for key, (query, scale) in scalars.items():
        value = _guarded(nv, query)
        if value is not None:
            out[key] = round(value * scale, 1) if scale != 1.0 else int(value)
    reasons = _guarded(nv, lambda: _throttle_mask(nv, handle))
    if reasons is not None:
        out["throttle"] = [name for bit, name in THROTTLE_REASONS.items() if int(reasons) & bit]
    return out


def _throttle_mask(nv: Any, handle: Any) -> int:
    # renamed in NVML 12.x; older bindings only have the "Throttle" spelling
    query = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(query(handle))


class XidWatcher:
    """XID errors (the driver's fatal/critical GPU error codes) since the last `poll`, per GPU uuid.

    NVML reports XIDs only as events: register once, then drain without waiting on each sample.
    Where events are not supported (some drivers, containers), `poll` always returns {}.
    """

    def __init__(self, nv: Any, gpus: list[VisibleGpu]) -> None:
        self.nv = nv
        self.events: Any = None
        try:
            events = nv.nvmlEventSetCreate()
            for gpu in gpus:
                nv.nvmlDeviceRegisterEvents(gpu.handle, nv.nvmlEventTypeXidCriticalError, events)
            self.events = events
        except (nv.NVMLError, AttributeError):
            self.events = None

    def poll(self) -> dict[str, list[int]]:
        """Drain pending XID events (non-blocking)."""
        seen: dict[str, list[int]] = {}
        if self.events is None:
            return seen
        while True:
            try:
                event = self.nv.nvmlEventSetWait_v2(self.events, 0)
            except self.nv.NVMLError:  # Timeout: nothing pending
                return seen
            uuid = _text(self.nv.nvmlDeviceGetUUID(event.device))
            seen.setdefault(uuid, []).append(int(event.eventData))

    def close(self) -> None:
        """Free the event set."""
        if self.events is not None:
            with suppress(self.nv.NVMLError):
                self.nv.nvmlEventSetFree(self.events)
            self.events = None


#: Throttle reasons that mark a GPU as unfit to start on: the hardware slowing itself down (an
#: overheating or failing board, a power brake from the chassis) or the driver's thermal protection.
#: Power caps and application clocks are policy, not faults.
FAULT_THROTTLES = ("hw_slowdown", "hw_thermal", "hw_power_brake", "sw_thermal")


def gpu_faults(nv: Any, handle: Any, max_temp_c: float) -> list[str]:
    """What is wrong with one GPU now, one short phrase each; [] for a healthy GPU.

    Looks at uncorrectable ECC errors since the driver loaded, retired pages waiting for a reset, row
    remaps waiting for a reset or failed, the temperature against `max_temp_c`, and the throttle
    reasons of `FAULT_THROTTLES`. A check this GPU or driver cannot make (NotSupported on a board
    without ECC, say) finds nothing. XID errors come as events: see `XidWatcher`.
    """
    faults = []
    ecc = _guarded(nv, lambda: nv.nvmlDeviceGetTotalEccErrors(
        handle, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
    if ecc:
        faults.append(f"{int(ecc)} uncorrectable ECC error{'s' if int(ecc) != 1 else ''}")
    # NVML_FEATURE_ENABLED (1): pages were retired, and take effect only once the GPU is reset
    if _guarded(nv, lambda: nv.nvmlDeviceGetRetiredPagesPendingStatus(handle)):
        faults.append("retired pages pending (the GPU needs a reset)")
    remapped = _guarded(nv, lambda: nv.nvmlDeviceGetRemappedRows(handle))
    if remapped is not None:  # (correctable rows, uncorrectable rows, pending, failure occurred)
        if remapped[3]:
            faults.append("row remapping failed")
        elif remapped[2]:
            faults.append("row remaps pending (the GPU needs a reset)")
    temp = _guarded(nv, lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
    if temp is not None and temp > max_temp_c:
        faults.append(f"{int(temp)} C, above cluster.health_max_temp_c={max_temp_c:g}")
    mask = _guarded(nv, lambda: _throttle_mask(nv, handle))
    if mask is not None:
        throttled = [name for bit, name in THROTTLE_REASONS.items() if int(mask) & bit and name in FAULT_THROTTLES]
        if throttled:
            faults.append(f"throttled ({', '.join(throttled)})")
    return faults
