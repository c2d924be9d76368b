"""Every attempt of a job, and whether another one may follow (torch-free: both sides use it).

`attempts.jsonl` in the run dir holds one line per attempt: when it started and ended, why it ended
(completed, preempted, timeout, failed), the steps it reached, the checkpoint it resumed from and the
one it saved, and the requeue decision. Budgets are separate: being preempted twenty times is normal on
a busy cluster; failing by itself twenty times is a bug that no requeue will fix.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpujobs.atomic import fsync_path, read_jsonl, write_text_atomic
from gpujobs.config import ClusterConfig
from gpujobs.rundir import ATTEMPTS_FILE


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

    @classmethod
    def of(cls, cluster: ClusterConfig) -> RequeuePolicy:
        """The budgets `cluster` sets (max_preemptions, max_timeouts, max_restarts)."""
        return cls(cluster.max_preemptions, cluster.max_timeouts, cluster.max_restarts)

    def decide(self, history: list[dict[str, Any]], reason: str) -> Decision:
        """Decide for an attempt that just ended with `reason`, given the attempts before it."""
        if reason == "completed":
            return Decision(False, "completed")
        budget = {"preempted": self.max_preemptions, "timeout": self.max_timeouts, "failed": self.max_failures}[reason]
        used = sum(1 for line in history if line.get("reason") == reason)
        if used < budget:
            return Decision(True, f"{reason} {used + 1} of at most {budget}")
        return Decision(False, f"{reason} budget exhausted ({budget} {reason} attempts allowed)")


class AttemptLog:
    """Appends and reads `attempts.jsonl` (one writer at a time: rank 0, or the local launcher)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / ATTEMPTS_FILE

    def read(self) -> list[dict[str, Any]]:
        """All complete lines, oldest first (a torn last line from a crash is ignored)."""
        return read_jsonl(self.path)

    def record(self, cluster: ClusterConfig, record: dict[str, Any]) -> tuple[int, Decision]:
        """Decide whether another attempt may follow the one that just ended, and write its line;
        returns the attempt's number and the decision."""
        history = self.read()
        decision = RequeuePolicy.of(cluster).decide(history, record["reason"])
        self.append({"attempt": len(history) + 1, **record, "requeue": decision.requeue, "why": decision.why})
        return len(history) + 1, decision

    def amend_last(self, changes: dict[str, Any]) -> None:
        """Update the last attempt's line in place (atomically: the file is rewritten whole)."""
        lines = self.read()
        lines[-1].update(changes)
        write_text_atomic(self.path, "".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))

    def append(self, record: dict[str, Any]) -> None:
        """Add one attempt's line, durably."""
        line = json.dumps({"end": round(time.time(), 3), **record}, sort_keys=True) + "\n"
        with open(self.path, "a") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_path(self.path.parent)
