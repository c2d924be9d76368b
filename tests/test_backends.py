"""The backend registry and what callers ask of a backend instead of its name; the one Slurm runner's
error line. No Slurm cluster needed: the failing Slurm commands are real ones, refused or not found."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import compose_job

from gpujobs.backends import Scheduler, backend_for, backend_named, names, resolve_cluster_name, slurm_backend
from gpujobs.backends.slurm.commands import SlurmCommandError, slurm_command
from gpujobs.backends.slurm.jobs import job_state
from gpujobs.base.errors import ConfigError, GpujobsError
from gpujobs.config.cluster import CLUSTERS


def test_every_cluster_name_the_config_takes_has_a_backend() -> None:
    assert sorted(names()) == sorted(set(CLUSTERS) - {"auto"})
    with pytest.raises(ConfigError, match=r"cluster.name='auto' is invalid: allowed one of local, debug, slurm"):
        backend_named("auto")  # resolved on the submit side first
    assert resolve_cluster_name("debug") == "debug"
    unresolved = compose_job("+experiment=rec", "+debug=tiny", "cluster=auto")  # a config built in code
    assert backend_for(unresolved).name == resolve_cluster_name("auto")


@pytest.mark.parametrize(("name", "queues", "in_process", "shares_nodes", "renders"), [
    ("local", False, False, False, False),
    ("debug", False, True, False, False),
    ("slurm", True, False, True, True),
])
def test_what_callers_ask_of_a_backend(name: str, queues: bool, in_process: bool, shares_nodes: bool,
                                       renders: bool) -> None:
    job = compose_job("+experiment=rec", "+debug=tiny", f"cluster={name}")
    backend = backend_for(job)
    assert backend.name == name and isinstance(backend, Scheduler) == queues
    assert (backend.queues, backend.in_process, backend.shares_nodes, backend.renders, backend.parses_paths) == (
        queues, in_process, shares_nodes, renders, renders)
    assert backend.follows(job) == (not queues)  # cluster.wait unset: follow what runs here only
    for wait in (True, False):
        assert backend.follows(dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, wait=wait))) == wait


def test_only_a_queueing_backend_renders_a_script(tmp_path: Path) -> None:
    job = compose_job("+experiment=rec", "+debug=tiny", "cluster=local")
    with pytest.raises(ConfigError, match=r"cluster.dry_run=True is invalid: allowed false unless cluster=slurm"):
        backend_for(job).render(job, tmp_path)
    slurm = compose_job("+experiment=rec", "+debug=tiny", "cluster=slurm", "cluster.partition=gpu")
    script = backend_for(slurm).render(slurm, tmp_path / "run")
    assert script.startswith("#!") and "#SBATCH --partition=gpu" in script and "--requeue" in script
    assert not (tmp_path / "run").exists()  # rendering writes nothing


def test_a_slurm_command_that_fails_is_one_gpujobs_error_with_its_last_stderr_line(tmp_path: Path) -> None:
    refused = ["squeue", "--no-such-option"]  # refused whether or not a cluster answers here, and at once
    proc = slurm_command(refused, check=False)
    assert proc.returncode != 0 and proc.stderr.strip()
    said = [line.strip() for line in proc.stderr.splitlines() if line.strip()][-1]
    with pytest.raises(SlurmCommandError) as caught:
        slurm_command(refused)
    assert isinstance(caught.value, GpujobsError) and "\n" not in str(caught.value)
    assert str(caught.value) == f"squeue failed: {said} (`squeue --no-such-option`)"
    with pytest.raises(SlurmCommandError, match=r"^sacct could not run: No such file or directory"):
        slurm_command(["sacct", "-X"], env={"PATH": str(tmp_path)})


def test_a_job_state_slurm_cannot_be_asked_for_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue: Slurm cannot be asked, which is not "gone"
    assert job_state("4242") is None
    assert slurm_backend().liveness("4242") == (True, "Slurm cannot be asked (squeue failed): assumed running")
