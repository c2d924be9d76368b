"""The hang watchdog across a JobSet's pods: pod 0 watches, every other pod answers and obeys.

The ranks' heartbeats lie in the run dir, on the volume every pod mounts, so pod 0's supervisor watches all
of them with the watchdog the local launcher and the Slurm supervisor run (`HangWatchdog`). No pod can signal
another's processes, so the rest goes through two files of the run dir's heartbeat dir, both named for the
attempt (`instance()`: the JobSet's name, submission and restart):
- `stacks-request.<instance>`: pod 0 asks for the stacks of the ranks it cannot reach; each other pod's
  supervisor has its own ranks write them (`evidence.ask_local_stacks`: a stopped rank continued alone),
  into their stacks files, which pod 0 reads from the volume as it reads its own ranks'.
- `hung.<instance>`: pod 0 found the attempt hung and killed its ranks; each other pod's supervisor kills its
  own at once, rather than after the failure grace (a stopped rank would never end by itself).
Pod 0 then records the attempt `hung`, and the pods exit as for any failure.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

from gpujobs.attempt import evidence
from gpujobs.attempt.hangs import HangWatchdog
from gpujobs.config.load import JobConfig
from gpujobs.rundir import HEARTBEAT_DIR
from gpujobs.rundir.heartbeat import Beat, heartbeat_path, read_beat
from gpujobs.rundir.trust import write_own


def request_path(run_dir: Path, instance: str, what: str) -> Path:
    """The request file `what` (`stacks-request`, `hung`) of attempt `instance`."""
    return Path(run_dir) / HEARTBEAT_DIR / f"{what}.{instance.replace(':', '-')}"


class PodWatch:
    """What one pod's supervisor does about hangs while its ranks run: `tick` every poll.

    Pod 0 (`watchdog` set) watches every rank; the other pods answer its requests for stacks, and kill their
    ranks once it found the attempt hung."""

    def __init__(self, run_dir: Path, instance: str, pids: dict[int, int],
                 watchdog: Optional[HangWatchdog] = None) -> None:
        self.run_dir = Path(run_dir)
        self.instance = instance
        self.pids = pids
        """This pod's ranks: global rank -> pid."""
        self.watchdog = watchdog
        self._answered = False
        self._killed = False

    @classmethod
    def for_pod(cls, run_dir: Path, job: JobConfig, world: int, instance: str, attempt: int,
                pids: dict[int, int], first: bool) -> PodWatch:
        """Pod 0's (`first`) watch with its watchdog (none when `trainer.hang_timeout_s` is 0), or another pod's."""
        watch = cls(run_dir, instance, pids)
        if first:
            watch.watchdog = HangWatchdog.for_job(run_dir, job, world, instance, attempt, kill=watch.kill_all,
                                                  signal_remote=watch.ask_remote_stacks)
        return watch

    def tick(self) -> None:
        """Pod 0: look at the heartbeats. The others: answer a request for stacks, and die with a hung attempt."""
        if self.watchdog is not None:
            self.watchdog.tick()
            return
        if not self._answered and request_path(self.run_dir, self.instance, "stacks-request").exists():
            self._answered = True
            beats = {rank: beat for rank in self.pids if (beat := self._beat(rank)) is not None}
            here = {rank: pid for rank, pid in self.pids.items() if rank in beats}
            evidence.ask_local_stacks(self.run_dir, beats, here)
        if not self._killed and request_path(self.run_dir, self.instance, "hung").exists():
            self._killed = True
            evidence.kill_tree(list(self.pids.values()))

    def ask_remote_stacks(self) -> None:
        """Pod 0's `signal_remote`: the other pods' supervisors have their ranks write their stacks."""
        write_own(request_path(self.run_dir, self.instance, "stacks-request"), "stacks\n")

    def kill_all(self) -> None:
        """Pod 0's `kill`: tell the other pods, then kill this pod's ranks."""
        with contextlib.suppress(OSError):  # a full volume: the others end by their failure grace instead
            write_own(request_path(self.run_dir, self.instance, "hung"), "hung\n")
        evidence.kill_tree(list(self.pids.values()))

    def _beat(self, rank: int) -> Optional[Beat]:
        """Rank `rank`'s heartbeat, where it is this attempt's (its main thread names the stacks' last block)."""
        beat = read_beat(heartbeat_path(self.run_dir, rank))
        return beat if beat is not None and beat.instance == self.instance else None
