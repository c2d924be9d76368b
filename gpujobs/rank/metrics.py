"""Where the job's numbers go: `metrics.jsonl` in the run dir (rank 0 only) and the log."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path
from typing import Optional

import torch

from gpujobs.base.atomic import JsonlAppender
from gpujobs.rank import collectives
from gpujobs.rank.compute_clock import StepTimes
from gpujobs.rundir.records import MetricsRecord, TrainRecord, metrics_line


class MetricsLog:
    """Appends one JSON object per line, each written at once so followers see it (`atomic.JsonlAppender`:
    a line torn by an earlier attempt's crash is ended at open, a link in the file's place refused)."""

    def __init__(self, path: Optional[Path]) -> None:
        self.path = path
        # held open for the whole run (one line per log step); closed by `close`
        self._out = JsonlAppender(path) if path is not None else None

    def write(self, record: MetricsRecord) -> None:
        """Append `record`'s line, stamped with the wall-clock time of when it happened: its own `time`
        where it has one (a train line written a step after its log step), else now (no-op on ranks
        other than 0)."""
        if self._out is None:
            return
        self._out.append([{**metrics_line(record), "time": round(record.time or time.time(), 3)}])

    def close(self) -> None:
        """Close the file."""
        if self._out is not None:
            self._out.close()
            self._out = None


class GatheringTrainRecord:
    """A log step's train record while every rank's timing and loss are gathered (one small all-gather,
    started without waiting): the trainer goes on with the next step and writes the record at the next
    step boundary, by when the gather has finished. `head` holds what this rank knows at the log step
    (step, lr, samples/s, plan); the gather fills in the per-rank columns."""

    def __init__(self, head: TrainRecord, times: StepTimes, local_s: float, compute_s: Optional[float]) -> None:
        """`times`: the window's steps; `local_s`: the straggler check's signal summed over them;
        `compute_s`: the compute clock's seconds where it runs (None: not timed)."""
        per_sample = compute_s / times.rows if compute_s is not None and times.rows else 0.0
        mine = torch.tensor([times.step_s, times.data_s, times.loss_sum(), local_s, per_sample * times.steps])
        self.head, self.timed = head, compute_s is not None
        self._table = collectives.start_all_gather_rows(mine / times.steps)  # world size x 5, on the CPU

    def record(self) -> TrainRecord:
        """The record, every rank's column filled in (waits for the gather if it has not finished)."""
        table = self._table.wait()
        return dataclasses.replace(
            self.head,
            # each rank's loss is weighted by its share times the world size: their mean is the global batch's
            loss=round(float(table[:, 2].mean()), 6),
            step_time_s=[round(float(x), 6) for x in table[:, 0]],
            data_time_s=[round(float(x), 6) for x in table[:, 1]],
            local_time_s=[round(float(x), 6) for x in table[:, 3]],
            compute_s_per_sample=[round(float(x), 9) for x in table[:, 4]] if self.timed else [],
        )


def param_digest(model: torch.nn.Module) -> str:
    """sha256 over the parameters, names sorted, raw bytes: a reproducibility fingerprint."""
    return state_digest(model.state_dict())


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors of `state`, names sorted, raw bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def peak_rss_mb() -> Optional[float]:
    """This process's peak resident memory in MB (VmHWM, from /proc; None where there is none): what a rank
    needed of its node's memory, its model's share included."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None
