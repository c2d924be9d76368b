"""A prepare spread over a scheduler's job array (torch-free): one task per shard, the manifest by the last.

The submit side decides which shards need work (`start_prepare`, under the store's lock) and keeps that
decision in the store, as `TaskPlan` (`.prepare/tasks.pkl`, the user's alone); the array's task i runs
`python -m gpujobs.data.array_task STORE --index i`, prepares the i-th shard of that list and then, if every
shard of the plan is published, writes the manifest. Tasks end in any order and may run again (a requeue):
a published shard is not redone, and the manifest of the same shards is the same bytes whoever writes it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpujobs.base.atomic import fsync_path
from gpujobs.base.errors import GpujobsError
from gpujobs.data.layout import StoreLayout, shard_name
from gpujobs.data.manifest import Manifest, ShardRecord, StoreError
from gpujobs.data.prepare import PreparePlan, available_cores, finish_prepare, prepare_shard, shard_line
from gpujobs.data.shard_writer import published_shard
from gpujobs.data.store_files import check_store_dir, open_store_file

#: The store's folder of a prepare queued as a job array: its task plan and the tasks' logs.
TASKS_DIR = ".prepare"
TASK_PLAN = "tasks.pkl"


@dataclass(frozen=True)
class TaskPlan:
    """What a job array prepares: the whole plan, and the shards its tasks do, task i the i-th."""

    plan: PreparePlan
    todo: tuple[tuple[str, int], ...]


def tasks_dir(store: Path) -> Path:
    """Where a queued prepare keeps its task plan and its tasks' logs."""
    return Path(store) / TASKS_DIR


def write_task_plan(task_plan: TaskPlan) -> Path:
    """Keep `task_plan` in its store for the array's tasks (readable by its owner alone); its path."""
    folder = tasks_dir(task_plan.plan.store)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    check_store_dir(task_plan.plan.store, folder)  # a link there is refused, not followed by the chmod
    os.chmod(folder, 0o700)
    path = folder / TASK_PLAN
    partial = folder / f".{TASK_PLAN}.{os.getpid()}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        pickle.dump(task_plan, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, path)
    fsync_path(folder)
    return path


def read_task_plan(store: Path) -> TaskPlan:
    """The task plan kept in `store`; StoreError unless it is a regular file of this user that nobody else
    could have written (a pickle runs code as it loads: only one's own is loaded)."""
    path = tasks_dir(store) / TASK_PLAN
    try:
        fd = open_store_file(store, path)  # no link followed, no FIFO waited on
    except OSError as err:
        raise StoreError(store, f"has no task plan of a queued prepare ({path}: {err.strerror})") from None
    with os.fdopen(fd, "rb") as source:
        info = os.fstat(source.fileno())
        folder = os.stat(path.parent, follow_symlinks=False)
        foreign = [what for what, st in (("file", info), ("folder", folder))
                   if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)]
        if foreign or not stat.S_ISREG(info.st_mode):
            raise StoreError(store, f"its task plan {path} is not this user's alone ({', '.join(foreign) or 'file'}"
                                    "): not loaded")
        loaded = pickle.load(source)
    if not isinstance(loaded, TaskPlan):
        raise StoreError(store, f"{path} holds no task plan")
    return loaded


def complete_records(plan: PreparePlan) -> Optional[list[ShardRecord]]:
    """Every shard's record, in manifest order, when all are published and current; else None."""
    layout, columns = StoreLayout(plan.store), plan.parser.columns()
    records = []
    for split, index in plan.shards():
        record = published_shard(layout, shard_name(split, index), split, plan.splits[split][index], columns)
        if record is None:
            return None
        records.append(record)
    return records


def run_task(store: Path, index: int) -> Optional[Manifest]:
    """Task `index` of the queued prepare of `store`: its shard, then the manifest if every shard is there."""
    task_plan = read_task_plan(store)
    if not 0 <= index < len(task_plan.todo):
        raise StoreError(store, f"its queued prepare has tasks 0..{len(task_plan.todo) - 1}, not {index}")
    split, number = task_plan.todo[index]
    record = prepare_shard(task_plan.plan.with_cores(available_cores()), split, number)  # the task's CPUs
    print(f"gpujobs prepare: {shard_line(record)}", flush=True)
    records = complete_records(task_plan.plan)
    if records is None:
        return None
    manifest = finish_prepare(task_plan.plan, records)
    print(f"gpujobs prepare: store {store} ready: {manifest.rows('train')} train rows, "
          f"{manifest.rows('eval')} eval rows", flush=True)
    return manifest


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m gpujobs.data.array_task STORE --index I`: 0 done, 2 refused in one line (a bad line, a
    store that cannot be written)."""
    args = argparse.ArgumentParser(prog="python -m gpujobs.data.array_task")
    args.add_argument("store", type=Path)
    args.add_argument("--index", type=int, required=True, help="the task's index in the array")
    parsed = args.parse_args(argv)
    try:
        run_task(parsed.store, parsed.index)
    except GpujobsError as err:
        print(f"gpujobs: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    # run as the imported module, not as __main__: the pickled TaskPlan names gpujobs.data.array_task's class
    from gpujobs.data import array_task

    with contextlib.suppress(BrokenPipeError):
        sys.exit(array_task.main())
