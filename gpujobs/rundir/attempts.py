"""Every attempt of a job, and whether another one may follow (torch-free: both sides use it).

`attempts.jsonl` in the run dir holds one line per attempt: when it started and ended, why it ended
(completed, preempted, timeout, failed, hung, unhealthy), the steps it reached, the checkpoint it resumed from and the
one it saved, and the requeue decision. Budgets are separate: being preempted twenty times is normal on
a busy cluster; failing by itself twenty times is a bug that no requeue will fix. A hang counts
against the failure budget (`cluster.max_restarts`) together with failures; a failed health check
against its own (`cluster.max_unhealthy`): it blames a node, which leaves the job, not the job's code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpujobs.base.atomic import append_jsonl
from gpujobs.base.errors import GpujobsError
from gpujobs.config.load import ClusterConfig
from gpujobs.rundir import ATTEMPTS_FILE, lease
from gpujobs.rundir.records import Attempt, read_attempts


@dataclass(frozen=True)
class Decision:
    """Whether the job should run again, and why (said in attempts.jsonl and the logs)."""

    requeue: bool
    why: str


@dataclass(frozen=True)
class RequeuePolicy:
    """Budgets per reason: how many times each may end an attempt before the job gives up."""

    max_preemptions: int
    max_timeouts: int
    max_failures: int
    max_unhealthy: int = 3

    @classmethod
    def of(cls, cluster: ClusterConfig) -> RequeuePolicy:
        """The budgets `cluster` sets (max_preemptions, max_timeouts, max_restarts, max_unhealthy)."""
        return cls(cluster.max_preemptions, cluster.max_timeouts, cluster.max_restarts, cluster.max_unhealthy)

    def decide(self, history: list[Attempt], reason: str) -> Decision:
        """Decide for an attempt that just ended with `reason`, given the attempts before it."""
        if reason in ("completed", "cancelled", "interrupted"):
            return Decision(False, reason)
        # each budget, and the reasons that spend it
        spends = {"failed": ("failed", "hung"), "hung": ("failed", "hung")}.get(reason, (reason,))
        budget = {
            "preempted": self.max_preemptions, "timeout": self.max_timeouts, "failed": self.max_failures,
            "hung": self.max_failures, "unhealthy": self.max_unhealthy,
        }[reason]
        used = sum(1 for line in history if line.reason in spends)
        shared = " (failures and hangs share cluster.max_restarts)" if len(spends) > 1 and used else ""
        if used < budget:
            return Decision(True, f"{reason} {used + 1} of at most {budget}{shared}")
        return Decision(False, f"{reason} budget exhausted ({budget} {reason} attempts allowed){shared}")


# What a line keeps when the whole one does not fit (a full disk): what budgets, `status` and `cost` read.
_ESSENTIAL = frozenset({"attempt", "reason", "requeue", "why", "end", "start", "job_id", "recorded_by",
                        "world_size", "unit", "per_rank", "start_step", "steps_done", "saved", "excluded",
                        "image", "image_id"})


_SHORTENED = " (written without its details: the disk was full)"


class AttemptNotRecorded(GpujobsError):
    """An attempt's line could not be written, not even without its details (a full disk)."""

    def __init__(self, attempt: Attempt, path: Path, err: OSError, in_lease: bool) -> None:
        self.attempt = attempt
        kept = ("kept in the lease" if in_lease
                else "in this process's memory only: the lease could not be written either")
        super().__init__(f"attempt {attempt.attempt} ended {attempt.reason} ({attempt.why}), but its line could "
                         f"not be written to {path}: {err.strerror or err}; the budgets still count it ({kept})")


