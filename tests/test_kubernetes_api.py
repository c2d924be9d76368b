"""`cluster=kubernetes` submits and manages a JobSet through the API client: submit, status, logs, cancel,
resubmit, a sweep of one JobSet a point, and `cluster.wait` following one to its end.

No Kubernetes API server can run on these machines: the cluster is `kubefake`'s loopback HTTP server, which
answers as the API documents (a JobSet it takes is validated against the pinned JobSet CRD), reached by the
real `gpujobs` commands in subprocesses through a kubeconfig with a bearer token. What the JobSet controller
and Kueue would write into a JobSet's status, the test writes (`FakeCluster.set_status`); the pods' side is
`test_kubernetes_pods.py`'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubefake import JOBSETS, FakeCluster, running

from gpujobs.rundir import CONFIG_FILE, SUBMISSIONS_FILE, lease

IMAGE = "registry.example.com/team/rec:1"
KUBE = ("+experiment=rec", "cluster=kubernetes", "cluster.volume.claim=team-runs", "container=podman",
        f"container.image={IMAGE}", "cluster.namespace=ml")
LIST = JOBSETS.format("ml")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[FakeCluster]:
    with running(tmp_path / "kubeconfig") as fake:
        yield fake


def gpujobs(tmp_path: Path, module: str, *args: str, config: str = "kubeconfig") -> subprocess.CompletedProcess[str]:
    """`python -m MODULE ARGS` with the fake cluster's kubeconfig, the volume mounted at tmp_path/runs."""
    env = {**os.environ, "KUBECONFIG": str(tmp_path / config), "PYTHONUNBUFFERED": "1"}
    (tmp_path / "runs").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180, env=env)


def submit(tmp_path: Path, *overrides: str, config: str = "kubeconfig") -> subprocess.CompletedProcess[str]:
    """The real submit of the rec experiment as a JobSet, its run dir tmp_path/runs/rec."""
    return gpujobs(tmp_path, "gpujobs.submit", f"hydra.run.dir={tmp_path / 'runs' / 'rec'}", *KUBE,
                   f"cluster.volume.mount_path={tmp_path / 'runs'}", *overrides, config=config)


