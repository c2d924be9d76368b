"""The hang detector beside the ranks: when did any rank last make progress, and who is to blame.

The supervisor (the local launcher; on Slurm the batch step's `gpujobs.attempt.supervise`) calls
`HangDetector.poll` about once a second. It reads every rank's heartbeat (`gpujobs.rundir.heartbeat`) and
notes, on its own clock, when each rank's (step, phase) and its write counter last changed:

- the attempt is hung once no rank's (step, phase) changed for `trainer.hang_timeout_s`, or for
  `trainer.hang_slow_phase_s` while some rank is in a phase that is slow by nature (start-up, a save,
  an evaluation) and every rank runs: a long save or eval is not a hang, a stopped rank's is;
- once a rank is done (it finished, or failed), the others must end too: one that stopped running is
  hung at once, one still running after its phase's limit; processes still there `hang_timeout_s` after
  every rank said done hang in their teardown;
- the culprit is, in this order: a rank that never reported; a rank whose writes stopped (its process
  is stopped or gone: the others wait for it), the one that stopped first; a rank that is not in a
  phase where ranks wait for each other while others are; a rank whose stack shows no collective
  (`blame_by_stacks`, once the stacks are taken); else the rank whose progress stopped first.

Torch-free: the supervisor never imports torch.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gpujobs.rundir.heartbeat import SLOW_PHASES, WAITING_PHASES, Beat, heartbeat_path, interval_for, read_beat

# A rank whose write counter did not move for this many heartbeat intervals (plus slack) is not running.
_STALL_INTERVALS = 3
_STALL_SLACK_S = 2.0
# Frames of a rank blocked in a collective: torch.distributed's calls, a Work's wait, DDP's reducer.
_COLLECTIVE_FRAME = re.compile(
    r"\b(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast\w*|barrier|gather_object|monitored_barrier|"
    r"wait|_sync_buffers|_pre_forward|_engine_run_backward|any_true|all_gather_rows)\b"
)


@dataclass
class RankView:
    """What the watchdog saw of one rank, on its own clock."""

    record: Beat
    progress_at: float
    """When its (step, phase) last changed."""
    beat_at: float
    """When its write counter last changed."""

    @property
    def phase(self) -> str:
        return self.record.phase

    @property
    def step(self) -> int:
        return self.record.step


@dataclass(frozen=True)
class Hang:
    """A hung attempt: how long nothing moved, whom to blame and why."""

    stalled_s: float
    """Seconds since any rank last made progress."""
    limit_s: float
    culprit: int
    node: Optional[str]
    why: str
    ranks: dict[int, Beat] = field(default_factory=dict)
    """Every rank's last heartbeat record."""

    def describe(self) -> str:
        """One line for the log and the attempt's error."""
        where = f" on {self.node}" if self.node else ""
        return (f"no progress for {self.stalled_s:.0f} s (limit {self.limit_s:.0f} s): rank {self.culprit}{where} "
                f"{self.why}")


