"""The records that cross modules, typed once: an attempt (attempts.jsonl), a result (result.json)
and a metrics line (metrics.jsonl: a train, an eval, a plan, a checkpoint or a health record).

Writers build the dataclass and serialize it through `gpujobs.rundir.lines.to_line` (`Attempt.to_json`,
`Result.write`, `metrics_line`); readers get them from `read_attempts`, `read_result`, `read_metrics` (or
`metrics_record` for one line: the one dispatch on a metrics line's `kind`), which tolerate what a crash or
an older gpujobs left (a torn line is skipped, an unknown key ignored), so no reader indexes a raw dict by a
string of its own. Submissions are `files.Submission`; a rank's heartbeat is `heartbeat.Beat`.
"""

from __future__ import annotations

import errno
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional, Union

from gpujobs.base.atomic import read_jsonl, write_json_atomic
from gpujobs.rundir import ATTEMPTS_FILE, METRICS_FILE, RESULT_FILE
from gpujobs.rundir.lines import flat, from_line, key, to_line

#: Why an attempt ended. `hung`: the watchdog found no progress and killed it; `unhealthy`: the health
#: check at start failed on a node; `cancelled`: a local launcher that was interrupted (Ctrl-C, SIGTERM,
#: SIGHUP) killed its job; `interrupted`: a local launcher was killed outright (SIGKILL, the OOM killer),
#: recorded by rank 0 as it ended too. Neither is requeued: nothing is left to restart the job.
REASONS = ("completed", "preempted", "timeout", "failed", "hung", "unhealthy", "cancelled", "interrupted")
#: Reasons that blame a node: it leaves the job (Slurm's exclude list) before the next attempt.
NODE_FAULTS = ("hung", "unhealthy")


@dataclass(frozen=True)
class Attempt:
    """One attempt of a job: how it ended, how far it got, and whether another one follows."""

    attempt: int
    """1 for the first attempt of the run dir."""
    reason: str
    """completed | preempted | timeout | failed | hung | unhealthy | cancelled (a local launcher that
    was interrupted: Ctrl-C, SIGTERM, SIGHUP) | interrupted (a local launcher killed outright)."""
    requeue: bool
    """Whether another attempt follows (within the budgets, and the requeue worked)."""
    why: str
    """The budget decision, e.g. "preempted 2 of at most 20"."""
    end: float
    """When it ended (epoch seconds)."""
    start: Optional[float] = None
    job_id: Optional[str] = None
    """The job's id: Slurm's, or a JobSet's NAMESPACE/NAME (None for local runs)."""
    start_step: Optional[int] = None
    steps_done: Optional[int] = None
    resumed_from: Optional[str] = None
    """The checkpoint it resumed from."""
    saved: Optional[str] = None
    """The checkpoint it saved last."""
    resume_skipped: list[dict[str, Any]] = field(default_factory=list)
    """Newer checkpoints that did not verify on every rank: {"step", "why"} each."""
    error: Optional[str] = None
    """A failed attempt's error line."""
    recorded_by: str = "rank 0"
    """rank 0, or what stood beside the ranks when rank 0 could not: the launcher or the supervisor."""
    script_exit: Optional[int] = None
    """A bring-your-own script's exit code."""
    world_size: Optional[int] = None
    """Ranks the attempt ran with (elastic jobs: what the allocation gave)."""
    unit: Optional[str] = None
    """gpu or cpu: what each rank held (a resume may change the placement; the ledger costs each
    attempt as it ran)."""
    per_rank: Optional[int] = None
    """How many of `unit` each rank held."""
    culprit_rank: Optional[int] = None
    """hung: the rank the watchdog blames (its stack was not in a collective, or its progress stopped
    first); unhealthy: the rank that found the fault; failed: the rank whose error came first, where
    it was not rank 0's own (`gpujobs.attempt.failures`)."""
    node: Optional[str] = None
    """The node a hang, a crash or a failed health check is attributed to."""
    excluded: list[str] = field(default_factory=list)
    """Every node the job excludes from its next attempt on (Slurm), this attempt's node included."""
    evidence: Optional[str] = None
    """hung: the directory with every rank's stacks (RUN_DIR/hangs/<attempt>/)."""
    hung_s: Optional[float] = None
    """hung: seconds from the last progress of any rank to the watchdog's kill."""
    trained_from: Optional[float] = None
    """When the first training step of the attempt began (epoch seconds): start-up, restore and the
    health check came before it."""
    health_s: Optional[float] = None
    """Seconds the health check at start took."""
    image: Optional[str] = None
    """The container image the ranks ran in, as `container.image` names it (None: no container)."""
    image_id: Optional[str] = None
    """Podman: the ID (`sha256:...`) of the image `image` named when the attempt started, as Podman reports it
    (the digest of the image's config; an imported image has no registry digest). None where the runtime
    reports none without reading the whole image (a .sif file, an image directory, a squashfs, a bundle)."""

    @classmethod
    def from_json(cls, line: dict[str, Any]) -> Optional[Attempt]:
        """The attempt a line of attempts.jsonl holds, or None for a line that is not one (a field
        missing or of the wrong type, an unknown reason)."""
        attempt = from_line(cls, line)
        return attempt if attempt is not None and attempt.reason in REASONS else None

    def to_json(self) -> dict[str, Any]:
        """The line's JSON object (fields left unset are left out)."""
        return to_line(self, drop_empty=True)


