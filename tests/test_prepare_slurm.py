"""`gpujobs prepare` on the live Slurm cluster of scripts/local-slurm.sh: ONE job array, a task per shard,
the same store as a prepare here; while the array may run, another prepare of its store is refused."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_data_prepare import fingerprint
from test_prepare_cli import criteo, prepare, write_days

from gpujobs.data.manifest import read_manifest

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_days(tmp_path_factory.mktemp("days"))


def prepare_on_slurm(days: Path, store: Path, slurm: dict[str, str], *more: str,
                     env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpujobs.prepare", *criteo(days, store), "cluster=slurm",
                           "cluster.time=5", *more], cwd=store.parent, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **slurm, "PYTHONUNBUFFERED": "1", **(env or {})})


def array_id(stdout: str) -> str:
    found = re.search(r"queued slurm job array (\d+): (\d+) tasks", stdout)
    assert found, stdout
    return found.group(1)


def test_a_prepare_on_slurm_is_one_job_array_that_makes_the_store_a_prepare_here_makes(
        days: Path, tmp_path: Path, slurm: dict[str, str]) -> None:
    here = prepare(*criteo(days, tmp_path / "here"), "cluster=local", cwd=tmp_path)
    assert here.returncode == 0, here.stdout + here.stderr
    proc = prepare_on_slurm(days, tmp_path / "queued", slurm)  # followed to its end by default
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "queued slurm job array" in proc.stdout and ": 3 tasks" in proc.stdout, proc.stdout
    assert fingerprint(tmp_path / "queued") == fingerprint(tmp_path / "here")
    again = prepare_on_slurm(days, tmp_path / "queued", slurm, "cluster.wait=true")
    assert again.returncode == 0 and "nothing queued" in again.stdout, again.stdout + again.stderr


def queue_behind(days: Path, store: Path, slurm: dict[str, str]) -> str:
    """Queue the prepare of `store` while another job holds the nodes; check that it is one array of a task
    per shard and that no other prepare of its store starts meanwhile, here or queued; its id."""
    queued = prepare_on_slurm(days, store, slurm, "cluster.wait=false")
    assert queued.returncode == 0, queued.stdout + queued.stderr
    job_id = array_id(queued.stdout)
    env = {**os.environ, **slurm}
    tasks = subprocess.run(["squeue", "-h", "-r", "-j", job_id, "-o", "%i"], env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    assert sorted(tasks) == [f"{job_id}_{i}" for i in range(3)]  # one array, a task per shard
    for cluster in ("cluster=local", "cluster=slurm"):
        refused = subprocess.run([sys.executable, "-m", "gpujobs.prepare", *criteo(days, store), cluster],
                                 env=env, capture_output=True, text=True, timeout=120, cwd=store.parent)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"is being prepared by slurm job array {job_id} (PENDING)" in refused.stderr, refused.stderr
    return job_id


def test_while_the_array_may_run_no_other_prepare_of_its_store_starts(
        days: Path, tmp_path: Path, slurm: dict[str, str]) -> None:
    store = tmp_path / "store"
    env = {**os.environ, **slurm}
    # a job holding every node of the partition first: the array stays pending, so the refusals are certain
    blocker = subprocess.run(["sbatch", "--parsable", "--exclusive", "--nodes=2", f"--output={tmp_path}/blocker.out",
                              "--wrap", "sleep 120"], env=env, capture_output=True, text=True, check=True)
    blocker_id = blocker.stdout.strip()
    try:
        while subprocess.run(["squeue", "-h", "-j", blocker_id, "-o", "%T"], env=env, capture_output=True,
                             text=True).stdout.strip() != "RUNNING":
            time.sleep(0.2)
        job_id = queue_behind(days, store, slurm)
    finally:
        subprocess.run(["scancel", blocker_id], env=env, check=True)
    deadline = time.monotonic() + 180
    while subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, "the array never ended once the nodes were free"
        time.sleep(1)
    manifest = read_manifest(store)
    assert [shard.name for shard in manifest.shards] == ["train-00000", "train-00001", "eval-00000"]
