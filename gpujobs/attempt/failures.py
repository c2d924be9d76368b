"""Which rank failed first, and where: the attempt's line names it, not rank 0's echo of it.

When one rank raises, the others fail after it, in the collective it no longer joins ("Connection
closed by peer"); rank 0, which writes the attempt's line, would record that echo and no node. So
every rank that fails leaves its error in RUN_DIR/failures/rank_<N>.json, with the attempt's identity
(`heartbeat.instance`) and the time, before it tears its process group down: the peers only see the
failure once it has. Rank 0 reads them all and records the first one: its error, its rank and its
node. "First" compares the ranks' wall clocks: across nodes, as close as NTP keeps them (milliseconds),
while a peer's echo comes at least a process teardown later. A rank that was killed leaves nothing, so
a peer is blamed only where every rank left a file. A script job's ranks also leave how they ended
otherwise (done, or stopped), for the supervisor and the launcher. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.atomic import write_json_atomic
from gpujobs.base.errors import GpujobsError
from gpujobs.rundir import FAILURES_DIR
from gpujobs.rundir.heartbeat import instance
from gpujobs.rundir.trust import own_dir


@dataclass(frozen=True)
class RankFailure:
    """How one rank ended, where it ran, and when: mostly a failure and what it raised."""

    rank: int
    node: str
    error: str
    at: float
    ended: str = "failed"
    """`failed`; or, for the ranks of a script job, `done` (its script exited 0) or the reason it was told
    to stop (`preempted`, `timeout`): what the supervisor and the launcher read (`left_outcome`)."""


def failure_path(run_dir: Path, rank: int) -> Path:
    """Rank `rank`'s failure file."""
    return Path(run_dir) / FAILURES_DIR / f"rank_{rank}.json"


def leave(run_dir: Path, failure: RankFailure) -> None:
    """Write how this rank ended, for rank 0 (best effort: a full disk must not hide the real error)."""
    path = failure_path(run_dir, failure.rank)
    with contextlib.suppress(OSError):
        own_dir(path.parent.parent, path.parent.name)  # a link planted in the run dir is not followed
        write_json_atomic(path, {"instance": instance(), "rank": failure.rank, "node": failure.node,
                                 "error": failure.error, "at": failure.at, "ended": failure.ended})


