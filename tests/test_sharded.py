"""`parallel=torchrec`: the tables sharded by TorchRec over real gloo CPU ranks, and the memory plan made before
anything is queued (`gpujobs plan`, checked at submit) - issue 37.

Real runs of `python -m gpujobs.submit` on 2 (then 1 and 3) local CPU ranks with FBGEMM's CPU build: trained,
killed and resumed to the same parameters (the digest over the logical tables), resumed at other world sizes
(the tables resharded from the checkpoint, the same samples, nearly the same AUC). TorchRec's planner offers
no row-wise sharding on CPU, so CPU runs use table- and column-wise plans; row-wise plans are made for GPU
topologies by `gpujobs plan` here and trained only where a GPU is (the GPU check).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, read_result, submit
from jobctl import RunningJob, attempts, killed_and_resumed

pytest.importorskip("torchrec", reason="scripts/install-torchrec.sh cpu installs it (scripts/test.sh does)")

#: 40 steps of the rec job with its tables sharded, on 2 local CPU ranks, slowed on rank 0 (~2 s of steps).
MODEL = ("+experiment=rec", "+debug=tiny", "parallel=torchrec", "trainer.max_steps=40", "trainer.log_every=1",
         "trainer.eval_every=20", "checkpoint.every_steps=10", "data.global_batch_size=128",
         "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40")
SHARDED = (*MODEL, "cluster=local")
#: The reference's plan on 4 nodes of 3 16-GiB GPUs, and the key that refuses it on one.
REFERENCE = ("+experiment=dlrm_dcnv2", "resources.gpus_per_node=3", "resources.gpu_mem_gib=16")


def plan(*overrides: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpujobs.plan", *overrides], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_the_reference_fits_four_nodes_of_three_16_gib_gpus(tmp_path: Path) -> None:
    """The 97.4 GiB of DLRM-DCNv2's tables spread over 12 GPUs: the 40M-row tables split by rows, every rank
    under its 16 GiB; the plan kept as JSON by --out."""
    done = plan(*REFERENCE, "resources.nodes=4", "--out", str(tmp_path / "plan.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    kept = json.loads((tmp_path / "plan.json").read_text())
    assert kept["world_size"] == 12 and kept["parallel"] == "torchrec"
    big = [t for t in kept["tables"] if t["rows"] == 40_000_001]
    assert len(big) == 5 and all(t["sharding_type"] in ("row_wise", "table_row_wise", "grid_shard") for t in big)
    assert all(len({s[0] for s in t["shards"]}) > 1 for t in big)  # each split over several ranks
    assert all(0 < rank["gpu"] <= 16 * 2**30 for rank in kept["ranks"])
    assert "t_0" in done.stdout and "rank" in done.stdout  # the printed table: a line a table, a line a rank


def test_the_reference_on_one_node_is_one_line_naming_the_key() -> None:
    done = plan(*REFERENCE, "resources.nodes=1")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "resources.nodes=1" in lines[0] and "GiB" in lines[0], lines
    assert "Traceback" not in done.stderr


def test_a_replicated_model_that_cannot_fit_is_refused_at_submit_with_a_hint(tmp_path: Path) -> None:
    """2 ranks a node each holding every table, its gradient and Adam's two moments: 2,000,000 rows x 8 tables
    x 64 values x 16 bytes = 16.4 GB a rank, 32.8 GB for the node's 2 ranks; sharded, half the tables a rank."""
    run_dir = tmp_path / "run"
    done = submit(run_dir, "+experiment=rec", "cluster=local", "model.embedding_dim=64", "resources.host_mem_gib=24",
                  "data.cardinalities=[2000000,2000000,2000000,2000000,2000000,2000000,2000000,2000000]")
    assert done.returncode == 2, done.stdout + done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert "parallel='ddp'" in line and "24.00 GiB" in line and "parallel=torchrec would fit" in line, line
    assert not run_dir.exists()


