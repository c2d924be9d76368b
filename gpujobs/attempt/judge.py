"""The one judge of how an attempt ended, for both supervisors (torch-free).

Rank 0 records every attempt it lives through. What stands beside the ranks (the local launcher, the
Slurm batch step's supervisor) records the others once the ranks are gone, from the same facts
(`AttemptEnd`): the line rank 0 wrote, if any; the hang watchdog's report; whether every rank exited
0; what the ranks left of their end (`gpujobs.attempt.failures`); how the step ended, in the
supervisor's words. `judge` walks one ladder over them, first match wins:

1. rank 0 wrote the attempt's line: it stands (the supervisor writes none);
2. the watchdog found it hung (and killed it): `hung`, naming the culprit;
3. the supervisor killed ranks that still ran when the time limit was up (a pod's: nothing else enforces
   `cluster.time` there): `timeout`;
4. every rank exited 0: `completed` (a script job's line is the supervisor's: `record_completed`);
5. every rank left how it ended: the first failure (`failed`), else a stop a rank was told of;
6. else `failed`, with the supervisor's words (a rank that was killed leaves nothing).

`record_verdict` writes the verdict's line, once, through `record_attempt` (which requeues a Slurm job
within the budgets), and says whether another attempt may follow.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gpujobs.attempt.preemption import record_attempt
from gpujobs.config.load import JobConfig
from gpujobs.rundir.attempts import AttemptLog, AttemptNotRecorded, Decision, RequeuePolicy, say_unrecorded
from gpujobs.rundir.records import Attempt, write_result_or_say

if TYPE_CHECKING:
    from gpujobs.attempt.hangs import HangReport


@dataclass(frozen=True)
class AttemptEnd:
    """What a supervisor knows of an attempt once its ranks are gone: the facts the judge weighs."""

    ranks: int
    """The attempt's world size."""
    started: float
    """When the supervisor started it (Unix time)."""
    exited_ok: bool
    """Every rank exited 0 (submitit's job succeeded; the srun step's exit code was 0)."""
    recorded: Optional[Attempt] = None
    """The line rank 0 wrote for it, if it wrote one."""
    hang: Optional[HangReport] = None
    """The watchdog's report, where it found the attempt hung and killed it."""
    left: Optional[tuple[str, dict[str, Any]]] = None
    """How the ranks ended, where every rank left it (`failures.left_outcome`)."""
    error: str = ""
    """How the ranks ended, in the supervisor's words (submitit's error, what srun said)."""
    node: Optional[str] = None
    """The node of a crash the supervisor saw (srun's first task that ended badly)."""
    script: bool = False
    """A script job: its `completed` line is the supervisor's, once every rank exited 0."""
    timed_out: bool = False
    """The supervisor killed ranks that still ran when the attempt's time limit was up."""


@dataclass(frozen=True)
class Verdict:
    """How an attempt ended, and the line a supervisor writes for it."""

    reason: str
    error: str
    """What to say of its end (rank 0's own words where it recorded them)."""
    line: Optional[dict[str, Any]] = field(default=None)
    """The fields of the line to write besides `reason`; None: none to write (rank 0 wrote it, or a
    trainer's ranks completed: rank 0 wrote its line before it exited)."""
    recorded: Optional[Attempt] = None
    """Rank 0's line, where it wrote one."""


def judge(end: AttemptEnd) -> Verdict:
    """The verdict on an attempt from what its supervisor knows (the ladder in this module's docstring)."""
    if end.recorded is not None:
        hang_error = end.hang.attempt_fields()["error"] if end.hang is not None else end.error
        return Verdict(end.recorded.reason, end.recorded.error or hang_error, recorded=end.recorded)
    if end.hang is not None:
        fields = end.hang.attempt_fields()  # where it began comes from the heartbeats
        return Verdict("hung", fields["error"], {"world_size": end.ranks, **fields})
    started = {"start": round(end.started, 3), "world_size": end.ranks}
    if end.timed_out:
        return Verdict("timeout", end.error, {**started, "error": end.error})
    if end.exited_ok:
        return Verdict("completed", "", {**started, "script_exit": 0} if end.script else None)
    if end.left is not None:
        reason, fields = end.left
        return Verdict(reason, fields.get("error", end.error), {**started, **fields})
    node = {"node": end.node} if end.node is not None else {}
    return Verdict("failed", end.error, {**started, "error": end.error, **node})


def record_verdict(ledger: AttemptLog, job: JobConfig, verdict: Verdict, recorded_by: str) -> Decision:
    """Write `verdict`'s line with `ledger` where the ranks wrote none (a full disk: said in one line);
    returns whether another attempt may follow, and why."""
    if verdict.recorded is not None:
        return _decision_of(ledger, job, verdict.recorded)
    if verdict.line is None:
        return Decision(False, verdict.reason)
    if verdict.reason == "completed":
        started = float(verdict.line["start"])
        record_completed(ledger.run_dir, job, int(verdict.line["world_size"]), started, time.time() - started,
                         recorded_by=recorded_by, ledger=ledger)
        return Decision(False, "completed")
    recorded = record_or_say(ledger, job, verdict.reason, recorded_by=recorded_by, **verdict.line)
    return Decision(recorded.requeue, recorded.why)


def _decision_of(ledger: AttemptLog, job: JobConfig, line: Attempt) -> Decision:
    """The decision of the line rank 0 wrote; decided again where `ledger` holds attempts whose lines a
    full disk refused and that no lease kept: rank 0 could not count them."""
    if ledger.unrecorded and line.requeue:
        return RequeuePolicy.of(job.cluster).decide(ledger.read()[:-1], line.reason)
    return Decision(line.requeue, line.why)


def record_or_say(ledger: AttemptLog, job: JobConfig, reason: str, **fields: Any) -> Attempt:
    """`record_attempt` with `ledger`, for what stands beside the ranks: a line that cannot be written is
    said in one line on stderr instead, and the attempt is returned as decided."""
    try:
        return record_attempt(str(ledger.run_dir), job, reason, ledger=ledger, **fields)
    except AttemptNotRecorded as err:
        say_unrecorded(err)
        return err.attempt


def script_result(job: JobConfig, world_size: int, wall_s: float) -> dict[str, Any]:
    """A script job's result.json: its script ran to the end on `world_size` ranks in `wall_s` seconds."""
    path = job.script.path if job.script is not None else ""
    return {"status": "completed", "kind": "script", "script": path, "world_size": world_size,
            "wall_s": round(wall_s, 3)}


def record_completed(run_dir: Path, job: JobConfig, world_size: int, started: float, wall_s: float,
                     recorded_by: str = "rank 0", ledger: Optional[AttemptLog] = None) -> None:
    """Every rank's script exited 0 by itself: the attempt's `completed` line, then result.json.

    Rank 0 records it only when it ran alone. With peers, a script's rank 0 may end before another
    rank's script fails (a last save, an evaluation on one rank), so the line is written by what stands
    beside the ranks and sees all of them end: the supervisor of the Slurm step, or the local launcher.
    A full disk that takes neither is said in one line on stderr each; the run ends as it would have.
    """
    record_or_say(ledger or AttemptLog(Path(run_dir)), job, "completed", recorded_by=recorded_by,
                  world_size=world_size, start=round(started, 3), script_exit=0)
    write_result_or_say(run_dir, script_result(job, world_size, wall_s))
