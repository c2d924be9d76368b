"""The hang watchdog's decisions, from real heartbeat files written by real `Heartbeat` objects, read
on a clock the test moves: when an attempt counts as hung, and whom it blames."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpujobs.attempt.watchdog import Hang, HangDetector, blame_by_stacks, in_collective
from gpujobs.rundir.heartbeat import Heartbeat, heartbeat_path, instance, read_beat

TIMEOUT_S, SLOW_S = 10.0, 60.0


class Clock:
    """A clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Ranks:
    """`world` heartbeats of this process (no writer thread: each `beat` is one write, as the thread's)."""

    def __init__(self, run_dir: Path, world: int) -> None:
        self.beats = [Heartbeat(run_dir, rank, f"node{rank + 1}", interval_s=3600) for rank in range(world)]
        for beat in self.beats:
            beat.start()

    def set(self, rank: int, step: int, phase: str) -> None:
        self.beats[rank].step, self.beats[rank].phase = step, phase

    def beat(self, *ranks: int) -> None:
        for rank in ranks or range(len(self.beats)):
            self.beats[rank]._write()

    def close(self) -> None:
        for beat in self.beats:
            beat.close()


@pytest.fixture
def ranks(tmp_path: Path):  # type: ignore[no-untyped-def]
    made = Ranks(tmp_path, 2)
    yield made
    made.close()


def watch(run_dir: Path, clock: Clock, world: int = 2) -> HangDetector:
    return HangDetector(run_dir, world, instance(), TIMEOUT_S, SLOW_S, clock=clock)


def advance(watcher: HangDetector, clock: Clock, ranks: Ranks, seconds: float, *beating: int) -> Hang | None:
    """Move the clock in 1 s ticks, the `beating` ranks' threads writing at each; the last poll's hang."""
    hang = None
    for _ in range(int(seconds)):
        clock.now += 1
        if beating:
            ranks.beat(*beating)
        hang = watcher.poll()
    return hang


def test_progress_is_no_hang_and_silence_is(tmp_path: Path, ranks: Ranks) -> None:
    clock = Clock()
    watcher = watch(tmp_path, clock)
    for step in range(1, 30):  # 29 s of steps, one a second
        ranks.set(0, step, "compute")
        ranks.set(1, step, "compute")
        assert advance(watcher, clock, ranks, 1, 0, 1) is None
    # both now wait in a collective, threads alive: nothing changes for TIMEOUT_S
    ranks.set(0, 30, "collective")
    ranks.set(1, 30, "data")
    assert advance(watcher, clock, ranks, TIMEOUT_S - 1, 0, 1) is None
    hang = advance(watcher, clock, ranks, 2, 0, 1)
    assert hang is not None and hang.stalled_s >= TIMEOUT_S
    assert hang.culprit == 1 and hang.node == "node2" and "stuck in phase data" in hang.why, hang


def test_a_rank_whose_heartbeat_stopped_is_blamed(tmp_path: Path, ranks: Ranks) -> None:
    clock = Clock()
    watcher = watch(tmp_path, clock)
    ranks.set(0, 5, "compute")
    ranks.set(1, 5, "compute")
    advance(watcher, clock, ranks, 2, 0, 1)
    hang = advance(watcher, clock, ranks, TIMEOUT_S + 1, 0)  # rank 1's thread stopped (SIGSTOP)
    assert hang is not None and hang.culprit == 1 and "stopped running" in hang.why, hang


def test_slow_phases_get_their_own_limit(tmp_path: Path, ranks: Ranks) -> None:
    clock = Clock()
    watcher = watch(tmp_path, clock)
    ranks.set(0, 40, "eval")
    ranks.set(1, 40, "collective")  # waits at the barrier while rank 0 evaluates
    assert advance(watcher, clock, ranks, SLOW_S - 2, 0, 1) is None  # a long eval is not a hang
    hang = advance(watcher, clock, ranks, 3, 0, 1)
    assert hang is not None and hang.limit_s == SLOW_S and hang.culprit == 0 and "eval" in hang.why, hang


def test_a_rank_that_never_reports_is_blamed_after_the_start_up_limit(tmp_path: Path) -> None:
    made = Ranks(tmp_path, 3)
    try:
        os.unlink(heartbeat_path(tmp_path, 2))  # rank 2 never started
        clock = Clock()
        watcher = watch(tmp_path, clock, world=3)
        made.set(0, 0, "collective")
        made.set(1, 0, "collective")
        assert advance(watcher, clock, made, SLOW_S - 2, 0, 1) is None
        hang = advance(watcher, clock, made, 3, 0, 1)
        assert hang is not None and hang.culprit == 2 and "never reported" in hang.why, hang
    finally:
        made.close()


def test_files_of_an_earlier_attempt_are_not_this_attempts(tmp_path: Path, ranks: Ranks) -> None:
    clock = Clock()
    watcher = HangDetector(tmp_path, 2, "slurm:999:0", TIMEOUT_S, SLOW_S, clock=clock)
    assert advance(watcher, clock, ranks, SLOW_S * 2, 0, 1) is None  # nothing of instance slurm:999:0
    assert watcher.ranks == {}


