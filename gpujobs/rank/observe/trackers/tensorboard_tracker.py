"""TensorBoard: one log dir per run dir, appended to by every attempt (torch's SummaryWriter).

An attempt opens its writer with `purge_step`: TensorBoard then drops, from the files before, every event at or
past that step. The purge step is the earlier of the attempt's first step (steps past the checkpoint that a
crashed attempt logged are trained and logged again: the new values replace them) and the last step the log
dir holds (a record may have been cut short by a kill: it is written again whole). What the log dir lacks
below the first step (the records of earlier attempts that never reached the file) is replayed from
metrics.jsonl. So each step is in TensorBoard once, with no gap. The config goes in as hparams (the
hparams plugin's session start info, at each attempt's purge step; a completed run adds its session end),
so `tensorboard --logdir SWEEP_DIR` shows every point of a sweep in one hparams table with its final metrics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from gpujobs.config.load import JobConfig
from gpujobs.rundir.trackers import TrackerState, read_state, write_state
from gpujobs.trackers.series import StepRecord, flat_config, values_of

log = logging.getLogger(__name__)

#: The default log dir, inside the run dir.
LOG_DIR = "tensorboard"
#: Config sections left out of the hparams: where and how the job runs, not what it trains.
_NOT_HPARAMS = ("cluster", "nccl", "telemetry", "logger")


def event_files(log_dir: Path) -> list[Path]:
    """The log dir's event files in the order TensorBoard reads them (by name: the name starts with the time)."""
    return sorted(log_dir.glob("events.out.tfevents.*"))


def last_step_written(log_dir: Path) -> Optional[int]:
    """The last step of a scalar that TensorBoard shows from `log_dir` (None: none): the newest file's last,
    below the purge step of any newer file (reading older files only where the newest hold none)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    below = None  # a newer file's purge step: TensorBoard hides what older files hold at or past it
    for path in reversed(event_files(log_dir)):
        steps, purges = [], []
        for event in LegacyEventFileLoader(str(path)).Load():  # a record cut short by a kill ends the file
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                purges.append(event.step)
            elif event.HasField("summary") and any(v.HasField("simple_value") for v in event.summary.value):
                steps.append(event.step)
        shown = [step for step in steps if below is None or step < below]
        if shown:
            return max(shown)
        if purges:
            below = min(purges) if below is None else min(below, *purges)
    return None


class TensorBoardTracker:
    """Rank 0's TensorBoard writer for one attempt; every call comes from the trackers' worker thread."""

    name = "tensorboard"

    def __init__(self, job: JobConfig, run_dir: Path) -> None:
        assert job.logger.tensorboard is not None
        self.job = job
        self.run_dir = run_dir
        self.log_dir = Path(job.logger.tensorboard.log_dir or run_dir / LOG_DIR)
        self.writer: Any = None
        self.last_step = 0

    def start(self) -> None:
        """Load TensorBoard's writer and reader (a second or so: before the first record, not during training)."""
        from tensorboard.backend.event_processing import event_file_loader  # noqa: F401
        from tensorboard.compat.proto import summary_pb2  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter, summary  # noqa: F401

        self.log_dir.mkdir(parents=True, exist_ok=True)

    def open(self, first_step: int, replay: Sequence[StepRecord]) -> None:
        """Open the writer at the purge step, record the log dir, write the hparams and replay what is missing."""
        from torch.utils.tensorboard import SummaryWriter

        last = last_step_written(self.log_dir)
        purge = 0 if last is None else min(last, first_step)
        # flushed once per batch (`log`), so neither the queue nor a timer decides what a kill loses
        self.writer = SummaryWriter(str(self.log_dir), purge_step=purge, max_queue=10_000, flush_secs=3600)
        state = read_state(self.run_dir)
        if state.tensorboard_log_dir != str(self.log_dir):
            write_state(self.run_dir, TrackerState(state.mlflow, str(self.log_dir)))
        self._write_hparams(purge)
        replayed: list[tuple[StepRecord, dict[str, float]]] = [(r, {}) for r in replay if r.step >= purge]
        self.log(replayed)
        log.info("TensorBoard: %s from step %d (purged from step %d, %d records replayed from metrics.jsonl)",
                 self.log_dir, first_step, purge, len(replayed))

    def _write_hparams(self, step: int) -> None:
        from torch.utils.tensorboard.summary import hparams

        config = {key: value for key, value in self.job.to_dict().items() if key not in _NOT_HPARAMS}
        _, start, _ = hparams(flat_config(config), {})
        self.writer.file_writer.add_summary(start, step)

    def log(self, batch: Sequence[tuple[StepRecord, dict[str, float]]]) -> None:
        """Each record's series (and the GPU readings) as one event at its step; then one flush."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        for record, gpu in batch:
            values = [Summary.Value(tag=key, simple_value=value) for key, value in {**values_of(record), **gpu}.items()]
            self.writer.file_writer.add_summary(Summary(value=values), record.step, record.time or time.time())
            self.last_step = max(self.last_step, record.step)
        self.writer.flush()

    def close(self, status: str) -> None:
        """A completed run adds the hparams session's end (success); then the file is closed."""
        if self.writer is None:
            return
        if status == "completed":
            from torch.utils.tensorboard.summary import hparams

            _, _, end = hparams({}, {})
            self.writer.file_writer.add_summary(end, self.last_step)
        self.writer.close()
