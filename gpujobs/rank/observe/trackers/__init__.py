"""Experiment trackers (`logger=tensorboard|mlflow`, or both): one tracker run per run dir, for its whole life.

Rank 0 opens them (`open_trackers`) as its attempt starts; the trainer's `on_step` hands every train and eval
record to `Trackers.log`, which only puts it on a queue. A worker thread does the rest: it loads the libraries
and continues (or creates) the run named in the run dir's tracker.json (`state`) while the rank is still
starting, then sends what came each `BATCH_S` as one batch, so the training loop pays one queue put per log
step. The attempt's first record (step F) tells each tracker where it continues; each works out from its own
store which steps it already holds, so every step is logged once, with no gap, whatever ended the attempts
before (a Slurm requeue and a local restart are alike here):

- a preemption or a time limit stops at a checkpoint: the next attempt starts right after it;
- a crash (a rank killed, a hang) ends an attempt past its last checkpoint, and the next one trains those steps
  again. TensorBoard drops what the crashed attempt logged from there on (`purge_step`) and takes the new
  values. MLflow cannot delete a point, so the points the crashed attempt logged stay and those steps are not
  logged again: training is exact, so a retrained step computes what it computed then (the timings differ, and
  the first log line after a resume averages fewer steps, from the checkpoint on). The other way out, holding
  each point back until a checkpoint after it is published, would delay every curve by a checkpoint interval;
- records that never reached a tracker (still queued when rank 0 was killed, refused by a tracking server that
  was down, or cut short in a TensorBoard file) are in metrics.jsonl, which the trainer writes before
  `on_step`: the next attempt replays those below F that its tracker lacks (`series.history`).

A tracker that fails never stops training: its error is logged, its records wait in order and are tried again
(`RETRY_S`); at the end the worker gets `CLOSE_TIMEOUT_S`, and what it could not send is the next attempt's to
replay (the last attempt's is logged as not sent). The MLflow run is RUNNING while an attempt runs, then
FINISHED, KILLED (stopped, to be requeued) or FAILED. Torch-free; the TensorBoard tracker loads torch's writer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Optional, Protocol

from gpujobs.config.load import JobConfig
from gpujobs.rundir.records import EvalRecord, MetricsRecord, TrainRecord
from gpujobs.trackers.series import GpuTail, StepRecord, history

log = logging.getLogger(__name__)

#: How long an attempt's end waits for the worker to send what is queued (a requeued Slurm job is killed
#: soon after its requeue; anything left is replayed by the next attempt).
CLOSE_TIMEOUT_S = 10.0
#: The worker sends what came within this many seconds as one batch (one MLflow request, one TensorBoard
#: flush): a tracker costs a call per second, not per record; a kill loses at most that much, to the replay.
BATCH_S = 1.0
#: How long rank 0 waits, before its first step, for the trackers to have loaded their libraries and reached
#: their stores (a second or two, mostly while the rank was starting anyway): loading them during training
#: would slow its first seconds (they hold the GIL and a core).
START_WAIT_S = 10.0
#: Seconds before a tracker that failed (a tracking server that is down) is tried again.
RETRY_S = 30.0
#: Records a failing tracker keeps for its next try; newer ones wait for the next attempt's replay.
_MAX_PENDING = 10_000
_STOP = object()

#: A record and the GPU readings logged with it.
Entry = tuple[StepRecord, dict[str, float]]


class Tracker(Protocol):
    """One tracker's attempt. The worker calls `start` at once, `open` with the attempt's first record, then
    `log` with each batch, and `close` at the end; a call that raised is made again later."""

    name: str

    def start(self) -> None:
        """Before any record: import the library, reach the store, continue or create the run dir's run."""

    def open(self, first_step: int, replay: list[StepRecord]) -> None:
        """The attempt logs from `first_step` on: log what `replay` holds that the run lacks."""

    def log(self, batch: list[Entry]) -> None:
        """Train and eval records at their steps, in order, with GPU readings."""

    def close(self, status: str) -> None:
        """The attempt ended: completed, stopped (to be requeued) or failed."""