def _read(path: Path, attempt: str) -> Optional[RankFailure]:
    try:
        record = json.loads(path.read_text())
        if record.get("instance") != attempt:  # an earlier attempt's
            return None
        return RankFailure(int(record["rank"]), str(record["node"]), str(record["error"]), float(record["at"]),
                           str(record.get("ended", "failed")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _left(run_dir: Path, world_size: int, attempt: str) -> dict[int, RankFailure]:
    """What the ranks of `attempt` left, by rank, each file opened by name."""
    return {rank: f for rank in range(world_size) if (f := _read(failure_path(run_dir, rank), attempt)) is not None}


def _earliest(ends: list[RankFailure]) -> RankFailure:
    return min(ends, key=lambda f: (f.at, f.rank))


def first(run_dir: Path, world_size: int, own: RankFailure, grace_s: float = 1.0) -> RankFailure:
    """The failure of this attempt that came first, `own` (rank 0's) included; `own` unless every peer
    left how it ended.

    A peer that was killed (the OOM killer, a segfault) leaves nothing, and the others' errors are then
    all echoes of its death, one of which may well come before rank 0's: with a peer unaccounted for,
    no peer is blamed. Each rank's file is opened by name (a listing of a shared filesystem's directory
    may lag). A peer writes its file before its process group goes, so it is there once rank 0 fails of
    it; rank 0 looks again for up to `grace_s` for the ones it misses, for a filesystem that shows them late.
    """
    attempt = instance()
    deadline = time.monotonic() + grace_s
    while True:
        left = _left(run_dir, world_size, attempt)
        peers = [f for rank, f in left.items() if rank != own.rank]
        if len(peers) == world_size - 1 or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if len(peers) < world_size - 1:
        return own
    return _earliest([own, *[f for f in peers if f.ended == "failed"]])


def left_outcome(run_dir: Path, world_size: int, attempt: str) -> Optional[tuple[str, dict[str, Any]]]:
    """For what stood beside the ranks (the supervisor, the local launcher), once every rank ended and
    rank 0 recorded nothing: the attempt's reason and `record_attempt` fields from what the ranks of
    `attempt` left, where every rank left how it ended. The first failure (`failed`, naming its rank and
    node); else a stop a rank was told of after rank 0 was done (`preempted`, `timeout`); else None, as
    where a rank left nothing (killed: the others' errors are echoes of it, and srun says more).
    """
    left = _left(run_dir, world_size, attempt)
    if len(left) < world_size:
        return None
    failed = [f for f in left.values() if f.ended == "failed"]
    if failed:
        cause = _earliest(failed)
        return "failed", {"error": f"rank {cause.rank}: {cause.error}", "culprit_rank": cause.rank,
                          "node": cause.node}
    stops = [f for f in left.values() if f.ended != "done"]
    return (_earliest(stops).ended, {}) if stops else None


def silent(run_dir: Path, world_size: int, attempt: str, last_line: str) -> Optional[str]:
    """For the local launcher, where `left_outcome` found a rank that left nothing: the attempt's error,
    naming the ranks that left no word of their end (killed, or dead before they could leave one) and
    what the others left, then submitit's `last_line` (a log's last line: maybe the error, maybe not).
    None where every rank left a file."""
    left = _left(run_dir, world_size, attempt)
    quiet = [rank for rank in range(world_size) if rank not in left]
    if not quiet:
        return None
    who = f"rank {quiet[0]}" if len(quiet) == 1 else f"ranks {', '.join(map(str, quiet))}"
    parts = [f"{who} left no error of its own (killed by a signal or the OOM killer, or dead before it could)"]
    failed = [f for f in left.values() if f.ended == "failed"]
    if failed:
        echo = _earliest(failed)
        parts.append(f"rank {echo.rank} failed after it: {echo.error}")
    parts.append(f"the log's last line: {last_line}")
    return "; ".join(parts)


def ended(run_dir: Path, rank: int, node: str, how: str) -> None:
    """A script job's rank ended without failing: `done`, or told to stop for reason `how`. Its rank 0 may
    end before the others, so what stands beside the ranks records the attempt from these."""
    leave(run_dir, RankFailure(rank, node, "" if how == "done" else f"stopped: {how}", time.time(), ended=how))


def attempt_fields(run_dir: Path, world_size: int, own: RankFailure, culprit: Optional[int] = None) -> dict[str, Any]:
    """Rank 0's `record_attempt` fields of a failed attempt: the first error; its rank and node where
    another rank's error came before rank 0's own (or rank 0 ran alone). Where rank 0's error is the
    first one seen, it may still be an echo (a peer that was killed leaves no file): no rank is blamed.
    An error that names its culprit (`culprit`: a failed save, which every rank raises at once, knows
    whose write failed) blames that rank instead of the clock."""
    cause = first(run_dir, world_size, own)
    named = own if culprit == own.rank else _left(run_dir, world_size, instance()).get(culprit) if (
        culprit is not None) else None
    if named is not None:
        return {"error": f"rank {named.rank}: {named.error}", "culprit_rank": named.rank, "node": named.node}
    if cause is not own:
        return {"error": f"rank {cause.rank}: {cause.error}", "culprit_rank": cause.rank, "node": cause.node}
    if world_size == 1:
        return {"error": own.error, "culprit_rank": own.rank, "node": own.node}
    return {"error": f"rank {own.rank}: {own.error}"}


def fail(run_dir: Path, rank: int, node: str, world_size: int, error: str,
         raised: Optional[BaseException] = None) -> Optional[dict[str, Any]]:
    """This rank failed with `error` (`raised`, whose `culprit_ranks` name its cause, if it knows one):
    leave it for rank 0; on rank 0, the attempt's `record_attempt` fields (`attempt_fields`), None on
    the others."""
    own = RankFailure(rank, node, error, time.time())
    leave(run_dir, own)
    named = raised.culprit_ranks if isinstance(raised, GpujobsError) else ()
    return attempt_fields(run_dir, world_size, own, named[0] if named else None) if rank == 0 else None
