"""One GPU sampler per node: a background thread appends NVML readings to the node's gpu.<node>.jsonl (torch-free).

It runs in the node's local-rank-0 process. NVML calls are C calls that drop the GIL, and one
sample of 8 GPUs is a few hundred microseconds every `interval_s` seconds, so the training loop does
not feel it. Without NVML it logs one line and the job carries on without telemetry.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.atomic import JsonlAppender
from gpujobs.base.errors import GpujobsError
from gpujobs.base.nvml import (
    NvmlUnavailable,
    VisibleGpu,
    XidWatcher,
    gpus_by_uuid,
    nvml_session,
    read_gpu,
    visible_gpus,
)

log = logging.getLogger(__name__)


#: Called with each sample's records (rank 0 feeds them to its Prometheus endpoint).
SampleSink = Callable[[list[dict[str, Any]]], None]


class GpuSampler:
    """Samples this node's GPUs every `interval_s` seconds into `path`: those of `rank_of_uuid` (the
    GPUs the node's ranks reported), else the ones this process sees (CPU ranks report none)."""

    def __init__(
        self,
        path: Path,
        interval_s: float,
        node: str,
        rank_of_uuid: dict[str, int],
        sink: Optional[SampleSink] = None,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self.node = node
        self.rank_of_uuid = rank_of_uuid
        self.sink = sink
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()
        self.active = False

    def start(self) -> bool:
        """Start sampling; False (and one log line) where there is no NVML or no visible GPU."""
        self._thread = threading.Thread(target=self._run, name="gpujobs-gpu-sampler", daemon=True)
        self._thread.start()
        self._started.wait()
        return self.active

    def stop(self) -> None:
        """Stop the thread (it writes no half sample: the file is written one whole sample at a time)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _run(self) -> None:
        # NVML lives on this thread from init to shutdown, so no NVML call ever runs on the loop's thread.
        try:
            with nvml_session() as nv:
                gpus = gpus_by_uuid(nv, list(self.rank_of_uuid)) if self.rank_of_uuid else visible_gpus(nv)
                if not gpus:
                    log.info("no visible GPU: GPU telemetry off")
                    self._started.set()
                    return
                with JsonlAppender(self.path) as out:
                    self.active = True
                    self._started.set()
                    log.info("GPU telemetry: %d GPU(s) every %.3g s into %s", len(gpus), self.interval_s, self.path)
                    xids = XidWatcher(nv, gpus)
                    try:
                        self._loop(nv, gpus, xids, out)
                    finally:
                        xids.close()
        except NvmlUnavailable:
            log.info("no NVML: GPU telemetry off")
        except GpujobsError as err:  # the file is no file we may append to (a link planted in its place)
            log.warning("GPU telemetry off: %s", err)
        except Exception:  # telemetry must never take the job down
            log.exception("GPU telemetry failed; the job carries on without it")
        finally:
            self.active = False
            self._started.set()

    def _loop(self, nv: Any, gpus: list[VisibleGpu], xids: XidWatcher, out: JsonlAppender) -> None:
        while True:
            records = self.sample(nv, gpus, xids)
            # one write per sample: readers never see half a sample, and the cost is one syscall per interval
            out.append(records)
            if self.sink is not None:
                self.sink(records)
            if self._stop.wait(self.interval_s):
                return

    def sample(self, nv: Any, gpus: list[VisibleGpu], xids: XidWatcher) -> list[dict[str, Any]]:
        """One record per GPU: where it is, who uses it, and what it reads now."""
        now = round(time.time(), 3)
        errors = xids.poll()
        records = []
        for gpu in gpus:
            record: dict[str, Any] = {
                "time": now,
                "node": self.node,
                "rank": self.rank_of_uuid.get(gpu.uuid),
                "gpu": gpu.index,
                "uuid": gpu.uuid,
                **read_gpu(nv, gpu.handle),
            }
            if gpu.uuid in errors:
                record["xid"] = errors[gpu.uuid]
            records.append(record)
        return records
