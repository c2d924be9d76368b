"""Each rank's compute time: data + forward + backward, up to where the gradient all-reduce makes it wait.

DDP overlaps the all-reduce with the backward pass, so a rank's backward call returns only once the
slowest rank's gradients are in: timing around `backward()` would measure the slowest rank everywhere.
A DDP communication hook sees the moment this rank's last gradient bucket is ready, which is the end
of its own compute; that is what dynamic balancing divides by the rows it read. Micro-batches under
`no_sync` (gradient accumulation) and single-rank runs have no all-reduce: their compute ends with
`backward()`.

On CUDA the times come from CUDA events (the host only queues kernels), read once per window; on the
CPU from the wall clock. The host clock is no rank's own on CUDA: a blocking copy to the GPU waits for
everything queued before it, the last step's all-reduce included, so every rank would read the slowest
rank's time. A start event runs only once the GPU is done with that, so the events leave it out: this
is also the straggler check's signal on GPUs. The slow-GPU emulation (`telemetry.debug_slow_factor`)
lives here too: the slowed rank sleeps (F - 1) times its measured compute at the same point, so it costs
what an F times slower GPU would, in proportion to the rows it reads. `StepTimes` holds a log window's
timing of the whole step on the host clock, beside the clock's compute seconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from gpujobs.rank import collectives

#: At most this many of a window's CUDA event pairs, or of its loss tensors, are kept unread: beyond, those
#: done are folded into a sum, so a run that logs seldom or never (`trainer.log_every=0`) holds no more.
FOLD_AT = 256


class ComputeClock:
    """Sums one rank's compute seconds over a window of micro-batches."""

    def __init__(self, device: torch.device, slow_factor: float = 1.0) -> None:
        self.cuda = device.type == "cuda"
        self.slow_factor = slow_factor
        self._started = 0.0
        self._start_event: Optional[torch.cuda.Event] = None
        self._pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._done = True
        self.window_s = 0.0
        """Compute seconds so far in this window (CPU clock; CUDA events are added by `read`)."""

    def start(self) -> None:
        """A micro-batch begins (before its data is fetched)."""
        self._done = False
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        self._started = time.perf_counter()

    def end(self) -> None:
        """This rank's compute of the micro-batch is over (called once; later calls do nothing)."""
        if self._done:
            return
        self._done = True
        if self.slow_factor > 1:
            time.sleep((self.slow_factor - 1) * self._so_far())
        if self.cuda and self._start_event is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs.append((self._start_event, end))  # recorded after the sleep: it counts
            if len(self._pairs) >= FOLD_AT:
                self._fold()
        else:
            self.window_s += time.perf_counter() - self._started

    def _so_far(self) -> float:
        """This micro-batch's compute seconds up to now (on CUDA: once the GPU gets here, by the events,
        not counting what the GPU still had queued from the last step when it started)."""
        if self.cuda and self._start_event is not None:
            now = torch.cuda.Event(enable_timing=True)
            now.record()
            now.synchronize()
            return self._start_event.elapsed_time(now) / 1000
        return time.perf_counter() - self._started

    def _fold(self) -> None:
        """Add the micro-batches the GPU is done with to `window_s` (no wait: events end in the order queued)."""
        done = 0
        while done < len(self._pairs) and self._pairs[done][1].query():
            start, end = self._pairs[done]
            self.window_s += start.elapsed_time(end) / 1000
            done += 1
        del self._pairs[:done]

    def read(self) -> float:
        """The window's compute seconds, and a new window (on CUDA: waits for the window's last event)."""
        total = self.window_s
        if self._pairs:
            self._pairs[-1][1].synchronize()
            total += sum(start.elapsed_time(end) for start, end in self._pairs) / 1000
        self.window_s, self._pairs = 0.0, []
        return total

    def install(self, ddp: torch.nn.Module) -> None:
        """Mark the end of compute from the all-reduce of the last gradient bucket (DDP only)."""
        # Unannotated: DDP compares the annotation object with dist.GradBucket, and this module's
        # annotations are strings (`from __future__ import annotations`).
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            if bucket.is_last():
                self.end()
            return collectives.average_gradient_bucket(bucket)

        ddp.register_comm_hook(None, hook)  # type: ignore[operator]


@dataclass
class StepTimes:
    """Per-rank timing of the steps since the last log line."""

    steps: int = 0
    step_s: float = 0.0
    data_s: float = 0.0
    local_s: float = 0.0
    """Data wait + forward on the host clock: what the straggler check compares where `compute_s` is not
    measured (on the CPU, without dynamic balancing or the slow-GPU emulation)."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """Each micro-batch's loss, detached (`add_loss`): summed once per log line, or every `FOLD_AT`."""
    compute_s: float = 0.0
    """Data + forward + backward up to the gradient all-reduce (`ComputeClock`), summed."""
    rows: int = 0
    """Rows this rank read."""

    def add_loss(self, loss: torch.Tensor) -> None:
        """A micro-batch's loss (detached), kept on its device: no host sync; every `FOLD_AT` folded into one."""
        self.losses.append(loss.detach())
        if len(self.losses) >= FOLD_AT:
            self.losses = [torch.stack(self.losses).sum()]

    def reset(self) -> None:
        """Start a new window."""
        self.steps, self.step_s, self.data_s, self.local_s, self.losses = 0, 0.0, 0.0, 0.0, []
        self.compute_s, self.rows = 0.0, 0

    def loss_sum(self) -> float:
        """The window's summed loss (one host read)."""
        return float(torch.stack(self.losses).sum()) if self.losses else 0.0
