"""Ranks in a container on the live Slurm cluster through Slurm's own OCI support (issue 28).

`container=oci container.image=BUNDLE` renders `srun --container=BUNDLE`; slurmstepd writes the bundle's
config.json anew for each step (the step's argv, environment, its rootfs at BUNDLE/rootfs) and runs it with the
oci.conf that scripts/local-slurm.sh writes beside slurm.conf (crun). Slurm 22.05 runs one task per node in a
container step, so the job is 2 nodes of 1 rank each. USR2 reaches the ranks through crun (the bundle shares
the host's pid namespace), they agree on a checkpoint, rank 0 requeues the job, the next attempt's ranks start in
a fresh container, resume and end bit-identical to an uninterrupted run outside any container; both attempts'
lines name the bundle.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_container_slurm
from conftest import missing
from jobctl import RunningJob
from test_container_slurm import MODEL, usr2_requeues_and_resumes

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
#: MODEL's digest, run uninterrupted as 2 local ranks outside any container: the ch-run test's module fixture
outside_digest = test_container_slurm.outside_digest


@pytest.fixture(scope="module")
def oci_cluster(slurm: dict[str, str]) -> dict[str, str]:
    """The live cluster, with Slurm's OCI support configured (an oci.conf beside its slurm.conf)."""
    if not (Path(slurm["SLURM_CONF"]).parent / "oci.conf").is_file():
        missing(f"Slurm's OCI support: no oci.conf beside {slurm['SLURM_CONF']} (scripts/local-slurm.sh up writes "
                "one where crun is installed, GPUJOBS_SLURM_OCI=1)")
    return slurm


def test_usr2_to_ranks_in_slurm_oci_requeues_and_resumes_in_a_new_container(
    tmp_path: Path, oci_cluster: dict[str, str], oci_bundle: Path, outside_digest: str
) -> None:
    run_dir = tmp_path / "run"
    env = {**oci_cluster, "PYTHONPATH": str(REPO)}  # the checkout (the bundle mounts it) over the image's copy
    job = RunningJob(run_dir, *MODEL, "cluster=slurm", "resources.nodes=2", "resources.procs_per_node=1",
                     "cluster.wait=true", "container=oci", f"container.image={oci_bundle}", env=env)
    usr2_requeues_and_resumes(job, oci_cluster, oci_bundle, oci_bundle / "rootfs", outside_digest)


def test_two_ranks_a_node_in_slurm_oci_are_refused_at_submit(
    tmp_path: Path, oci_cluster: dict[str, str], oci_bundle: Path
) -> None:
    """Slurm 22.05's `srun --container` runs one task a node (the test cluster's version): a job of 2 ranks on
    one node would fail only at launch, after its wait in the queue; submit refuses it in one line."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gpujobs.submit", *MODEL, "cluster=slurm", "resources.nodes=1",
         "resources.procs_per_node=2", "container=oci", f"container.image={oci_bundle}", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env={**os.environ, **oci_cluster, "PYTHONPATH": str(REPO)}, timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [text for text in proc.stderr.splitlines() if "resources.procs_per_node" in text]
    assert "1 with container=oci on slurm" in line and " 22.05" in line and "one task a node" in line, line
    assert not run_dir.exists()  # nothing written, nothing queued