@pytest.mark.parametrize("override, key", [
    ("trainer.grad_accum=2", "trainer.grad_accum"),
    ("checkpoint.async=true", "checkpoint.async"),
    ("trainer.balance=dynamic", "trainer.balance"),
    ("optim.table_optimizer=adam", "optim.table_optimizer"),
])
def test_what_torchrec_cannot_train_is_one_line_at_submit(tmp_path: Path, override: str, key: str) -> None:
    done = submit(tmp_path / "run", *SHARDED, override, "cluster.dry_run=true")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"gpujobs: config error: {key}="), done.stderr


def test_a_dry_run_prints_the_plan_beside_the_script(tmp_path: Path) -> None:
    """On stderr: stdout is the #SBATCH script alone, as it would be queued."""
    dry = submit(tmp_path / "dry", *SHARDED, "cluster=slurm", "resources.host_mem_gib=8", "cluster.dry_run=true")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "memory plan: parallel=torchrec, 2 ranks" in dry.stderr and dry.stdout.startswith("#!")
    assert not (tmp_path / "dry").exists()


def test_sharded_tables_train_and_resume_a_kill_exactly(tmp_path: Path) -> None:
    """Straight and killed mid-run (SIGKILL of rank 1 after checkpoint 20, restarted from it): the same
    parameters, dense part and logical tables alike; the plan kept in the run dir and used again."""
    straight = submit(tmp_path / "straight", *SHARDED)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    result = read_result(tmp_path / "straight")
    assert (result["status"], result["world_size"], result["samples"]) == ("completed", 2, 40 * 128)
    assert result["auc"] > 0.6  # it learned (an untrained model is near 0.5)
    kept = json.loads((tmp_path / "straight" / "plan.json").read_text())
    assert kept["parallel"] == "torchrec" and kept["world_size"] == 2
    step = tmp_path / "straight" / "checkpoints" / "step_00000040"
    marker = json.loads((step / "COMPLETE").read_text())
    assert {"sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"} <= set(marker["files"])

    resumed = killed_and_resumed(tmp_path / "killed", *SHARDED, step=20, steps=40)
    assert resumed["param_digest"] == result["param_digest"]
    assert resumed["auc"] == result["auc"]


def _preempted_at(run_dir: Path, ranks: int, after_step: int) -> None:
    """USR2 to rank 0 of a run on `ranks` ranks once it logged `after_step`: the agreed save, then the stop."""
    job = RunningJob(run_dir, *SHARDED, "cluster.max_preemptions=0", f"resources.procs_per_node={ranks}")
    job.wait_for_step(after_step)
    job.signal_rank(0, signal.SIGUSR2)
    job.wait()
    assert attempts(run_dir)[-1]["reason"] == "preempted", job.output()
    assert json.loads((run_dir / "plan.json").read_text())["world_size"] == ranks


def test_sharded_tables_are_preempted_and_resume_at_one_rank_then_three(tmp_path: Path) -> None:
    """Preempted at 2 ranks, then at 1, completed at 3: each start replans for its world size and loads the
    tables and their optimizer's state resharded from the agreed checkpoint; the same samples as straight, the
    AUC within 0.005 of it."""
    straight = submit(tmp_path / "straight", *SHARDED)
    assert straight.returncode == 0, straight.stdout + straight.stderr
    run = tmp_path / "elastic"
    _preempted_at(run, 2, 12)
    _preempted_at(run, 1, attempts(run)[-1]["steps_done"] + 6)
    done = submit(run, *SHARDED, "resources.procs_per_node=3")
    assert done.returncode == 0, done.stdout + done.stderr
    ledger = attempts(run)
    assert [(a["world_size"], a["reason"]) for a in ledger] == [(2, "preempted"), (1, "preempted"), (3, "completed")]
    assert ledger[1]["start_step"] == ledger[0]["steps_done"] and ledger[2]["start_step"] == ledger[1]["steps_done"]
    elastic, whole = read_result(run), read_result(tmp_path / "straight")
    assert elastic["samples"] == whole["samples"] == 40 * 128
    assert abs(elastic["auc"] - whole["auc"]) < 0.005, (elastic["auc"], whole["auc"])


