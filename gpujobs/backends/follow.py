"""Follow a running job from its run dir: rank 0's metrics as progress, then its outcome (torch-free).

The local launcher and the Slurm backend both follow a job this way; whether the job is over is the
caller's to say (`JobFollower.follow`'s `over`): a scheduler's job is over only once the scheduler says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional

from gpujobs.base.atomic import JsonlTail
from gpujobs.config.load import JobConfig
from gpujobs.rundir import METRICS_FILE, RESULT_FILE
from gpujobs.rundir.progress import ProgressView
from gpujobs.rundir.records import read_attempts, read_result

_POLL_S = 0.25


class MetricsFollower:
    """Reads the records rank 0 appends to metrics.jsonl, as they arrive (`atomic.JsonlTail`): a line
    once complete, and only metrics records (with a step)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tail = JsonlTail(path, from_end=True)  # a rerun shows its own steps, not the last run's again

    def poll(self) -> Iterator[dict[str, Any]]:
        """New complete records since the last call."""
        return (record for record in self._tail.poll() if isinstance(record.get("step"), int))


class JobFollower:
    """Progress of one run dir across the attempts of its job (a context manager)."""

    def __init__(self, run_dir: Path, job: JobConfig) -> None:
        self.run_dir = run_dir
        self.metrics = MetricsFollower(run_dir / METRICS_FILE)
        self.view = ProgressView(job.trainer.max_steps, job.name, enabled=job.trainer.progress)

    def __enter__(self) -> JobFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.view.close()

    def _show_new(self) -> None:
        for record in self.metrics.poll():
            self.view.update(record)

    def follow(self, sjob: Any, tick: Optional[Callable[[], object]] = None,
               over: Optional[Callable[[], bool]] = None) -> Optional[str]:
        """Show progress until `sjob` (a submitit job) ends; None when every rank succeeded, else the
        failure's last line.

        `tick` (the hang watchdog's) is called at every poll while the job runs; `over` says whether the
        job is over (default: submitit's `done`, every task's result file is there).
        """

        from gpujobs.backends.submitit_private import JOB_ENDED_WITHOUT_RESULT

        over = over if over is not None else sjob.done
        try:
            while not over():
                self._show_new()
                if tick is not None:
                    tick()
                time.sleep(_POLL_S)
            self._show_new()
            results(sjob, self.run_dir)
        except KeyboardInterrupt:
            sjob.cancel()
            raise
        except JOB_ENDED_WITHOUT_RESULT as err:
            return failure_line(err)
        return None

    def print_result(self) -> None:
        """One line of the result's headline numbers, and where the result is."""
        result = read_result(self.run_dir)
        if result is None:
            return
        shown: dict[str, Any] = {"status": result.status, "steps": result.steps, "world_size": result.world_size,
                 **{k: result.metrics[k] for k in ("auc", "oracle_auc") if k in result.metrics},
                 "samples_per_s": result.samples_per_s}
        print("gpujobs: " + " ".join(f"{k}={v}" for k, v in shown.items() if v is not None))
        print(f"gpujobs: result in {self.run_dir / RESULT_FILE}")


def results(sjob: Any, run_dir: Path) -> list[Any]:
    """`sjob.results()` of a job that is done, over the ranks that its last attempt ran.

    submitit expects one result per task of the largest allocation; an elastic job (`--nodes=MIN-MAX`)
    may end on fewer nodes, and the ranks it did not start leave nothing to read. The attempt's line
    (or result.json) says how many ran; where neither does, every task is read.
    """
    ran = ranks_of_last_attempt(run_dir, str(sjob.job_id))
    if ran is None or ran >= sjob.num_tasks:
        return list(sjob.results())
    return [sjob.task(rank).result() for rank in range(ran)]


def ranks_of_last_attempt(run_dir: Path, job_id: str) -> Optional[int]:
    """The world size of the last attempt of Slurm job `job_id` in `run_dir`, where the ledger or the
    result says it."""
    attempts = read_attempts(run_dir)
    if not attempts or attempts[-1].job_id != job_id:
        return None  # a local run, or a job that recorded nothing (yet)
    if attempts[-1].world_size is not None:
        return attempts[-1].world_size
    result = read_result(run_dir)
    return result.world_size if result is not None else None


def failure_line(err: Exception) -> str:
    """The line of a submitit job failure that says why (its last), or the error's type."""
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__