def _tracker(name: str, job: JobConfig, run_dir: Path) -> Tracker:
    if name == "mlflow":
        from gpujobs.trackers.mlflow_tracker import MlflowTracker

        return MlflowTracker(job, run_dir)
    from gpujobs.rank.observe.trackers.tensorboard_tracker import TensorBoardTracker

    return TensorBoardTracker(job, run_dir)


def status_of(exc_type: Optional[type[BaseException]]) -> str:
    """An attempt's end as the trackers record it: completed (no exception), stopped (the SystemExit of a rank
    that stopped to be requeued, or of an unhealthy node) or failed."""
    if exc_type is None:
        return "completed"
    return "stopped" if issubclass(exc_type, SystemExit) else "failed"


class Trackers:
    """Rank 0's trackers, each behind a queue and a worker thread of its own (a tracker stuck on a tracking
    server that is down holds no other back); `Trackers([], ...)` does nothing."""

    def __init__(self, names: Sequence[str], job: JobConfig, run_dir: Path) -> None:
        self.names = list(names)
        # started now, so the libraries load while the rank builds its task and restores its checkpoint
        self._workers = [_Worker(_tracker(name, job, run_dir), run_dir) for name in names]
        if names:
            log.info("experiment trackers: %s (run dir %s)", ", ".join(names), run_dir)

    def log(self, record: MetricsRecord) -> None:
        """Called by the trainer with each record: queue a train or eval record for the workers."""
        if self._workers and isinstance(record, (TrainRecord, EvalRecord)):
            item = (time.time(), record)
            for worker in self._workers:
                worker.queue.put(item)

    def on_step(self, before: Callable[[MetricsRecord], None]) -> Callable[[int, MetricsRecord], None]:
        """The trainer's `on_step`: `before(record)` (the progress view), then `log(record)`. Asked for as the
        trainer is built: it first waits (at most `START_WAIT_S`) for the trackers to have started."""
        deadline = time.monotonic() + START_WAIT_S
        for worker in self._workers:
            if not worker.started.wait(max(deadline - time.monotonic(), 0)):
                log.warning("%s: still starting after %.0f s: training begins", worker.sending.tracker.name,
                            START_WAIT_S)

        def call(_: int, record: MetricsRecord) -> None:
            before(record)
            self.log(record)

        return call

    def __enter__(self) -> Trackers:
        return self

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.close(status_of(exc_type))

    def close(self, status: str = "completed") -> None:
        """End the attempt in every tracker (waiting at most `CLOSE_TIMEOUT_S` in all for their queues to drain)."""
        for worker in self._workers:
            worker.status = status
            worker.queue.put(_STOP)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for worker in self._workers:
            worker.thread.join(max(deadline - time.monotonic(), 0))
            if worker.thread.is_alive():
                log.warning("%s: still busy after %.0f s: what it did not send is replayed by the run dir's next "
                            "attempt (from metrics.jsonl)", worker.sending.tracker.name, CLOSE_TIMEOUT_S)
        self._workers = []