class HangDetector:
    """Watches the heartbeats of one attempt (`instance`: see `heartbeat.instance`) of `world_size` ranks."""

    def __init__(
        self, run_dir: Path, world_size: int, instance: str, hang_timeout_s: float, slow_phase_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.world_size = world_size
        self.instance = instance
        self.hang_timeout_s = hang_timeout_s
        self.slow_phase_s = max(slow_phase_s, hang_timeout_s)
        self.stall_s = _STALL_INTERVALS * interval_for(hang_timeout_s) + _STALL_SLACK_S
        self.clock = clock
        self.started = clock()
        self.ranks: dict[int, RankView] = {}
        self._ended_at: Optional[float] = None
        """When a rank was first seen done."""

    def observe(self) -> None:
        """Read every rank's heartbeat and note what changed."""
        now = self.clock()
        for rank in range(self.world_size):
            record = read_beat(heartbeat_path(self.run_dir, rank))
            if record is None or record.instance != self.instance:
                continue  # not written yet, or by an earlier attempt
            seen = self.ranks.get(rank)
            if seen is None:
                self.ranks[rank] = RankView(record, now, now)
                continue
            if (record.step, record.phase) != (seen.record.step, seen.record.phase):
                seen.progress_at = now
            if record.beats != seen.record.beats:
                seen.beat_at = now
            seen.record = record

    def poll(self) -> Optional[Hang]:
        """Observe, then the hang if there is one now (None while the attempt makes progress)."""
        self.observe()
        if not self.ranks:
            return None  # nothing reported yet: start-up (torch's rendezvous timeout covers a stuck start)
        now = self.clock()
        ended = sorted(rank for rank, view in self.ranks.items() if view.phase == "done")
        if ended:
            return self._after_end(ended, now)
        last = max(view.progress_at for view in self.ranks.values())
        missing = [r for r in range(self.world_size) if r not in self.ranks]
        # a rank that stopped running saves or evaluates nothing: its peers wait on it, whatever their phase
        stopped = any(now - view.beat_at > self.stall_s for view in self.ranks.values())
        slow = bool(missing) or (not stopped and any(view.phase in SLOW_PHASES for view in self.ranks.values()))
        limit = self.slow_phase_s if slow else self.hang_timeout_s
        if now - last < limit:
            return None
        culprit, why = self.blame(missing, now)
        node = self.ranks[culprit].record.node if culprit in self.ranks else None
        return Hang(now - last, limit, culprit, node, why, {r: v.record for r, v in sorted(self.ranks.items())})

    def _after_end(self, ended: list[int], now: float) -> Optional[Hang]:
        """Ranks `ended` are done (succeeded or failed): the attempt is ending, and the others must end too.

        A finished rank's peers are a moment from done, a failed rank's fail of it within the process
        group's timeout. A rank that stopped running (its heartbeat stopped) never ends by itself, and
        nothing waits on it any more to time out: it is hung once it has stayed so `stall_s` past the
        first end. One still running gets its phase's limit from the first end seen.
        """
        if self._ended_at is None:
            self._ended_at = now
        left = {rank: view for rank, view in self.ranks.items() if view.phase != "done"}
        missing = [rank for rank in range(self.world_size) if rank not in self.ranks]
        since = now - self._ended_at
        if not left and not missing:  # all done: their processes exit within moments, unless teardown hangs
            if since < self.hang_timeout_s:
                return None
            culprit = min(self.ranks)
            return Hang(since, self.hang_timeout_s, culprit, self.ranks[culprit].record.node,
                        f"and every other rank said done {since:.0f} s ago, yet the attempt's processes did not "
                        "exit (a teardown that hangs: the process group's, a background save's)",
                        {r: v.record for r, v in sorted(self.ranks.items())})
        stopped = sorted((view.beat_at, rank) for rank, view in left.items() if now - view.beat_at > self.stall_s)
        slow = bool(missing) or any(view.phase in SLOW_PHASES for view in left.values())
        limit = self.stall_s if stopped else self.slow_phase_s if slow else self.hang_timeout_s
        if since < limit:
            return None
        if stopped:
            beat_at, culprit = stopped[0]
            why = (f"stopped running {now - beat_at:.0f} s ago in phase {left[culprit].phase} at step "
                   f"{left[culprit].step} (its heartbeat stopped), and ranks {ended} ended without it")
        elif missing:
            culprit, why = missing[0], f"never reported, and ranks {ended} ended without it"
        else:
            culprit = min(left)
            why = (f"did not end {since:.0f} s after ranks {ended} did (phase {left[culprit].phase}, step "
                   f"{left[culprit].step})")
        node = self.ranks[culprit].record.node if culprit in self.ranks else None
        last = max(view.progress_at for view in self.ranks.values())
        return Hang(now - last, limit, culprit, node, why, {r: v.record for r, v in sorted(self.ranks.items())})

    def blame(self, missing: list[int], now: float) -> tuple[int, str]:
        """The culprit rank and why, from the heartbeats alone."""
        if missing:
            return missing[0], "never reported (its process did not start or hung before its first heartbeat)"
        views = self.ranks
        stopped = sorted((view.beat_at, rank) for rank, view in views.items() if now - view.beat_at > self.stall_s)
        if stopped:
            beat_at, rank = stopped[0]
            return rank, (f"stopped running {now - beat_at:.0f} s ago in phase {views[rank].phase} at step "
                          f"{views[rank].step} (its heartbeat stopped; the others wait for it)")
        waiting = [rank for rank, view in views.items() if view.phase in WAITING_PHASES]
        busy = sorted(rank for rank, view in views.items() if view.phase not in WAITING_PHASES)
        if waiting and busy:
            rank = busy[0]
            return rank, f"is stuck in phase {views[rank].phase} at step {views[rank].step} while ranks {waiting} wait"
        return self.first_stopped()

    def first_stopped(self) -> tuple[int, str]:
        """The rank behind the others, or whose progress stopped first."""
        rank = min(self.ranks, key=lambda r: (self.ranks[r].step, self.ranks[r].progress_at))
        view = self.ranks[rank]
        return rank, f"stopped making progress first (phase {view.phase}, step {view.step})"


def in_collective(stack: str) -> bool:
    """Whether a rank's main-thread stack (py-spy's or faulthandler's text) is inside a collective."""
    main = _main_thread(stack)
    return bool(_COLLECTIVE_FRAME.search(main))


def _main_thread(stack: str) -> str:
    """The main thread's part of a stack dump (py-spy: `Thread ... "MainThread"`; faulthandler: the
    `Current thread` block, which is the thread the signal interrupted: the main one)."""
    blocks = re.split(r"\n(?=Thread |Current thread )", stack)
    for block in blocks:
        if '"MainThread"' in block or block.startswith("Current thread"):
            return block
    return stack


def blame_by_stacks(hang: Hang, stacks: dict[int, str]) -> Hang:
    """Refine a hang blamed by `first_stopped` with the ranks' stacks: the one rank outside a collective
    while the others are inside one is the culprit. Other blames are kept (they are stronger)."""
    if not hang.why.startswith("stopped making progress first") or len(stacks) < 2:
        return hang
    outside = sorted(rank for rank, text in stacks.items() if text.strip() and not in_collective(text))
    inside = sorted(rank for rank, text in stacks.items() if text.strip() and in_collective(text))
    if len(outside) == 1 and inside:
        rank = outside[0]
        node = hang.ranks[rank].node if rank in hang.ranks else None
        return Hang(hang.stalled_s, hang.limit_s, rank, node,
                    f"is not in a collective while ranks {inside} are (see its stack)", hang.ranks)
    return hang
