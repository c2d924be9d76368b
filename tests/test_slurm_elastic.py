"""Elastic jobs on the live Slurm cluster (`resources.min_nodes`, `--nodes=MIN-MAX`): a task's place comes
from the allocation, preflight asks only MIN nodes to exist, a requeued job gets its node range back, and
a job preempted on 2 nodes while another job takes one of them resumes on the other and completes."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, compose_job, read_result, sacct_state, slurm_job_id, submit
from jobctl import RunningJob, attempts
from test_manage import rows
from test_sweep import gpujobs

from gpujobs.attempt.preemption import reopen_node_range
from gpujobs.backends.slurm.sbatch import sbatch_request

pytestmark = pytest.mark.slurm

TINY = ("+experiment=rec", "+debug=tiny", "cluster=slurm")
#: 2 nodes at most, 1 at least, one CPU rank per node; slowed so there is time to preempt it mid-run.
ELASTIC = (
    "+experiment=rec", "+debug=tiny", "cluster=slurm", "trainer.max_steps=200", "checkpoint.every_steps=50",
    "resources.nodes=2", "resources.min_nodes=1", "resources.procs_per_node=1", "cluster.wait=true",
    "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40",
)


def _slurm(*args: str, env: dict[str, str], check: bool = True) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, env={**os.environ, **env}, timeout=60,
                          check=False)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def _job_field(job_id: str, name: str, env: dict[str, str]) -> str:
    """One `Name=value` of `scontrol show job` (e.g. NumNodes, NumTasks, JobState)."""
    for item in _slurm("scontrol", "show", "job", "--oneliner", job_id, env=env).split():
        key, _, value = item.partition("=")
        if key == name:
            return value
    raise AssertionError(f"scontrol shows no {name} for job {job_id}")


def _wait_state(job_id: str, state: str, env: dict[str, str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _job_field(job_id, "JobState", env) != state:
        assert time.monotonic() < deadline, f"job {job_id} not {state} within {timeout} s"
        time.sleep(0.3)


def test_a_task_takes_its_place_from_the_allocation(tmp_path: Path, slurm: dict[str, str]) -> None:
    """`--nodes=1-2 --ntasks-per-node=2` where one node may be used: each task of the step sees a world of
    2 on 1 node, whatever RANK/WORLD_SIZE the submitting shell exported (sbatch passes them on)."""
    out = tmp_path / "probe.out"
    probe = ("import dataclasses, json; from gpujobs.backends.jobenv import detect; "
             "print(json.dumps(dataclasses.asdict(detect())))")
    script = tmp_path / "probe.sbatch"
    script.write_text(
        "#!/bin/bash\n#SBATCH --nodes=1-2\n#SBATCH --ntasks-per-node=2\n#SBATCH --exclude=node1\n"
        f"#SBATCH --output={out}\nexport SUBMITIT_EXECUTOR=slurm\n"
        f"srun {sys.executable} -c '{probe}'\n"
    )
    stray = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "PYTHONPATH": str(REPO)}
    _slurm("sbatch", "--wait", str(script), env={**slurm, **stray})
    seen = sorted((json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")),
                  key=lambda info: info["rank"])
    assert [(s["rank"], s["local_rank"], s["world_size"], s["local_world_size"]) for s in seen] == [
        (0, 0, 2, 2), (1, 1, 2, 2)], out.read_text()
    assert {s["node"] for s in seen} == {"node2"} and {s["master_addr"] for s in seen} == {"node2"}


@pytest.mark.parametrize(
    ("overrides", "code", "says"),
    [
        # only MIN nodes must exist: MAX beyond the partition is what Slurm starts on 2 of (seen)
        (("resources.nodes=3", "resources.min_nodes=2"), 0, "#SBATCH --nodes=2-3\n"),
        (("resources.nodes=4", "resources.min_nodes=3"), 2,
         "resources.min_nodes=3 is invalid: allowed at most 2 in partition debug"),
        # a partition's MaxNodes holds for the whole range (Slurm would keep it pending forever)
        (("cluster.partition=short", "resources.nodes=2", "resources.min_nodes=1"), 2,
         "resources.nodes=2 is invalid: allowed at most 1 in partition short"),
        (("resources.nodes=2", "resources.min_nodes=3"), 2, "min_nodes=3 is invalid: allowed 1..2"),
    ],
)
def test_preflight_counts_min_nodes_as_what_must_be_there(
    run_dir: Path, slurm: dict[str, str], overrides: tuple[str, ...], code: int, says: str
) -> None:
    proc = submit(run_dir, *TINY, "resources.procs_per_node=1", "cluster.dry_run=true", *overrides, env=slurm)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert says in (proc.stdout if code == 0 else proc.stderr), proc.stdout + proc.stderr
    if code == 0:
        assert "# Elastic: " in proc.stdout and "--ntasks=" not in proc.stdout
    assert not run_dir.exists()


@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_a_requeued_job_comes_back_on_the_one_node_left(
    tmp_path: Path, slurm: dict[str, str], monkeypatch: pytest.MonkeyPatch, ranks_per_node: int
) -> None:
    """A job with the allocation flags gpujobs renders starts on both nodes, is requeued while another job
    waits for node1, and starts again on node2 alone. Slurm 22.05 pins a requeued job to the counts it
    just had (seen: it pends, reason Resources, with one node free); `reopen_node_range` gives it its
    range back, which Slurm refuses while the job runs (and says so)."""
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    job = compose_job(*TINY, "resources.nodes=2", "resources.min_nodes=1", f"resources.procs_per_node={ranks_per_node}")
    wanted = ("nodes", "ntasks-per-node", "cpus-per-task")
    flags = [f"--{key}={value}" for key, value in sbatch_request(job, tmp_path, "true").flags if key in wanted]
    out = tmp_path / "job.out"
    # the batch step says the world size it sees, as the supervisor reads it (one rank per node: Slurm
    # sets no SLURM_NTASKS there), then every task its node
    world = (f"{shlex.quote(sys.executable)} -c "
             "'from gpujobs.backends.jobenv import allocated_world_size as w; print(w())'")
    wrap = f'echo "start $SLURM_JOB_NUM_NODES $({world})"; srun printenv SLURMD_NODENAME; sleep 120'
    job_id = _slurm("sbatch", "--parsable", *flags, "--requeue", "--open-mode=append", f"--output={out}", "--wrap",
                    wrap, env=slurm)
    blocker = ""
    try:
        world, first = _starts(out, 1, ranks_per_node)[0]
        assert first == sorted(["node1", "node2"] * ranks_per_node), f"not on both nodes (a busy cluster?): {first}"
        assert world == 2 * ranks_per_node, out.read_text()
        refused = reopen_node_range(job_id, job.resources)
        assert refused is not None and "no longer pending" in refused and "waits for 2 nodes" in refused, refused
        blocker = _slurm("sbatch", "--parsable", "-w", "node1", "--exclusive", "--output=/dev/null", "--wrap",
                         "sleep 120", env=slurm)
        _slurm("scontrol", "requeue", job_id, env=slurm)
        assert reopen_node_range(job_id, job.resources) is None
        assert _starts(out, 2, ranks_per_node)[1] == (ranks_per_node, ["node2"] * ranks_per_node), out.read_text()
    finally:
        _slurm("scancel", job_id, *([blocker] if blocker else []), env=slurm, check=False)
    assert reopen_node_range(job_id, compose_job(*TINY).resources) is None  # a fixed allocation: nothing asked


def _starts(out: Path, count: int, per_node: int, timeout: float = 90) -> list[tuple[int, list[str]]]:
    """(world size the batch step saw, nodes of its tasks, sorted) of each start of the job writing `out`,
    once it has started `count` times and every task (`per_node` on each node) has printed its node."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        starts: list[tuple[int, int, list[str]]] = []
        for line in (out.read_text() if out.exists() else "").splitlines():
            if line.startswith("start "):
                _, nodes, world = line.split()
                starts.append((int(nodes), int(world), []))
            elif starts and line.startswith("node"):
                starts[-1][2].append(line.strip())
        if len(starts) >= count and all(len(tasks) >= nodes * per_node for nodes, _, tasks in starts):
            return [(world, sorted(tasks)) for _, world, tasks in starts]
        time.sleep(0.3)
    raise AssertionError(f"no start {count} within {timeout} s: {out.read_text() if out.exists() else ''}")