class _Worker:
    """One tracker's queue and thread: it starts the tracker at once, opens it at the attempt's first record,
    then sends what came each `BATCH_S` as one batch."""

    def __init__(self, tracker: Tracker, run_dir: Path) -> None:
        self.sending = _Sending(tracker)
        self.run_dir = run_dir
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.status = "failed"
        self.started = threading.Event()
        self._gpu = GpuTail.from_now(run_dir)  # samples before this attempt were earlier ones'
        self.thread = threading.Thread(target=self._work, name=f"gpujobs-{tracker.name}", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            self._send_all()
        except Exception:  # a bug of ours: the job carries on, its records are in metrics.jsonl
            log.exception("%s: the tracker's thread failed; the job carries on without it", self.sending.tracker.name)
        finally:
            self.started.set()

    def _send_all(self) -> None:
        self.sending.start()
        self.started.set()
        first_step: Optional[int] = None
        replay: list[StepRecord] = []
        stopped = False
        while not stopped:
            items, stopped = self._next_batch()
            records = [_stamped(*item) for item in items]
            if not records:
                continue
            if first_step is None:  # the attempt's first record: its step is where the tracker continues
                first_step = records[0].step
                replay = history(self.run_dir, first_step)
            # the newest reading of each GPU, with the batch's last train record
            last_train = max((i for i, r in enumerate(records) if r.kind == "train"), default=None)
            gpu = self._gpu.read() if last_train is not None else {}
            self.sending.send([(r, gpu if i == last_train else {}) for i, r in enumerate(records)], first_step, replay)
        self.sending.close(self.status)

    def _next_batch(self) -> tuple[list[Any], bool]:
        """What the trainer queued within `BATCH_S` of the next record (and whether the attempt ended)."""
        item = self.queue.get()
        if item is _STOP:
            return [], True
        items, deadline = [item], time.monotonic() + BATCH_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                item = self.queue.get(timeout=left)
            except queue.Empty:
                break
            if item is _STOP:
                return items, True
            items.append(item)
        return items, False


def _stamped(stamp: float, record: StepRecord) -> StepRecord:
    """A queued record stamped with the time it was queued (the trainer's has none: metrics.jsonl's line gets
    its own)."""
    return dataclasses.replace(record, time=record.time or stamp)


class _Sending:
    """One tracker of the attempt, with the records it has not taken yet, in order: a later one never overtakes
    an earlier one, so a tracker's last step means every step before it is there (what it never gets is
    the next attempt's replay). A step that failed (starting, opening, logging) is tried again after `RETRY_S`."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.started = self.opened = False
        self.pending: list[Entry] = []
        self.failures = 0
        self.dropped = 0
        self._failed_at = -math.inf

    def start(self) -> None:
        self.started = self._try("starting", self.tracker.start)

    def send(self, batch: list[Entry], first_step: int, replay: list[StepRecord]) -> None:
        room = _MAX_PENDING - len(self.pending)
        self.pending += batch[:max(room, 0)]
        self.dropped += max(len(batch) - max(room, 0), 0)
        if time.monotonic() - self._failed_at < RETRY_S:
            return
        if not self.started:
            self.started = self._try("starting", self.tracker.start)
        if self.started and not self.opened:
            self.opened = self._try("opening", lambda: self.tracker.open(first_step, replay))
        what = f"logging steps {self.pending[0][0].step}-{self.pending[-1][0].step}" if self.pending else ""
        if self.opened and self.pending and self._try(what, lambda: self.tracker.log(self.pending)):
            self.pending = []

    def _try(self, what: str, call: Callable[[], None]) -> bool:
        try:
            call()
        except Exception as err:  # a tracker never takes the job down
            self.failures += 1
            self._failed_at = time.monotonic()
            if self.failures == 1 or self.failures % 100 == 0:
                text = str(err).strip().splitlines()[0] if str(err).strip() else ""
                log.warning("%s: %s failed (%s: %s; %d failures): %d records wait; tried again in %.0f s",
                            self.tracker.name, what, type(err).__name__, text, self.failures, len(self.pending),
                            RETRY_S)
            return False
        return True

    def close(self, status: str) -> None:
        if self.pending or self.dropped:
            log.warning("%s: %d records not sent (the run dir's next attempt replays them from metrics.jsonl)",
                        self.tracker.name, len(self.pending) + self.dropped)
        if self.started:  # even with no record: an MLflow run started this attempt is marked as it ended
            self._try("closing", lambda: self.tracker.close(status))


def open_trackers(job: JobConfig, run_dir: Path, is_main: bool) -> Trackers:
    """Rank 0's trackers for this attempt (none on other ranks, or with `logger=none`)."""
    return Trackers(job.logger.selected if is_main else [], job, run_dir)