def read_attempts(run_dir: Path) -> list[Attempt]:
    """Every attempt of the run dir, oldest first."""
    return read_ledger(run_dir)[0]


def read_ledger(run_dir: Path) -> tuple[list[Attempt], int]:
    """Every attempt of the run dir, oldest first, and how many of its complete lines hold a JSON object
    that is no attempt (a field missing or of the wrong type): skipped, for `cost` to say so."""
    lines = [Attempt.from_json(line) for line in read_jsonl(run_dir / ATTEMPTS_FILE)]
    attempts = [line for line in lines if line is not None]
    return attempts, len(lines) - len(attempts)


@dataclass(frozen=True)
class Result:
    """What a run that ended wrote: result.json."""

    status: str
    steps: Optional[int] = None
    world_size: Optional[int] = None
    samples: Optional[int] = None
    """Global samples trained over the run's whole life (every attempt, whatever its world size)."""
    samples_per_s: Optional[float] = None
    wall_s: Optional[float] = None
    param_digest: Optional[str] = None
    start_step: Optional[int] = None
    saved: Optional[str] = None
    resumed_from: Optional[str] = None
    resume_skipped: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """Every rank's place (node, local rank, visible GPUs) and its peak resident memory (peak_rss_mb)."""
    kind: str = "trainer"
    """trainer, or script (a bring-your-own script)."""
    script: Optional[str] = None
    metrics: dict[str, float] = field(default_factory=dict, metadata=flat())
    """The task's final evaluation (the rec job: auc, logloss, oracle_auc), kept flat in the file."""

    @property
    def completed(self) -> bool:
        """Whether the run completed."""
        return self.status == "completed"

    def leaves_nothing_to(self, max_steps: int) -> bool:
        """Whether it completed, with nothing left to train for a run of `max_steps` (a longer one continues
        it; a script's run has no steps to compare: complete is complete)."""
        return self.completed and (self.kind == "script" or self.steps is None or self.steps >= max_steps)

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> Optional[Result]:
        """The result a result.json object holds, or None for one that is not."""
        return from_line(cls, values)

    def to_json(self) -> dict[str, Any]:
        """result.json's object: the fields, with the task's metrics beside them."""
        return to_line(self)

    def write(self, run_dir: Path) -> None:
        """Write result.json atomically."""
        write_json_atomic(run_dir / RESULT_FILE, self.to_json())


def write_result(run_dir: Path, values: dict[str, Any]) -> Result:
    """Write the result a run returns (the trainer's or a script's dict) as result.json."""
    result = Result.from_json(values)
    if result is None:
        raise ValueError(f"not a result: {sorted(values)}")
    result.write(run_dir)
    return result


def write_result_or_say(run_dir: Path, values: dict[str, Any]) -> None:
    """`write_result`, once the attempt's `completed` line is recorded: a full disk is said in one line on
    stderr, not a traceback, and the run ends as it would have (what is not a full disk still raises)."""
    try:
        write_result(run_dir, values)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"gpujobs: the run completed, but its result could not be written to {run_dir / RESULT_FILE}: "
              f"{err.strerror}", file=sys.stderr, flush=True)


def read_result(run_dir: Path) -> Optional[Result]:
    """The run dir's result, or None (no result yet, or one torn by a crash)."""
    try:
        values = json.loads((run_dir / RESULT_FILE).read_text())
    except (OSError, ValueError):
        return None
    return Result.from_json(values) if isinstance(values, dict) else None


