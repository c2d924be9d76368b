"""What the supervisor does about a hang: notice it, keep the evidence, then kill the whole attempt.

Used by both supervisors (the local launcher, the Slurm batch step): they call `HangWatchdog.tick` while
the attempt runs, and once it returns True (evidence taken, every process of the attempt killed)
their judge (`gpujobs.attempt.judge`) records the attempt as `hung` with `HangReport.attempt_fields`,
and it restarts within the budget. `HangWatchdog` acts; its `HangDetector` (`gpujobs.attempt.watchdog`)
only tells whether the attempt is hung, and whom to blame. Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpujobs.attempt import evidence
from gpujobs.attempt.watchdog import Hang, HangDetector, blame_by_stacks
from gpujobs.config.load import JobConfig
from gpujobs.rundir.heartbeat import interval_for, remove_dead_pipe_dirs
from gpujobs.rundir.lines import to_line
from gpujobs.rundir.trust import own_dir, write_own

log = logging.getLogger(__name__)

_TICK_S = 1.0


@dataclass(frozen=True)
class HangReport:
    """A hang that was handled: whom it blames, where its evidence is, how long it held the GPUs."""

    hang: Hang
    evidence_dir: Path
    hung_s: float
    """From the last progress of any rank to the end of the kill."""

    def attempt_fields(self) -> dict[str, Any]:
        """The `hung` attempt line's fields; where it began and how far it got come from the heartbeats.

        Steps done: the furthest rank's step. DDP keeps the ranks within a step of each other, and a
        stopped rank's heartbeat may lag its last steps by up to an interval, while the ranks waiting
        for it keep writing theirs.
        """
        beats = list(self.hang.ranks.values())
        progress = {
            "start": min(b.started for b in beats), "start_step": min(b.start_step for b in beats),
            "steps_done": max(b.step for b in beats),
        } if beats else {}
        began = [b.trained_from for b in beats if b.trained_from is not None]
        if began:
            progress["trained_from"] = min(began)
        return {
            **progress, "culprit_rank": self.hang.culprit, "node": self.hang.node, "evidence": str(self.evidence_dir),
            "hung_s": round(self.hung_s, 1), "error": f"hung: {self.hang.describe()}",
        }


class HangWatchdog:
    """One attempt's hang watchdog: `tick` often; `report` says what happened once it fired.

    It asks its `HangDetector` whether the attempt is hung; once it is, it keeps the evidence and kills.

    `kill` ends every process of the attempt; `signal_remote` (Slurm) sends SIGUSR1 to the ranks on
    other machines, whose stacks their faulthandler then writes.
    """

    def __init__(
        self, run_dir: Path, job: JobConfig, world_size: int, instance: str, attempt: int,
        kill: Callable[[], None], signal_remote: Optional[Callable[[], None]] = None,
    ) -> None:
        cfg = job.trainer
        self.run_dir = Path(run_dir)
        self.attempt = attempt
        self.detector = HangDetector(run_dir, world_size, instance, cfg.hang_timeout_s, cfg.hang_slow_phase_s)
        self.kill = kill
        self.signal_remote = signal_remote
        self.beat_interval_s = interval_for(cfg.hang_timeout_s)
        self.report: Optional[HangReport] = None
        self._next = 0.0

    @classmethod
    def for_job(cls, run_dir: Path, job: JobConfig, world_size: int, instance: str, attempt: int,
                kill: Callable[[], None], signal_remote: Optional[Callable[[], None]] = None) -> Optional[HangWatchdog]:
        """The watchdog of the attempt, or None when `trainer.hang_timeout_s` is 0."""
        if not job.trainer.hang_timeout_s:
            return None
        return cls(run_dir, job, world_size, instance, attempt, kill, signal_remote)

    def tick(self) -> bool:
        """Look at the heartbeats (at most once a second); True once the attempt was found hung and killed."""
        if self.report is not None:
            return True
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + _TICK_S
        hang = self.detector.poll()
        if hang is None:
            return False
        self.report = self.handle(hang)
        return True

    def handle(self, hang: Hang) -> HangReport:
        """Evidence first (stacks, flight recorder, NVML), then kill; returns the report."""
        began = time.monotonic()
        log.error("gpujobs: attempt %d is hung: %s", self.attempt, hang.describe())
        out = evidence.hang_dir(self.run_dir, self.attempt)
        how: dict[int, str] = {}
        traces: list[int] = []
        kept = False
        try:
            own_dir(self.run_dir, *out.relative_to(self.run_dir).parts)  # a link planted in the run dir: refused
            kept = True
            hang, how, traces = self._evidence(hang, out)
        except Exception as err:  # a full disk, a file where the folder goes: the hung ranks must die all the same
            log.error("gpujobs: could not keep the evidence of the hang in %s: %r", out, err)
        self.kill()
        hung_s = hang.stalled_s + time.monotonic() - began
        remove_dead_pipe_dirs()  # those of the ranks killed on this node (their next attempt's do the others')
        try:
            if kept:  # never into a folder that was not found to be this run's
                evidence.write_summary(out, {
                    "attempt": self.attempt, "culprit_rank": hang.culprit, "node": hang.node, "why": hang.why,
                    "stalled_s": round(hang.stalled_s, 1), "limit_s": hang.limit_s,
                    "stacks": {str(r): h for r, h in how.items()},
                    "flight_recorder_ranks": traces,
                    "heartbeats": {str(r): to_line(beat) for r, beat in hang.ranks.items()},
                    "supervisor_pid": os.getpid(),
                })
        except OSError as err:
            log.error("gpujobs: could not write the hang's summary in %s: %r", out, err)
        log.error("gpujobs: evidence of the hang in %s; every process of attempt %d killed", out, self.attempt)
        return HangReport(hang, out, hung_s)

    def _evidence(self, hang: Hang, out: Path) -> tuple[Hang, dict[int, str], list[int]]:
        """Every rank's stacks, the flight recorder, NVML, in `out`; the hang blamed by the stacks, how
        each rank's stacks were taken, and the ranks whose flight recorder was dumped."""
        how = evidence.take_stacks(self.run_dir, out, hang.ranks, self.signal_remote)
        stacks = {rank: (out / f"rank_{rank}.txt").read_text(errors="replace") for rank in how}
        hang = blame_by_stacks(hang, stacks)
        traces = evidence.dump_flight_recorder(self.run_dir, out, hang.ranks, self.beat_interval_s)
        snapshot = evidence.nvml_snapshot()
        write_own(out / "nvml.json", json.dumps(snapshot, indent=2, sort_keys=True, default=str) + "\n")
        return hang, how, traces