# --- the tables' lookups on 3 real gloo ranks -----------------------------------------------------------------
def _lookup_worker(rank: int, port: int, out: str) -> None:
    """Shard 4 small tables over 3 ranks; look up rows of a batch split 2, 2, 1 (uneven, as a balanced plan
    splits); compare with the same rows of the whole tables, gathered; write the largest difference."""
    import os
    import warnings

    import torch
    import torch.distributed as dist

    from gpujobs.config.memory import PlanRequest
    from gpujobs.config.model_shape import ModelShape, Table
    from gpujobs.rank.parallel.sharded import ShardedModel, TableBags, agreed_plan

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    torch.manual_seed(0)
    shape = ModelShape(tuple(Table(f"t_{i}", f"f_{i}", 20 + i, 4) for i in range(4)), 0)

    class Tables(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = TableBags(shape, torch.device("meta"))

        def forward(self, sparse: torch.Tensor) -> torch.Tensor:
            result: torch.Tensor = self.emb(sparse)
            return result

    request = PlanRequest(shape, 1, 3, "cpu", None, 8 * 2**30, "torchrec", "adam", "rowwise_adagrad", 2)
    memory, _ = agreed_plan(request, None, rank)
    model = ShardedModel(Tables(), memory, torch.device("cpu"), "rowwise_adagrad", 0.1)
    rows = {table.name: table.rows for table in shape.tables}
    whole = {}
    for name, table in model.whole_tables():  # gathered to rank 0, then sent to all
        full = table if rank == 0 else torch.empty(rows[name], 4)
        dist.broadcast(full, 0)
        whole[name] = full
    sparse = torch.randint(0, 20, (5, 4), generator=torch.Generator().manual_seed(1))
    first, count = [0, 2, 4][rank], [2, 2, 1][rank]
    mine = sparse[first:first + count]
    looked_up = model.wrapped(mine)
    expected = torch.stack([whole[f"t_{i}"][mine[:, i]] for i in range(4)], dim=1)
    Path(out, f"rank_{rank}").write_text(f"{float((looked_up - expected).abs().max())}")
    dist.destroy_process_group()


def test_sharded_lookups_are_the_whole_tables_rows_even_for_uneven_batches(tmp_path: Path) -> None:
    """Each rank's vectors are the rows of its own batch, feature by feature, whatever order the sharding groups
    the features in (it is not the tables' order) and with the ranks' batches of 2, 2 and 1 rows."""
    import torch.multiprocessing as mp

    from gpujobs.attempt.local import free_port

    mp.spawn(_lookup_worker, args=(free_port(), str(tmp_path)), nprocs=3)
    assert [float((tmp_path / f"rank_{r}").read_text()) for r in range(3)] == [0.0, 0.0, 0.0]


# --- on the live Slurm cluster --------------------------------------------------------------------------------
@pytest.mark.slurm
def test_on_slurm_usr2_requeues_and_resumes_the_sharded_run_exactly(
    tmp_path: Path, slurm: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """2 nodes, a rank each, the tables sharded across them: USR2 to the job, the agreed save of every rank's
    shards, the requeue, the resume from them; the same digest as the same training as 2 local ranks."""
    import os

    from conftest import slurm_job_id, uninterrupted_digest

    # whole tables only: a column-wise shard's row-wise Adagrad sees its columns alone, so both plans must agree
    model = (*MODEL, "trainer.max_steps=120", "checkpoint.every_steps=40", "resources.host_mem_gib=4",
             "parallel.sharding_types=[table_wise]")
    reference = uninterrupted_digest(tmp_path_factory, "sharded-reference", *model, "cluster=local")
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *model, "cluster=slurm", "resources.nodes=2", "resources.procs_per_node=1",
                     "cluster.wait=true", env=slurm)
    job.wait_for_step(30)
    subprocess.run(["scancel", "--signal=USR2", slurm_job_id(job.output())], check=True, env={**os.environ, **slurm})
    assert job.wait(timeout=300) == 0, job.output()
    story = attempts(run_dir)
    assert [a["reason"] for a in story] == ["preempted", "completed"], story
    assert story[1]["start_step"] == story[0]["steps_done"] and story[1]["resumed_from"] == story[0]["saved"]
    assert read_result(run_dir)["param_digest"] == reference