@dataclass(frozen=True)
class TrainRecord:
    """A train line of metrics.jsonl: the window of steps since the last one."""

    kind: ClassVar[str] = "train"
    step: int
    loss: float
    samples_per_s: float
    time: float = 0.0
    lr: Optional[float] = None
    step_time_s: list[float] = field(default_factory=list)
    """Every rank's mean step time, in rank order."""
    data_time_s: list[float] = field(default_factory=list)
    local_time_s: list[float] = field(default_factory=list)
    """Every rank's data wait + forward: the part before the gradient all-reduce makes ranks wait."""
    imbalance: Optional[float] = None
    """Slowest / median local time."""
    slowest_rank: Optional[int] = None
    counts: list[int] = field(default_factory=list)
    """Rows per rank per micro-batch in the window's last step (the split plan it trained with)."""
    compute_s_per_sample: list[float] = field(default_factory=list)
    """Every rank's measured compute time per sample over the window, in rank order."""
    balance: Optional[str] = None
    """The balance mode (off | static | dynamic | replay)."""


@dataclass(frozen=True)
class EvalRecord:
    """An eval line of metrics.jsonl: the task's metrics at a step (the rec job: auc, logloss, oracle_auc)."""

    kind: ClassVar[str] = "eval"
    step: int
    metrics: dict[str, float] = field(metadata=flat())
    """Kept flat in the line, beside the step."""
    time: float = 0.0


@dataclass(frozen=True)
class PlanRecord:
    """A plan line of metrics.jsonl: the split plan of the global batch, written at start and at each change."""

    kind: ClassVar[str] = "plan"
    step: int
    """The first step the plan applies to."""
    mode: str
    """The balance mode (off | static | dynamic | replay)."""
    reason: str
    """Why it was written: start | update | resume | resume, replanned (a static plan recomputed on resume, from
    a changed config or other GPUs) | replay | world."""
    shares: list[float]
    """Each rank's fraction of the global batch, in rank order (they sum to 1)."""
    counts: list[int] = field(default_factory=list)
    """Rows per rank per micro-batch."""
    time: float = 0.0


@dataclass(frozen=True)
class CheckpointRecord:
    """A checkpoint line of metrics.jsonl: one save, and how long it blocked training."""

    kind: ClassVar[str] = "checkpoint"
    step: int
    blocking_s: float
    background: bool = field(default=False, metadata=key("async"))
    """Key `async` in the line, as in the config (`checkpoint.async`): whether writing and publishing ran in
    the background."""
    time: float = 0.0


@dataclass(frozen=True)
class HealthRecord:
    """A health line of metrics.jsonl: the health check at the start of an attempt (`cluster.health_check`),
    written by rank 0 before any step, whether it passed or not."""

    kind: ClassVar[str] = "health"
    healthy: bool
    health_s: float
    """Seconds the check took."""
    busbw_gbps: Optional[float] = None
    """The all-reduce probe's bus bandwidth, GB/s (None: one rank, no link to measure)."""
    min_busbw_gbps: float = 0.0
    """The threshold it was held against (0: recorded, never failed)."""
    probe_mb: float = 0.0
    world_size: int = 1
    nvml: list[str] = field(default_factory=list)
    """Per node, what NVML could check ("node1: 8 GPUs checked", "node1: NVML unavailable (...)")."""
    faults: list[str] = field(default_factory=list)
    """Every sick GPU found, "node: GPU i (uuid): ..."."""
    error: Optional[str] = None
    """Why the check failed (the attempt's error)."""
    node: Optional[str] = None
    """The node the failure is attributed to."""
    time: float = 0.0


MetricsRecord = Union[TrainRecord, EvalRecord, PlanRecord, CheckpointRecord, HealthRecord]


#: Each metrics record type by the `kind` its lines hold.
METRICS_KINDS: dict[str, type[MetricsRecord]] = {
    cls.kind: cls for cls in (TrainRecord, EvalRecord, PlanRecord, CheckpointRecord, HealthRecord)
}


def metrics_record(line: dict[str, Any]) -> Optional[MetricsRecord]:
    """The record a metrics.jsonl line holds, or None (another kind, or a line that holds no record of its
    kind: a field missing or of another type)."""
    cls = METRICS_KINDS.get(line.get("kind"))  # type: ignore[arg-type]
    return None if cls is None else from_line(cls, line)


def metrics_line(record: MetricsRecord) -> dict[str, Any]:
    """The metrics.jsonl line of a record: its time and kind first, then its fields."""
    return {"time": record.time, "kind": record.kind, **to_line(record)}


def read_metrics(run_dir: Path) -> list[MetricsRecord]:
    """Every metrics record of the run dir, oldest first."""
    records = (metrics_record(line) for line in read_jsonl(run_dir / METRICS_FILE))
    return [record for record in records if record is not None]
