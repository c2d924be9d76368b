"""Bring your own script: run a torchrun-style training script unchanged, one process per rank.

The script reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as it
would under torchrun; gpujobs supplies them from the local or Slurm job, along with the NCCL settings.

Stops and budgets are those of the trainer. When the rank gets Slurm's USR2 (the time limit is near,
or the job is preempted) the script gets SIGTERM: it should save what it needs in `GPUJOBS_RUN_DIR`
and exit before the time limit (it has `cluster.signal_lead_s` seconds; a preempted job has the
partition's GraceTime). Rank 0 then records the attempt and, within `cluster.max_preemptions` or
`cluster.max_timeouts`, requeues the job; the next attempt runs the script again, which resumes from
what it saved. A script that fails by itself is recorded as failed, within `cluster.max_restarts`. An attempt is
recorded completed once every rank's script exited 0 (`record_completed`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gpujobs.attempt import failures, orphan
from gpujobs.attempt.judge import record_completed, script_result
from gpujobs.backends.jobenv import detect, export_torchrun_env
from gpujobs.config.load import JobConfig
from gpujobs.rundir.nccl import export_nccl_env

if TYPE_CHECKING:
    from gpujobs.attempt.preemption import StopFlag

#: What the script gets when the job must stop.
STOP_SIGNAL = signal.SIGTERM


@dataclass
class ScriptJob:
    """Run `job.script` as this rank; raises if the script exits non-zero by itself."""

    job: JobConfig
    run_dir: str
    master_port: Optional[int] = None

    def __call__(self) -> dict[str, Any]:
        from gpujobs.attempt.preemption import StopFlag

        watcher = StopFlag().install()  # first: a USR2 from now on is ours, not submitit's
        try:  # ... until the attempt is recorded: submitit's own USR2 handler would requeue it outside the budgets
            return self._run(watcher)
        finally:
            watcher.uninstall()

    def _run(self, watcher: StopFlag) -> dict[str, Any]:
        from gpujobs.attempt.preemption import EXIT_REQUEUED, classify_stop, record_attempt

        started = time.time()
        script = self.job.script
        if script is None:
            raise TypeError("ScriptJob needs a job with a script (make_payload builds it only then)")
        info = detect(self.master_port)
        if info.is_main:  # how far the script got is its own business: the line says when it ran, and why it ended
            orphan.record_if_orphaned(self.run_dir, self.job, started, dict)
        export_torchrun_env(info)
        export_nccl_env(self.job.nccl, Path(self.run_dir))
        os.environ["GPUJOBS_RUN_DIR"] = self.run_dir
        clock = time.perf_counter()
        code, told = _run_until_done([sys.executable, script.path, *script.args], script.cwd,
                                     lambda: watcher.flagged)
        # only a script that was told to stop stopped: a USR2 that came after it exited changes nothing
        told_at = (watcher.flagged_at or time.time()) if told else None
        line: dict[str, Any] = {"start": round(started, 3), "script_exit": code}
        if told_at is not None:
            reason = classify_stop(self.job, started, told_at)
            if info.is_main:
                record_attempt(self.run_dir, self.job, reason, **line)
            else:  # rank 0's script may have ended before the stop came
                failures.ended(Path(self.run_dir), info.rank, info.node, reason)
            raise SystemExit(EXIT_REQUEUED)  # like the trainer: no result, the job is not over
        if code != 0:
            launcher = orphan.gone_launcher()
            if launcher is not None:  # killed as its launcher went (by this rank's watcher, or a peer's end)
                orphan.say_last_words(launcher)
                raise RuntimeError(f"{script.path} ended as the local launcher went, with code {code}")
            error = f"{script.path} exited with code {code}"
            # rank 0 records the rank that failed first, if not itself (its peers fail of it)
            blamed = failures.fail(Path(self.run_dir), info.rank, info.node, info.world_size, error)
            if blamed is not None:
                record_attempt(self.run_dir, self.job, "failed", **line, **blamed)
            raise RuntimeError(f"{error} on rank {info.rank}")
        wall_s = time.perf_counter() - clock
        if info.world_size == 1:
            record_completed(Path(self.run_dir), self.job, 1, started, wall_s)
        else:
            failures.ended(Path(self.run_dir), info.rank, info.node, "done")
        # with peers, rank 0 cannot know that theirs will exit 0 too: what sees every rank end records it
        return {**script_result(self.job, info.world_size, wall_s), "rank": info.rank, "node": info.node}


def _run_until_done(command: list[str], cwd: Optional[str], stop_asked: Any) -> tuple[int, bool]:
    """Run the script; tell it to stop (once) as soon as `stop_asked()`; returns its exit code, and
    whether it was told (a stop asked for after it exited by itself is none of its business)."""
    # Slurm signals every process of a step: the script must hear of the stop from us, as SIGTERM, and not
    # die of USR2's default action (ignored dispositions survive exec; a script may still install its own).
    proc = subprocess.Popen(command, cwd=cwd or None, preexec_fn=_ignore_usr2)
    told = False
    while True:
        try:
            return proc.wait(timeout=0.2), told
        except subprocess.TimeoutExpired:
            if stop_asked() and not told:
                proc.send_signal(STOP_SIGNAL)
                told = True


def _ignore_usr2() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