class AttemptLog:
    """Appends and reads `attempts.jsonl` (one writer at a time: rank 0, or a supervisor beside the ranks).

    A line that cannot be written whole (a full disk) is written without its details; one that cannot
    be written at all is kept in the run dir's lease (`lease.keep_unrecorded`) and here (`unrecorded`: the
    lease may not take it either), counted by every log's decisions and written before the next line:
    a launcher that outlives a full disk, or the next process to judge the budgets, still spends them.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ATTEMPTS_FILE
        self.unrecorded: list[Attempt] = []

    def read(self) -> list[Attempt]:
        """All attempts, oldest first (a torn last line from a crash is ignored), with those no line holds."""
        written = read_attempts(self.run_dir)
        return sorted([*written, *self._unwritten(written)], key=lambda attempt: attempt.end)

    def _unwritten(self, written: list[Attempt]) -> list[Attempt]:
        """The attempts that this log or the lease keeps and that no line of `written` holds (the lease
        is rewritten after the line: a crash between the two would count one twice)."""
        held = lease.read(self.run_dir)
        kept = [a for a in map(Attempt.from_json, held.unrecorded if held else []) if a is not None]
        seen = {(a.attempt, a.end) for a in written}
        pending: dict[tuple[int, float], Attempt] = {}
        for attempt in [*kept, *self.unrecorded]:
            if (attempt.attempt, attempt.end) not in seen:
                pending.setdefault((attempt.attempt, attempt.end), attempt)
        return list(pending.values())

    def decide(self, cluster: ClusterConfig, reason: str) -> Decision:
        """Whether another attempt may follow the one that just ended with `reason`, within `cluster`'s
        budgets, given every attempt before it (those only the lease or this log keeps too)."""
        return RequeuePolicy.of(cluster).decide(self.read(), reason)

    def record(self, cluster: ClusterConfig, reason: str, **fields: Any) -> Attempt:
        """Decide whether another attempt may follow the one that just ended with `reason`, and write
        its line (`fields`: the other `Attempt` fields); returns the attempt as written (see `write`)."""
        return self.write(reason, self.decide(cluster, reason), **fields)

    def write(self, reason: str, decision: Decision, **fields: Any) -> Attempt:
        """Write the line of the attempt that just ended with `reason`, as `decision` says (whether another
        may follow, and why), once; returns the attempt as written.

        Raises AttemptNotRecorded (the attempt kept in the lease and `unrecorded`) when no line could be written."""
        history = self.read()
        attempt = Attempt(
            attempt=len(history) + 1, reason=reason, requeue=decision.requeue, why=decision.why,
            end=round(time.time(), 3), **fields,
        )
        pending = self._unwritten(read_attempts(self.run_dir))
        for earlier in list(pending):  # one that fits now goes in first, in its place
            with contextlib.suppress(OSError):
                self._append(earlier)
                pending.remove(earlier)
        try:
            written = self._append(attempt)
        except OSError as err:
            pending.append(attempt)
            self.unrecorded = pending
            raise AttemptNotRecorded(attempt, self.path, err, self._keep(pending)) from None
        self.unrecorded = pending
        self._keep(pending)
        return written

    def _keep(self, pending: list[Attempt]) -> bool:
        """Keep `pending` (their short lines) in the lease; whether it took them."""
        return lease.keep_unrecorded(self.run_dir, [_short(attempt) for attempt in pending])

    def _append(self, attempt: Attempt) -> Attempt:
        """Write `attempt`'s line, or, where it does not fit, the line without its details; returns the
        attempt as written. Raises the OSError of the short line when neither fits."""
        lines = (attempt.to_json(), _short(attempt))
        failed = OSError("not written")
        for line in lines:
            try:
                size = self.path.stat().st_size
            except FileNotFoundError:
                size = 0
            try:
                append_jsonl(self.path, line, durable=True)
            except OSError as err:
                failed = err
                # a part-written line would take the room the short one needs: the file goes back as it was
                with contextlib.suppress(OSError):
                    os.truncate(self.path, size)
                continue
            written = Attempt.from_json(line)
            assert written is not None  # built from an Attempt: it reads back as one
            return written
        raise failed


def _short(attempt: Attempt) -> dict[str, Any]:
    """`attempt`'s line without its details, saying so (what a full disk may still take)."""
    # one that the lease kept is short already
    why = attempt.why if attempt.why.endswith(_SHORTENED) else attempt.why + _SHORTENED
    return {key: value for key, value in dataclasses.replace(attempt, why=why).to_json().items() if key in _ESSENTIAL}


def say_unrecorded(err: AttemptNotRecorded) -> None:
    """One line on stderr for an attempt whose line could not be written."""
    print(f"gpujobs: {err}", file=sys.stderr, flush=True)
