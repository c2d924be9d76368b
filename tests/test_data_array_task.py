"""A prepare as a job array's tasks, each a real process (`python -m gpujobs.data.array_task STORE --index I`),
here without a scheduler: in any order, one run twice, the last writes the manifest, and the store is the
one a prepare in one process makes. The live-Slurm array is tested in tests/test_prepare_slurm.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from data_toy_parser import write_toy_file
from test_data_prepare import PARSER, driver_env, fingerprint, inputs, plan_of

from gpujobs.data.array_task import TaskPlan, read_task_plan, tasks_dir, write_task_plan
from gpujobs.data.layout import StoreLayout
from gpujobs.data.manifest import StoreError
from gpujobs.data.prepare import make_store, prepare_store, start_prepare


def task(store: Path, index: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpujobs.data.array_task", str(store), "--index", str(index)],
                          env=driver_env(), capture_output=True, text=True, timeout=60)


def two_files(folder: Path) -> dict[str, tuple[Path, ...]]:
    return {"train": (write_toy_file(folder / "a.tsv", 20, seed=1),),
            "eval": (write_toy_file(folder / "b.tsv", 5, seed=2),)}


def queued(store: Path, splits: dict[str, tuple[Path, ...]], bad_lines: str = "fail") -> int:
    """What the submit side does before it queues the array: the tasks' plan; their number."""
    plan = plan_of(store, splits, bad_lines=bad_lines)
    make_store(store)
    todo = start_prepare(plan, log=lambda line: None)
    write_task_plan(TaskPlan(plan, todo))
    return len(todo)


def test_tasks_in_any_order_make_the_store_one_process_makes(tmp_path: Path) -> None:
    splits = inputs(tmp_path / "in")
    prepare_store(plan_of(tmp_path / "whole", splits), log=lambda line: None)
    store = tmp_path / "array"
    tasks = queued(store, splits)
    assert tasks == 4
    for index in (2, 0, 3):
        proc = task(store, index)
        assert proc.returncode == 0, proc.stderr
        assert not StoreLayout(store).manifest.exists()  # a shard is still missing
    proc = task(store, 1)
    assert proc.returncode == 0 and f"store {store} ready" in proc.stdout, proc.stdout + proc.stderr
    again = task(store, 2)  # a requeued task finds its shard published, and writes the same manifest
    assert again.returncode == 0, again.stderr
    assert fingerprint(store) == fingerprint(tmp_path / "whole")


def test_a_task_on_a_damaged_line_fails_in_one_line_and_leaves_no_manifest(tmp_path: Path) -> None:
    splits = inputs(tmp_path / "in", sizes=(50,))
    with open(splits["train"][0], "a") as out:
        out.write("2\t5\tword\n")
    store = tmp_path / "store"
    queued(store, splits)
    proc = task(store, 0)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"gpujobs: {splits['train'][0].name}:51: label '2' is not 0 or 1"], proc.stderr
    assert task(store, 1).returncode == 0
    assert not StoreLayout(store).manifest.exists()


def test_a_task_plan_someone_else_could_write_is_not_loaded(tmp_path: Path) -> None:
    splits = two_files(tmp_path)
    store = tmp_path / "store"
    queued(store, splits)
    os.chmod(tasks_dir(store) / "tasks.pkl", 0o622)
    with pytest.raises(StoreError, match="is not this user's alone"):
        read_task_plan(store)
    proc = task(store, 0)
    assert proc.returncode == 2 and "not loaded" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def test_an_index_outside_the_array_is_refused(tmp_path: Path) -> None:
    splits = two_files(tmp_path)
    store = tmp_path / "store"
    assert queued(store, splits) == 2
    proc = task(store, 2)
    assert proc.returncode == 2 and "has tasks 0..1, not 2" in proc.stderr, proc.stderr
    assert PARSER.name == read_task_plan(store).plan.parser.name


def test_a_task_writes_through_no_shards_link_planted_after_the_plan(tmp_path: Path) -> None:
    """Issue 36: an array task keeps the store's rules (a `shards` link planted after the plan was written is
    refused in one line, exit 2; nothing where it points changes)."""
    splits = two_files(tmp_path)
    store = tmp_path / "store"
    queued(store, splits)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "run1").mkdir(parents=True)
    (elsewhere / "run1" / "model.pt").write_bytes(b"mine")
    os.rmdir(StoreLayout(store).shards)
    StoreLayout(store).shards.symlink_to(elsewhere)
    proc = task(store, 0)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"gpujobs: data.store='{store}': shards is a symlink: not used (remove it, if it is no store's, and run "
        "gpujobs prepare again)"], proc.stderr
    assert sorted(p.name for p in elsewhere.rglob("*")) == ["model.pt", "run1"]
