"""Real multi-process DDP: 2 gloo ranks through submitit's local executor, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import read_metrics, read_result, submit

from gpujobs.backends import jobenv

TINY = ("+experiment=rec", "+debug=tiny", "cluster=local")


def test_two_rank_gloo_run_fills_the_run_dir(run_dir: Path) -> None:
    proc = submit(run_dir, *TINY, "nccl=debug", "+nccl.extra.NCCL_IB_DISABLE=true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_result(run_dir)
    assert result["status"] == "completed"
    assert result["world_size"] == 2
    assert result["steps"] == 12
    assert 0.5 < result["oracle_auc"] < 1.0
    assert 0.0 <= result["auc"] <= 1.0 and result["logloss"] > 0
    assert result["samples_per_s"] > 0 and result["wall_s"] > 0
    assert len(result["param_digest"]) == 64
    assert (run_dir / "config.yaml").is_file()
    train = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6, 9, 12]
    assert all(len(r["step_time_s"]) == 2 and min(r["step_time_s"]) > 0 for r in train)
    assert [r["step"] for r in read_metrics(run_dir) if r["kind"] == "eval"] == [6, 12]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000008", "step_00000012"]
    # the NCCL preset reached every rank's environment before the process group started, and a boolean
    # NCCL variable as NCCL reads it (`true` would be read as 0)
    logs = sorted((run_dir / "submitit").glob("*_log.err"))
    assert len(logs) == 2
    for log in logs:
        assert "'NCCL_DEBUG': 'INFO'" in log.read_text() and "'NCCL_IB_DISABLE': '1'" in log.read_text()
    assert "step 12" in proc.stdout  # rank 0's progress streamed by the launcher


def test_same_seed_same_digest_other_seed_other_digest(tmp_path: Path) -> None:
    digests = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        proc = submit(tmp_path / name, *TINY, f"trainer.seed={seed}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        digests.append(read_result(tmp_path / name)["param_digest"])
    assert digests[0] == digests[1]
    assert digests[0] != digests[2]


def test_restart_resumes_from_checkpoint_to_the_same_parameters(tmp_path: Path) -> None:
    constant = ("optim.schedule=constant", "optim.warmup_steps=0")
    straight = submit(tmp_path / "straight", *TINY, *constant)
    assert straight.returncode == 0, straight.stderr
    first = submit(tmp_path / "split", *TINY, *constant, "trainer.max_steps=8")
    assert first.returncode == 0, first.stderr
    second = submit(tmp_path / "split", *TINY, *constant)
    assert second.returncode == 0, second.stderr
    resumed = read_result(tmp_path / "split")
    assert resumed["resumed_from"].endswith("step_00000008")
    assert resumed["param_digest"] == read_result(tmp_path / "straight")["param_digest"]


def test_debug_cluster_runs_one_rank_in_process(run_dir: Path) -> None:
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=debug")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "runs 1 rank in-process" in proc.stdout
    result = read_result(run_dir)
    assert result["world_size"] == 1 and result["steps"] == 12
    assert not (run_dir / "submitit").exists()


def test_torchrun_variables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="10.1.2.3", MASTER_PORT="23456").items():
        monkeypatch.setenv(key, value)
    info = jobenv.detect()
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (3, 1, 4, 2)
    assert (info.master_addr, info.master_port) == ("10.1.2.3", 23456)
    assert not info.is_main


def test_single_process_without_any_job_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "SUBMITIT_LOCAL_JOB_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    info = jobenv.detect(master_port=31000)
    assert (info.rank, info.world_size, info.master_port) == (0, 1, 31000)


def test_slurm_ports_differ_between_jobs() -> None:
    ports = {jobenv.port_for_job(str(job_id)) for job_id in range(1000, 1100)}
    assert len(ports) == 100
    assert all(20000 <= port < 50000 for port in ports)