def submitted(proc: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """(namespace, name) of the JobSet a submit's stdout names, before its closing lines: the run dir and the
    commands that read it, a queued JobSet's `cancel` among them."""
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    line, run_dir = lines[-6], lines[-5]
    assert line.startswith("gpujobs: submitted JobSet ml/"), line
    assert run_dir.startswith("gpujobs: run dir ") and lines[-2].startswith("  gpujobs cancel "), lines[-5:]
    namespace, name = line.split()[3].rstrip(";").split("/")
    return namespace, name


def status_row(tmp_path: Path, target: Path) -> str:
    proc = gpujobs(tmp_path, "gpujobs", "status", str(target))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_submit_creates_the_jobset_a_dry_run_prints_and_hands_it_the_run_dir(
        tmp_path: Path, cluster: FakeCluster) -> None:
    run_dir = tmp_path / "runs" / "rec"
    dry = submit(tmp_path, "cluster.dry_run=true")
    assert dry.returncode == 0, dry.stderr
    ns, name = submitted(submit(tmp_path))
    created = cluster.jobsets[(ns, name)]
    printed = yaml.safe_load(dry.stdout)
    assert {k: v for k, v in created.items() if k != "status"} == {
        **printed, "metadata": {**printed["metadata"], **{k: created["metadata"][k] for k in
                                                          ("uid", "generation", "creationTimestamp")}}}
    assert yaml.safe_load((run_dir / "jobset.yaml").read_text()) == printed  # kept for kubectl apply -f
    assert (run_dir / CONFIG_FILE).exists()
    (line,) = [json.loads(t) for t in (run_dir / SUBMISSIONS_FILE).read_text().splitlines()]
    assert line["job_id"] == f"ml/{name}" and line["cluster"] == "kubernetes", line
    assert line["logs"] == str(run_dir / "submitit")
    held = lease.read(run_dir)
    assert held is not None and (held.holder, held.job_id) == ("kubernetes", f"ml/{name}"), held
    # the preflight's reads (namespace, nodes), the look for an old JobSet of the name, the create
    assert cluster.requests[-4:] == ["/api/v1/namespaces/ml", "/api/v1/nodes?labelSelector=", f"{LIST}/{name}",
                                     f"POST {LIST}"], cluster.requests


def test_status_reads_the_jobset_and_the_run_dir_and_cancel_deletes_it(tmp_path: Path, cluster: FakeCluster) -> None:
    run_dir = tmp_path / "runs" / "rec"
    ns, name = submitted(submit(tmp_path))
    cluster.set_status(ns, name, suspend=True)  # Kueue has not admitted it
    assert "PENDING" in status_row(tmp_path, run_dir)
    cluster.set_status(ns, name, restarts=1)
    assert "RUNNING" in status_row(tmp_path, run_dir)
    before = len(cluster.requests)
    assert cluster.requests[before - 1] == LIST  # one list of the namespace's JobSets, not a read a job

    again = submit(tmp_path)  # the running JobSet holds the run dir: refused, nothing created
    assert again.returncode == 2 and f"JobSet ml/{name}" in again.stderr, again.stderr
    assert f"POST {LIST}" not in cluster.requests[before:]

    cluster.deletion_reads = 2  # its pods take a while to save and stop
    cancel = gpujobs(tmp_path, "gpujobs", "cancel", str(run_dir))
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert f"DELETE {LIST}/{name}?propagationPolicy=Foreground" in cluster.requests, cluster.requests
    assert "STOPPING" in status_row(tmp_path, run_dir)  # the JobSet stays while its pods may write
    meanwhile = submit(tmp_path)  # so the run dir stays theirs
    assert meanwhile.returncode == 2 and f"JobSet ml/{name} is STOPPING" in meanwhile.stderr, meanwhile.stderr
    assert (ns, name) not in cluster.jobsets  # that read was the last before its pods were gone
    assert "CANCELLED" in status_row(tmp_path, run_dir)
    twice = gpujobs(tmp_path, "gpujobs", "cancel", str(run_dir))
    assert twice.returncode == 0 and "no such JobSet" in twice.stdout + twice.stderr, twice.stdout + twice.stderr


def test_status_where_the_cluster_cannot_be_asked_shows_the_run_dirs_word(tmp_path: Path,
                                                                          cluster: FakeCluster) -> None:
    """No kubeconfig where status runs: one warning line, and the table from the run dir's files (exit 0)."""
    submitted(submit(tmp_path))
    proc = gpujobs(tmp_path, "gpujobs", "status", str(tmp_path / "runs" / "rec"), config="no-such-kubeconfig")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ("gpujobs: cannot ask the Kubernetes cluster about its JobSets: no kubeconfig found "
                           "(KUBECONFIG, else ~/.kube/config): showing what the run dirs say\n"), proc.stderr
    assert "? (files)" in proc.stdout, proc.stdout


def test_a_failed_jobset_is_resubmitted_under_its_name_once_the_old_one_is_gone(
        tmp_path: Path, cluster: FakeCluster) -> None:
    run_dir = tmp_path / "runs" / "rec"
    ns, name = submitted(submit(tmp_path))
    cluster.set_status(ns, name, terminal="Failed", restarts=3)
    assert "FAILED" in status_row(tmp_path, run_dir)
    cluster.deletion_reads = 2  # the old JobSet is still there for two reads after its deletion
    proc = gpujobs(tmp_path, "gpujobs", "resubmit", "--failed", str(run_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"gpujobs: submitted JobSet ml/{name}" in proc.stdout
    deleted = cluster.requests.index(f"DELETE {LIST}/{name}?propagationPolicy=Foreground")
    assert cluster.requests[deleted + 1:].count(f"{LIST}/{name}") == 3  # waited until it was gone
    assert cluster.requests[-1] == f"POST {LIST}"
    assert cluster.jobsets[(ns, name)]["status"] == {}  # a new one
    lines = [json.loads(t) for t in (run_dir / SUBMISSIONS_FILE).read_text().splitlines()]
    assert [line["job_id"] for line in lines] == [f"ml/{name}"] * 2
    assert "RUNNING" in status_row(tmp_path, run_dir)


def test_a_completed_jobset_releases_the_run_dir(tmp_path: Path, cluster: FakeCluster) -> None:
    run_dir = tmp_path / "runs" / "rec"
    ns, name = submitted(submit(tmp_path))
    cluster.set_status(ns, name, terminal="Completed")
    assert "COMPLETED" in status_row(tmp_path, run_dir)
    resubmit = gpujobs(tmp_path, "gpujobs", "resubmit", "--failed", str(run_dir))
    assert resubmit.returncode == 1 and resubmit.stdout == "gpujobs: no failed points to resubmit\n", resubmit.stdout
    assert cluster.requests.count(f"POST {LIST}") == 1
    assert submitted(submit(tmp_path, "trainer.max_steps=80")) == (ns, name)  # its lease is free: a longer run


def test_a_refused_create_leaves_nothing_behind(tmp_path: Path, cluster: FakeCluster) -> None:
    cluster.failures[f"POST {LIST}"] = (403, "Forbidden")
    proc = submit(tmp_path)
    assert proc.returncode != 0 and proc.stdout == "", proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "could not create JobSet ml/" in line and "HTTP 403 Forbidden" in line, line
    assert "it needs RBAC create jobsets.jobset.x-k8s.io" in line, line
    assert not (tmp_path / "runs" / "rec").exists() or not any((tmp_path / "runs" / "rec").iterdir())


def test_without_a_kubeconfig_only_a_dry_run_is_taken(tmp_path: Path) -> None:
    proc = submit(tmp_path, config="no-such-kubeconfig")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpujobs: config error: cluster.dry_run=False is invalid: allowed true: a JobSet is "
                           "created through the API client, and no kubeconfig found"), line
    assert not (tmp_path / "runs" / "rec").exists()


def test_logs_reads_what_the_pods_wrote_into_the_run_dir(tmp_path: Path, cluster: FakeCluster) -> None:
    run_dir = tmp_path / "runs" / "rec"
    _, name = submitted(submit(tmp_path, "resources.nodes=2", "resources.gpus_per_node=2"))
    (run_dir / "submitit" / f"{name}_3_log.out").write_text("rank 3 says hello\n")  # as pod 1 writes it
    proc = gpujobs(tmp_path, "gpujobs", "logs", str(run_dir), "--rank", "3")
    assert proc.returncode == 0 and proc.stdout == "rank 3 says hello\n", proc.stdout + proc.stderr


def test_a_sweep_is_one_jobset_a_point_and_status_lists_them_in_one_call(tmp_path: Path, cluster: FakeCluster) -> None:
    sweep_dir = tmp_path / "runs" / "sweep"
    proc = gpujobs(tmp_path, "gpujobs.submit", "-m", f"hydra.sweep.dir={sweep_dir}", *KUBE,
                   f"cluster.volume.mount_path={tmp_path / 'runs'}", "optim.lr=1e-3,1e-2,1e-1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert cluster.requests.count(f"POST {LIST}") == 3
    names = sorted(name for _, name in cluster.jobsets)
    assert len(set(names)) == 3
    ns, first = next(iter(cluster.jobsets))
    cluster.set_status(ns, first, terminal="Failed")
    before = len(cluster.requests)
    table = status_row(tmp_path, sweep_dir)
    assert cluster.requests[before:] == [LIST], cluster.requests[before:]
    assert table.count("RUNNING") == 2 and table.count("FAILED") == 1, table
    resubmit = gpujobs(tmp_path, "gpujobs", "resubmit", "--failed", str(sweep_dir))
    assert resubmit.returncode == 0, resubmit.stdout + resubmit.stderr
    assert cluster.requests.count(f"POST {LIST}") == 4 and f"JobSet ml/{first}" in resubmit.stdout


@pytest.mark.parametrize(("terminal", "code"), [("Completed", 0), ("Failed", 1)])
def test_cluster_wait_follows_the_jobset_to_its_end(tmp_path: Path, cluster: FakeCluster, terminal: str,
                                                    code: int) -> None:
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig")}
    (tmp_path / "runs").mkdir()
    cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={tmp_path / 'runs' / 'rec'}", *KUBE,
           f"cluster.volume.mount_path={tmp_path / 'runs'}", "cluster.wait=true"]
    follower = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert follower.stdout is not None
        line = follower.stdout.readline()  # submitted: the JobSet exists
        assert line.startswith("gpujobs: submitted JobSet ml/"), line
        name = line.split()[3].rstrip(";").split("/")[1]
        cluster.set_status("ml", name, terminal=terminal)
        assert follower.wait(timeout=120) == code
        assert f"JobSet ml/{name}: {terminal.upper()}" in follower.stderr.read()  # type: ignore[union-attr]
    finally:
        follower.kill()
        follower.wait()



@pytest.mark.parametrize("refusal", [False, True], ids=["blip", "refused"])
def test_a_follow_reads_on_through_a_blip_and_ends_at_a_refusal(tmp_path: Path, cluster: FakeCluster,
                                                                refusal: bool) -> None:
    """An API server that answers 500 for a while is asked again until the JobSet ends; one that refuses the
    user (403) ends the follow at once with one line and 1, as asking again would not change it."""
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig"), "PYTHONUNBUFFERED": "1"}
    (tmp_path / "runs").mkdir()
    cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={tmp_path / 'runs' / 'rec'}", *KUBE,
           f"cluster.volume.mount_path={tmp_path / 'runs'}", "cluster.wait=true"]
    follower = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert follower.stdout is not None and follower.stderr is not None
        name = follower.stdout.readline().split()[3].rstrip(";").split("/")[1]
        assert follower.stderr.readline() == f"gpujobs: JobSet ml/{name}: RUNNING\n"
        cluster.failures[LIST] = (403, "Forbidden") if refusal else (500, "InternalError")
        if refusal:
            assert follower.wait(timeout=60) == 1
            (line,) = follower.stderr.read().splitlines()
            assert line.startswith(f"gpujobs: JobSet ml/{name}: cannot follow it: ") and "HTTP 403" in line, line
            return
        line = follower.stderr.readline()
        assert line.startswith(f"gpujobs: JobSet ml/{name}: unknown (") and "HTTP 500" in line, line
        del cluster.failures[LIST]
        cluster.set_status("ml", name, terminal="Completed")
        assert follower.wait(timeout=60) == 0
        assert follower.stderr.read() == f"gpujobs: JobSet ml/{name}: COMPLETED\n"
    finally:
        follower.kill()
        follower.wait()
