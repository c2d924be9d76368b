"""Against the live Slurm cluster of scripts/local-slurm.sh: two nodes, two fake GPUs each.

CI brings the cluster up (scripts/test.sh) and fails these tests if it is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, read_result, sacct_state, slurm_job_id, submit
from jobctl import attempts

pytestmark = pytest.mark.slurm

TINY = ("+experiment=rec", "+debug=tiny", "cluster=slurm")
TWO_NODES = ("resources.nodes=2", "resources.procs_per_node=1")
SCRIPT = Path(__file__).parent / "scripts" / "torchrun_style.py"


def test_two_node_ddp_run_matches_the_local_run(tmp_path: Path, slurm: dict[str, str]) -> None:
    on_slurm = submit(tmp_path / "slurm", *TINY, *TWO_NODES, "cluster.wait=true", env=slurm)
    assert on_slurm.returncode == 0, on_slurm.stdout + on_slurm.stderr
    result = read_result(tmp_path / "slurm")
    assert result["status"] == "completed" and result["world_size"] == 2
    assert sorted(r["node"] for r in result["ranks"]) == ["node1", "node2"]
    assert sacct_state(slurm_job_id(on_slurm.stdout), slurm) == "COMPLETED"
    local = submit(tmp_path / "local", "+experiment=rec", "+debug=tiny", "cluster=local")
    assert local.returncode == 0, local.stderr
    assert read_result(tmp_path / "local")["param_digest"] == result["param_digest"]


def test_ranks_see_the_gpus_slurm_gave_them(run_dir: Path, slurm: dict[str, str]) -> None:
    proc = submit(run_dir, *TINY, "resources.gpus_per_node=2", "cluster.wait=true", env=slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_result(run_dir)
    assert result["world_size"] == 2  # one task per GPU
    assert [r["cuda_visible_devices"] for r in result["ranks"]] == ["0,1", "0,1"]
    script = (run_dir / "submit.sbatch").read_text()
    assert "#SBATCH --gpus-per-node=2" in script and "#SBATCH --ntasks-per-node=2" in script


def test_submit_returns_once_queued_and_keeps_the_exact_script(tmp_path: Path, slurm: dict[str, str]) -> None:
    """In-process, so the test can also check that the submit side never imported torch."""
    run_dir = tmp_path / "run"
    code = f"""
import sys
sys.argv = ["gpujobs.submit", "hydra.run.dir={run_dir}", "+experiment=rec", "+debug=tiny", "cluster=slurm",
            "trainer.max_steps=60"]
from gpujobs.submit import main
try:
    main()
except SystemExit as exit_:
    assert exit_.code in (0, None), exit_.code
assert "torch" not in sys.modules
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, **slurm})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = slurm_job_id(proc.stdout)
    assert not (run_dir / "result.json").exists()  # returned before the job finished
    queued = (run_dir / "submitit" / f"{job_id}_submission.sh").read_text()
    assert (run_dir / "submit.sbatch").read_text() == queued
    assert "#SBATCH --signal=USR2@120" in queued and "#SBATCH --requeue" in queued
    assert sacct_state(job_id, slurm) == "COMPLETED"
    assert read_result(run_dir)["steps"] == 60


def test_torchrun_style_script_on_two_nodes(run_dir: Path, slurm: dict[str, str]) -> None:
    proc = submit(run_dir, "cluster=slurm", *TWO_NODES, f"+script.path={SCRIPT}", "cluster.wait=true", env=slurm)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seen = [json.loads((run_dir / f"seen_rank{r}.json").read_text()) for r in (0, 1)]
    assert sorted(s["node"] for s in seen) == ["node1", "node2"]
    assert all(s["rank_sum"] == 1.0 and s["MASTER_ADDR"] == "node1" for s in seen)
    assert seen[0]["MASTER_PORT"] == seen[1]["MASTER_PORT"]
    (line,) = attempts(run_dir)  # only the step's end shows that every rank's script exited 0
    assert line["reason"] == "completed" and line["recorded_by"] == "supervisor" and line["world_size"] == 2, line
    assert read_result(run_dir)["world_size"] == 2


def test_a_script_rank_that_fails_after_rank_0_is_done_fails_the_slurm_attempt(
    run_dir: Path, slurm: dict[str, str]
) -> None:
    """Rank 1's script, on node2, exits 3 after rank 0's exited 0: the supervisor records the attempt as
    failed, naming rank 1 and node2 from the error the rank left, and excludes no node (a bug, not a crash)."""
    proc = submit(run_dir, "cluster=slurm", *TWO_NODES, f"+script.path={SCRIPT}", "+script.args=[--fail-late,1]",
                  "cluster.wait=true", "cluster.max_restarts=0", env=slurm)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (line,) = attempts(run_dir)
    assert line["reason"] == "failed" and line["recorded_by"] == "supervisor", line
    assert line["culprit_rank"] == 1 and line["node"] == "node2" and "excluded" not in line, line
    assert line["error"] == f"rank 1: {SCRIPT} exited with code 3", line
    assert not (run_dir / "result.json").exists()
    assert f"last error: rank 1: {SCRIPT} exited with code 3" in proc.stdout, proc.stdout


def test_a_job_that_sbatch_refuses_leaves_no_run_dir_and_no_lease(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "run"  # no node has the feature: preflight passes it, sbatch refuses it
    proc = submit(run_dir, *TINY, "cluster.constraint=nosuchfeature", env=slurm)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpujobs: sbatch refused the job: "), proc.stderr
    assert not run_dir.exists(), sorted(str(p) for p in run_dir.rglob("*"))  # no config, lease, submitit/


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("cluster.partition=nope",), "cluster.partition='nope' is invalid: allowed one of debug, short, urgent"),
        (("resources.nodes=3",), "resources.nodes=3 is invalid: allowed at most 2 in partition debug"),
        (("cluster.partition=short", *TWO_NODES), "resources.nodes=2 is invalid: allowed at most 1 in partition short"),
        (("cluster.partition=short", "cluster.time=00:20:00"), "at most 10 minutes in partition short"),
        (("resources.gpus_per_node=3",), "resources.gpus_per_node=3 is invalid: allowed at most 2"),
        (("resources.procs_per_node=2", "resources.cpus_per_task=3"), "resources.cpus_per_task=3 is invalid"),
        (("cluster.account=nobody",), "cluster.account='nobody' is invalid"),
        (("cluster.qos=nope",), "cluster.qos='nope' is invalid"),
    ],
)
def test_preflight_refuses_before_queueing(
    run_dir: Path, slurm: dict[str, str], overrides: tuple[str, ...], message: str
) -> None:
    proc = submit(run_dir, *TINY, *overrides, env=slurm)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "submitted" not in proc.stdout
    assert not run_dir.exists()
