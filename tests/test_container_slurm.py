"""Ranks in a container on the live Slurm cluster: Charliecloud's `ch-run` under `srun` (issue 28).

The job's ranks run in the test image (`image_dir`), its supervisor outside in the batch step. USR2 reaches
the ranks through the runtime (ch-run execs: the rank is the process Slurm signals), they agree on a
checkpoint, rank 0 requeues the job, and the next attempt's ranks start in a fresh container, resume and end
bit-identical to an uninterrupted run outside any container. Both attempts' lines name the image, and
`gpujobs status` shows it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_result, sacct_state, slurm_job_id, uninterrupted_digest
from jobctl import RunningJob, attempts, slurm_rank_pids

from gpujobs.backends.slurm.relay import RELAY_ENV, Relay

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
MODEL = ("+experiment=rec", "+debug=tiny", "trainer.max_steps=200", "checkpoint.every_steps=50",
         "telemetry.debug_slow_rank=0", "telemetry.debug_slow_ms=40")


@pytest.fixture(scope="module")
def outside_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """MODEL uninterrupted as 2 local ranks, no container (same world size, same numerics)."""
    return uninterrupted_digest(tmp_path_factory, "outside", *MODEL, "cluster=local")


def in_image(image_dir: Path) -> tuple[str, ...]:
    """The overrides that run the ranks in `image_dir` with ch-run, this checkout mounted at its own path
    (the ranks import it through PYTHONPATH, not the copy the image was built with)."""
    return ("container=charliecloud", f"container.image={image_dir}", f"container.mounts=[{REPO}:{REPO}]")


def runs_the_image_python(pid: int, image_dir: Path) -> bool:
    """Whether process `pid` runs the image's python3 with the image's torch: the submitter's PATH reaches the
    step, and a venv's `python3` found first (its bin mounted in) would run the venv's packages instead."""
    exe = os.stat(f"/proc/{pid}/exe")
    image_python = os.stat(image_dir / "usr/bin/python3")  # Debian's is a relative link to python3.X
    # the files it maps, by their paths inside the container
    torch_libs = {line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                  if "/torch/lib/libtorch" in line}
    return (exe.st_dev, exe.st_ino) == (image_python.st_dev, image_python.st_ino) and bool(torch_libs) and all(
        lib.startswith("/usr/local/lib/python3") for lib in torch_libs)


def usr2_requeues_and_resumes(job: RunningJob, cluster: dict[str, str], image: Path, rootfs: Path,
                              outside_digest: str) -> None:
    """Job `job` (2 nodes of 1 rank, its ranks in `image`, whose root is `rootfs`) is sent USR2 mid-run: its
    ranks, the image's python3 with its torch, agree on a checkpoint, rank 0 requeues it (through the relay: the
    image has no scontrol), and the next attempt resumes in a new container to the uninterrupted digest. Both
    attempts' lines, and `gpujobs status`, name the image."""
    run_dir = job.run_dir
    job.wait_for_step(30)
    job_id = slurm_job_id(job.output())
    first = slurm_rank_pids(job_id)  # host pids: both runtimes keep the host's pid namespace
    assert sorted(first) == [0, 1], first
    assert all(runs_the_image_python(pid, rootfs) for pid in first.values()), first
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, env={**os.environ, **cluster})
    assert job.wait(timeout=180) == 0, job.output()

    preempted, completed = attempts(run_dir)
    assert preempted["reason"] == "preempted" and preempted["requeue"] is True, preempted
    assert preempted["job_id"] == completed["job_id"] == job_id
    assert completed["reason"] == "completed" and completed["resumed_from"] == preempted["saved"], completed
    assert completed["start_step"] == preempted["steps_done"] > 0, (preempted, completed)
    assert completed["start"] > preempted["end"]  # a second srun step: new processes, a new container
    for line in (preempted, completed):
        assert line["image"] == str(image) and "image_id" not in line, line  # neither runtime reports a digest
    assert read_result(run_dir)["param_digest"] == outside_digest
    assert not (rootfs / "usr/bin/scontrol").exists() and not list(run_dir.glob(".slurm-relay-*"))
    assert sacct_state(job_id, cluster) == "COMPLETED"

    status = subprocess.run([sys.executable, "-m", "gpujobs", "status", str(run_dir)], capture_output=True,
                            text=True, env={**os.environ, **cluster, "COLUMNS": "100"}, timeout=60)
    assert status.returncode == 0, status.stderr
    assert f"image: {image}" in status.stdout, status.stdout

def test_usr2_to_ranks_in_charliecloud_requeues_and_resumes_in_a_new_container(
    tmp_path: Path, slurm: dict[str, str], image_dir: Path, outside_digest: str
) -> None:
    run_dir = tmp_path / "run"
    # an empty USER (ch-run refuses to start without one: the script sets it), the checkout on PYTHONPATH
    env = {**slurm, "PYTHONPATH": str(REPO), "USER": ""}
    job = RunningJob(run_dir, *MODEL, "cluster=slurm", "resources.nodes=2", "resources.procs_per_node=1",
                     "cluster.wait=true", *in_image(image_dir), env=env)
    usr2_requeues_and_resumes(job, slurm, image_dir, image_dir, outside_digest)



def test_the_relay_runs_slurm_commands_and_nothing_else(
    tmp_path: Path, slurm: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process without Slurm's commands on its PATH (a rank in an image) has the supervisor run them."""
    monkeypatch.setenv("SLURM_CONF", slurm["SLURM_CONF"])  # the supervisor's environment reaches the cluster
    asking = (
        "import sys\n"
        "from gpujobs.backends.slurm.commands import SlurmCommandError, slurm_output\n"
        "print(slurm_output(['sinfo', '-h', '-o', '%P']).split())\n"
        "try:\n"
        "    slurm_output(['rm', '-rf', sys.argv[1]])\n"
        "except SlurmCommandError as err:\n"
        "    print(err)\n"
    )
    kept = tmp_path / "kept"
    kept.mkdir()
    with Relay(tmp_path / "relay") as relay:
        env = {"PATH": str(tmp_path / "no-bin"), "PYTHONPATH": str(REPO), RELAY_ENV: str(relay.directory)}
        proc = subprocess.run([sys.executable, "-c", asking, str(kept)], capture_output=True, text=True, env=env,
                              timeout=60)
    assert proc.returncode == 0, proc.stderr
    partitions, refused = proc.stdout.splitlines()
    assert "'debug*'" in partitions, proc.stdout  # scripts/local-slurm.sh's default partition
    assert refused.startswith("rm is not one of Slurm's commands the supervisor runs (sacct, scancel, "), refused
    assert kept.is_dir() and not (tmp_path / "relay").exists()
