"""`+experiment=dlrm_dcnv2` (MLPerf's DLRM-DCNv2) and its tiny twin (issue 37).

The reference is checked as composed, torch-free: its sizes and its shape (97.4 GiB of tables). The twin runs
as users run it: `gpujobs prepare` of its per-table buckets into a store from gzip day files, then 2 gloo
ranks of the real `python -m gpujobs.submit`, straight and killed mid-run; both end on the same parameters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_job, read_result, submit
from jobctl import killed_and_resumed
from rec_store import write_days

from gpujobs.config.model_shape import FP32_BYTES
from jobs.rec.config import CriteoConfig, DCNv2Config

#: --num_embeddings_per_feature of MLPerf's DLRM-DCNv2 (TorchRec's dlrm example), Criteo's C1..C26.
MLPERF_TABLES = [40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209, 11938,
                 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36]


def test_the_reference_has_mlperfs_sizes_and_needs_more_than_a_gpu() -> None:
    job = compose_job("+experiment=dlrm_dcnv2", "data.store=/data/criteo-1tb")
    model, data = job.model, job.data
    assert isinstance(model, DCNv2Config) and isinstance(data, CriteoConfig)
    assert (model.embedding_dim, model.bottom_mlp, model.top_mlp) == (128, [512, 256], [1024, 1024, 512, 256])
    assert (model.cross_layers, model.low_rank) == (3, 512)
    assert data.hash_buckets == MLPERF_TABLES
    shape = model.shape(data.features())
    assert [table.rows for table in shape.tables] == [rows + 1 for rows in MLPERF_TABLES]  # row 0: "missing"
    assert round(shape.table_parameters * FP32_BYTES / 2**30, 1) == 97.4
    # bottom 13-512-256-128, 3 cross layers over 27 x 128 = 3456 values of rank 512, top 3456-1024-1024-512-256-1
    bottom = 13 * 512 + 512 + 512 * 256 + 256 + 256 * 128 + 128
    top = 3456 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 512 + 512 + 512 * 256 + 256 + 256 + 1
    assert shape.dense_parameters == bottom + 3 * (2 * 3456 * 512 + 3456) + top == 16_044_545


def test_neither_experiment_changes_the_rec_experiment() -> None:
    rec = compose_job("+experiment=rec")
    assert type(rec.model).__name__ == "DLRMConfig" and type(rec.data).__name__ == "SyntheticClicksConfig"
    assert rec.name == "rec"


# --- the tiny twin, on 2 CPU ranks ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The twin's store, prepared by the real `gpujobs prepare` from 3 gzip days of 1500 rows and an eval day."""
    folder = tmp_path_factory.mktemp("tiny")
    write_days(folder / "logs", "day", days=3, rows=1500)
    write_days(folder / "logs", "eval", days=1, rows=1000, seed=1)
    proc = subprocess.run(
        [sys.executable, "-m", "gpujobs.prepare", "+experiment=dlrm_dcnv2_tiny", "cluster=local",
         f"data.train_files={folder}/logs/day_*.gz", f"data.eval_files={folder}/logs/eval_0.gz",
         f"data.store={folder}/store"],
        cwd=folder, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    settings = json.loads((folder / "store" / "manifest.json").read_text())["settings"]
    assert settings["hash_buckets"] == [min(rows, 2000) for rows in MLPERF_TABLES]  # the list, as the twin has it
    return folder / "store"


def tiny(store: Path, *more: str) -> tuple[str, ...]:
    """40 steps of the twin (~2 s of steps slowed on rank 0) on 2 local CPU ranks from `store`."""
    return ("+experiment=dlrm_dcnv2_tiny", "cluster=local", f"data.store={store}", "resources.gpus_per_node=0",
            "trainer.max_steps=40", "trainer.log_every=1", "trainer.eval_every=0", "checkpoint.every_steps=10",
            "trainer.hang_timeout_s=20", "trainer.hang_slow_phase_s=120", "trainer.pg_timeout_s=150",
            "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40", *more)


def test_the_twin_trains_on_two_ranks_and_resumes_a_kill_exactly(tmp_path: Path, store: Path) -> None:
    straight = submit(tmp_path / "straight", *tiny(store))
    assert straight.returncode == 0, straight.stdout + straight.stderr
    result = read_result(tmp_path / "straight")
    assert (result["status"], result["world_size"], result["samples"]) == ("completed", 2, 40 * 256)
    assert result["auc"] > 0.7  # it learned the files' rule (0.77 here; an untrained model is near 0.5)

    resumed = killed_and_resumed(tmp_path / "killed", *tiny(store), step=20, steps=40)
    assert resumed["param_digest"] == result["param_digest"]
    assert resumed["auc"] == result["auc"]
