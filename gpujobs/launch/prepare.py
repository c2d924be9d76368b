"""Prepare a data config's store where its job would run (torch-free): here, or as a scheduler's job array.

Here: `data.prepare_workers` processes on this machine (`prepare_store`). On a scheduler (`cluster=slurm`):
the shards that need work are decided now, under the store's lock, and queued as ONE job array whose task
i prepares the i-th of them; the task that finds every shard published writes the manifest. The array's
id is kept in the store (`.prepare/job`): while it may still run, any other prepare of the store, here or
queued, is refused, as a second prepare here is by the lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from gpujobs.backends import backend_named
from gpujobs.backends.base import Scheduler
from gpujobs.base.atomic import write_text_atomic
from gpujobs.config.load import JobConfig
from gpujobs.data.array_task import TaskPlan, complete_records, tasks_dir, write_task_plan
from gpujobs.data.manifest import Manifest, StoreError, read_manifest
from gpujobs.data.prepare import (
    PreparePlan,
    check_plan,
    finish_prepare,
    make_store,
    prepare_lock,
    prepare_store,
    start_prepare,
)
from gpujobs.data.store_files import read_store_file

#: In the store's `.prepare/`: "<backend> <job id>" of the job array that prepares it.
QUEUED_JOB = "job"
#: The job array's task logs, in the store's `.prepare/`.
LOGS = "logs"


def refuse_if_queued(store: Path) -> None:
    """StoreError when a job array queued to prepare `store` may still run (its scheduler says so)."""
    try:
        backend_name, job_id = read_store_file(store, tasks_dir(store) / QUEUED_JOB).decode().split()
    except (OSError, ValueError):  # none queued (a StoreError, a file not trusted, is no OSError: it stops here)
        return
    backend = backend_named(backend_name)
    if isinstance(backend, Scheduler):
        alive, state = backend.liveness(job_id)
        if alive:
            raise StoreError(store, f"is being prepared by {backend_name} job array {job_id} ({state}): wait for "
                                    "it to end, or cancel it")


def prepare_here(plan: PreparePlan, workers: int, log: Callable[[str], None]) -> Manifest:
    """Prepare `plan` on this machine, `workers` processes at a time; the manifest."""
    return prepare_store(plan, workers, log, under_lock=lambda: refuse_if_queued(plan.store))


def queue_prepare(job: JobConfig, plan: PreparePlan, backend: Scheduler, at_once: Optional[int],
                  log: Callable[[str], None]) -> Optional[str]:
    """Queue the shards of `plan` that need work as one job array of `backend` (at most `at_once` tasks
    running together); its id, or None when no shard needed work (the manifest is then written here)."""
    check_plan(plan, at_once or 1)
    make_store(plan.store)
    with prepare_lock(plan.store):
        refuse_if_queued(plan.store)
        todo = start_prepare(plan, log)
        if not todo:
            records = complete_records(plan)
            assert records is not None, "start_prepare found every shard published"
            finish_prepare(plan, records)
            return None
        write_task_plan(TaskPlan(plan, todo))
        job_id = backend.queue_prepare(job, plan.store, tasks_dir(plan.store) / LOGS, len(todo), at_once)
        write_text_atomic(tasks_dir(plan.store) / QUEUED_JOB, f"{backend.name} {job_id}\n")
    log(f"queued {backend.name} job array {job_id}: {len(todo)} tasks, one per shard that needs work; their "
        f"logs in {tasks_dir(plan.store) / LOGS}")
    return job_id


def follow_prepare(store: Path, backend: Scheduler, job_id: str, poll_s: float = 2.0) -> Manifest:
    """Wait for the job array to end; the store's manifest, or StoreError saying which tasks' logs to read."""
    while backend.liveness(job_id)[0]:
        time.sleep(poll_s)
    try:
        return read_manifest(store)
    except StoreError:
        errors = sorted(path for path in (tasks_dir(store) / LOGS).glob(f"{job_id}_*.err") if path.stat().st_size)
        said = [f"{path.name}: {_last_line(path)}" for path in errors[:3]]
        raise StoreError(store, f"its {backend.name} job array {job_id} ended before every shard was prepared"
                                f"{' (' + '; '.join(said) + ')' if said else ''}: run gpujobs prepare again "
                                "(the shards done are kept)") from None


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""