def _rank_logs(run_dir: Path, lines: int = 15) -> str:
    """The last lines of every rank's stderr log (submitit folder), and the attempts so far."""
    parts = [f"attempts: {(run_dir / 'attempts.jsonl').read_text() if (run_dir / 'attempts.jsonl').exists() else '-'}"]
    for log in sorted((run_dir / "submitit").glob("*_log.err")):
        parts.append(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-lines:]))
    return "\n".join(parts)


def _train_world(run_dir: Path) -> int:
    """Ranks of the newest train line of metrics.jsonl (its per-rank step times)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
    return len([line for line in lines if line.get("kind") == "train" and line.get("step_time_s")][-1]["step_time_s"])


@pytest.mark.timeout(600)  # two attempts and the preemption's grace, under a loaded CI
def test_preempted_on_two_nodes_resumes_on_the_one_left_and_completes(tmp_path: Path, slurm: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    job = RunningJob(run_dir, *ELASTIC, env=slurm)
    urgent = ""
    try:
        job.wait_for_step(30)
        assert _train_world(run_dir) == 2, "the job did not start on both nodes (the cluster is busy?)"
        job_id = slurm_job_id(job.output())
        # a higher-priority job takes node1: it preempts ours, which may come back only on node2
        urgent = _slurm("sbatch", "--parsable", "-p", "urgent", "-w", "node1", "-N1", "--exclusive",
                        f"--output={tmp_path}/urgent.out", "--wrap", "sleep 300", env=slurm)
        assert job.wait(timeout=300) == 0, job.output()
    except AssertionError as err:  # what the ranks said is where a failure shows
        raise AssertionError(f"{err}\n{_rank_logs(run_dir)}") from None
    finally:
        if urgent:
            _slurm("scancel", urgent, env=slurm, check=False)
    story: list[dict[str, Any]] = attempts(run_dir)
    assert [(a["reason"], a["world_size"], a["job_id"]) for a in story] == [
        ("preempted", 2, job_id), ("completed", 1, job_id)], story
    assert story[0]["requeue"] is True and "node range" not in story[0]["why"], story  # the range was reopened
    for before, after in itertools.pairwise(story):
        assert after["start_step"] == before["steps_done"] and after["resumed_from"] == before["saved"], story
    result = read_result(run_dir)
    assert (result["status"], result["steps"], result["world_size"]) == ("completed", 200, 1), result
    assert [rank["node"] for rank in result["ranks"]] == ["node2"], result
    assert sacct_state(job_id, slurm) == "COMPLETED"
    status = gpujobs("status", str(run_dir), env=slurm)
    assert status.returncode == 0 and "2 (completed) world 2→1" in rows(status.stdout)["-"], status.stdout
