"""Training from a prepared sample store (issue 27): refused at submit when the store is not fit, and exact
across kills and world sizes when it is.

The store is prepared once per module from gzip day files by the real `prepare_store` and the rec job's
`CriteoParser`; every run is the real `python -m gpujobs.submit` on local ranks (gloo).
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
from conftest import read_result, submit
from jobctl import RunningJob, attempts
from rec_store import prepare, write_days

HASH_BUCKETS = 1000


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of three training days (1500 rows each: 4500, an epoch of 35 steps of 128) and one eval day."""
    folder = tmp_path_factory.mktemp("criteo")
    train = write_days(folder / "logs", "day", days=3, rows=1500)
    eval = write_days(folder / "logs", "eval", days=1, rows=1000, seed=1)
    prepare(folder / "store", train, eval, HASH_BUCKETS)
    return folder / "store"


def run_of(store: Path, *more: str) -> tuple[str, ...]:
    """A 60-step run (~3 s of slowed steps, past one epoch) on local CPU ranks from `store`."""
    return (
        "+experiment=rec", "cluster=local", "data=criteo", f"data.store={store}", f"data.hash_buckets={HASH_BUCKETS}",
        "data.global_batch_size=128", "resources.gpus_per_node=0", "trainer.max_steps=60", "trainer.log_every=1",
        "trainer.eval_every=0", "checkpoint.every_steps=10", "trainer.hang_timeout_s=20",
        "trainer.hang_slow_phase_s=120", "trainer.pg_timeout_s=150", "telemetry.debug_slow_rank=0",
        "telemetry.debug_slow_ms=40", *more,
    )


# --- refused at submit -----------------------------------------------------------------------------


def _refused(tmp_path: Path, store: Path, *more: str) -> str:
    """The one line that submit exits 2 with (its prefix off); no run dir is made."""
    proc = submit(tmp_path / "run", *run_of(store, *more), timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpujobs: config error: "), proc.stderr
    assert not (tmp_path / "run").exists()
    return lines[0].removeprefix("gpujobs: config error: ")


def test_a_missing_store_is_refused_at_submit(tmp_path: Path) -> None:
    line = _refused(tmp_path, tmp_path / "nowhere")
    assert line == f"data.store='{tmp_path / 'nowhere'}': no such directory: run gpujobs prepare with the same config"


def test_an_unfinished_store_is_refused_at_submit(tmp_path: Path, store: Path) -> None:
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    (copy / "manifest.json").unlink()  # as a prepare killed before its last write leaves it
    line = _refused(tmp_path, copy)
    assert line == f"data.store='{copy}': not prepared, or its prepare did not finish: run gpujobs prepare with the " \
                   "same config"


def test_a_store_of_other_hash_buckets_is_refused_at_submit(tmp_path: Path, store: Path) -> None:
    line = _refused(tmp_path, store, "data.hash_buckets=10")
    assert line.startswith(f"data.store='{store}': prepared with hash_buckets=1000, this job has hash_buckets=10: ")


def test_a_store_whose_shard_changed_after_prepare_is_refused_at_submit(tmp_path: Path, store: Path) -> None:
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    with open(copy / "shards" / "train-00001" / "sparse.bin", "ab") as file:
        file.write(b"\0")
    line = _refused(tmp_path, copy)
    assert line == f"data.store='{copy}': shard train-00001's sparse.bin changed after prepare: prepare it again"


def test_the_global_batch_is_checked_against_the_stores_rows_at_submit(tmp_path: Path, store: Path) -> None:
    line = _refused(tmp_path, store, "data.global_batch_size=4502")
    assert line.startswith("data.global_batch_size=4502 is invalid: ")
    assert line.endswith("to 4500 (the 4500 training rows of data.store per micro-batch)")


# --- exact across kills and world sizes -------------------------------------------------------------


@pytest.fixture(scope="module")
def straight(store: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """result.json of an uninterrupted 2-rank run: what every interrupted run must match."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    proc = submit(run_dir, *run_of(store))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_result(run_dir)
    assert result["samples"] == 60 * 128 and result["world_size"] == 2
    assert float(result["auc"]) > 0.6  # type: ignore[arg-type]  # it learned: the AUC comparisons mean something
    return result


def test_two_sigkills_then_resume_end_bit_identical(tmp_path: Path, store: Path, straight: dict[str, object]) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *run_of(store, "cluster.max_restarts=2"))
    job.wait_for_step(21)  # logged after checkpoint 20 is complete
    job.signal_rank(1, signal.SIGKILL)
    job.wait_for_step(41)  # the second attempt, resumed at 20, is past checkpoint 40 (and into epoch 1)
    job.signal_rank(1, signal.SIGKILL)
    assert job.wait() == 0, job.output()
    ledger = attempts(run_dir)
    assert [a["reason"] for a in ledger] == ["failed", "failed", "completed"], ledger
    assert ledger[1]["resumed_from"] == ledger[0]["saved"] and ledger[2]["resumed_from"] == ledger[1]["saved"]
    assert 20 <= ledger[1]["start_step"] < ledger[2]["start_step"] < 60, ledger
    result = read_result(run_dir)
    assert result["samples"] == straight["samples"]
    assert result["param_digest"] == straight["param_digest"]
    assert result["auc"] == straight["auc"]


def test_killed_at_2_ranks_and_resumed_at_1_reads_the_same_samples(
    tmp_path: Path, store: Path, straight: dict[str, object]
) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *run_of(store))
    job.wait_for_step(31)
    job.signal_rank(1, signal.SIGKILL)
    assert job.wait() != 0
    proc = submit(run_dir, *run_of(store, "resources.procs_per_node=1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ledger = attempts(run_dir)
    assert [a["world_size"] for a in ledger] == [2, 1] and ledger[1]["resumed_from"] == ledger[0]["saved"], ledger
    assert 30 <= ledger[1]["start_step"] < 60, ledger
    result = read_result(run_dir)
    assert result["samples"] == straight["samples"]
    assert abs(float(result["auc"]) - float(straight["auc"])) <= 0.005  # type: ignore[arg-type]