def test_an_attempt_whose_ranks_all_ended_is_no_hang_until_its_processes_outstay(tmp_path: Path, ranks: Ranks) -> None:
    clock = Clock()
    watcher = watch(tmp_path, clock)
    ranks.set(1, 7, "compute")
    ranks.beats[0].close()  # writes phase "done"
    assert read_beat(heartbeat_path(tmp_path, 0)).phase == "done"  # type: ignore[union-attr]
    assert advance(watcher, clock, ranks, 2, 1) is None  # rank 1 is a moment from done
    ranks.beats[1].close()
    assert advance(watcher, clock, ranks, TIMEOUT_S - 3) is None  # the processes exit within moments...
    hang = advance(watcher, clock, ranks, 3)  # ... unless a teardown hangs
    assert hang is not None and hang.limit_s == TIMEOUT_S and "said done" in hang.why and "did not exit" in hang.why


def test_a_rank_that_stopped_running_after_a_peer_ended_is_hung_at_once(tmp_path: Path, ranks: Ranks) -> None:
    """Rank 1 stops; rank 0 fails (of it, or of its own) and ends. Nothing waits on rank 1 any more, and it
    never ends by itself: it is hung within seconds of the end, before `hang_timeout_s` has passed."""
    clock = Clock()
    watcher = watch(tmp_path, clock)
    ranks.set(0, 30, "compute")
    ranks.set(1, 30, "compute")
    advance(watcher, clock, ranks, 2, 0, 1)
    assert advance(watcher, clock, ranks, 2, 0) is None  # rank 1's thread stopped
    ranks.beats[0].close()
    hang = advance(watcher, clock, ranks, watcher.stall_s + 2)
    assert hang is not None and hang.culprit == 1 and hang.limit_s == watcher.stall_s, hang
    assert clock.now - 1000.0 < TIMEOUT_S and "stopped running" in hang.why, hang
    assert "ranks [0] ended without it" in hang.why, hang


def test_a_rank_still_running_after_a_peer_ended_gets_its_phases_limit(tmp_path: Path, ranks: Ranks) -> None:
    clock = Clock()
    watcher = watch(tmp_path, clock)
    ranks.set(1, 12, "compute")  # in a collective whose peer is gone, until its own timeout
    ranks.beats[0].close()
    assert advance(watcher, clock, ranks, TIMEOUT_S - 1, 1) is None
    hang = advance(watcher, clock, ranks, 2, 1)
    assert hang is not None and hang.culprit == 1 and hang.limit_s == TIMEOUT_S, hang
    assert "did not end" in hang.why and "phase compute, step 12" in hang.why, hang


PY_SPY_IN_COLLECTIVE = '''Thread 10 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2801)
    any_true (gpujobs/rank/collectives.py:60)
    Trainer.fit (gpujobs/rank/trainer.py:290)
Thread 11 (idle): "gpujobs-heartbeat"
    Event.wait (threading.py:629)
'''
PY_SPY_IN_DATA = '''Thread 12 (active): "MainThread"
    RecData.train_rows (jobs/rec/data.py:120)
    Trainer.train_step (gpujobs/rank/trainer.py:225)
Thread 13 (idle): "gpujobs-heartbeat"
    Event.wait (threading.py:629)
'''
FAULTHANDLER_IN_DATA = '''Thread 0x00007f (most recent call first):
  File "threading.py", line 331 in wait
  File "threading.py", line 629 in wait

Current thread 0x00007e (most recent call first):
  File "jobs/rec/data.py", line 120 in train_rows
  File "gpujobs/rank/trainer.py", line 225 in train_step
'''


def test_stacks_tell_a_rank_outside_a_collective() -> None:
    assert in_collective(PY_SPY_IN_COLLECTIVE)
    assert not in_collective(PY_SPY_IN_DATA)  # the heartbeat thread's wait is not the main thread's
    assert not in_collective(FAULTHANDLER_IN_DATA)
    unclear = Hang(12.0, 10.0, 0, "node1", "stopped making progress first (phase compute, step 7)")
    refined = blame_by_stacks(unclear, {0: PY_SPY_IN_COLLECTIVE, 1: FAULTHANDLER_IN_DATA})
    assert refined.culprit == 1 and "not in a collective" in refined.why
    stronger = Hang(12.0, 10.0, 0, "node1", "stopped running 9 s ago")
    assert blame_by_stacks(stronger, {0: PY_SPY_IN_COLLECTIVE, 1: FAULTHANDLER_IN_DATA}) is stronger


def test_a_rank_stopped_in_a_slow_phase_gets_the_plain_limit(tmp_path: Path, ranks: Ranks) -> None:
    """A stopped process saves nothing: a rank whose heartbeat stopped in a save holds its peers as a
    rank stopped anywhere else does, for `hang_timeout_s`, not for the slow phase's limit."""
    clock = Clock()
    watcher = watch(tmp_path, clock)
    ranks.set(0, 30, "checkpoint")
    ranks.set(1, 30, "checkpoint")
    advance(watcher, clock, ranks, 1, 0, 1)
    assert advance(watcher, clock, ranks, TIMEOUT_S - 2, 0) is None
    hang = advance(watcher, clock, ranks, 3, 0)  # only rank 0's thread writes
    assert hang is not None and hang.limit_s == TIMEOUT_S and hang.culprit == 1, hang
    assert "stopped running" in hang.why and "phase checkpoint" in hang.why, hang
