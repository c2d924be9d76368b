"""`cluster=kubernetes` asks the kubeconfig's cluster whether the job can ever fit, and refuses one that cannot.

No Kubernetes API server can run on these machines: the cluster is `kubefake`'s loopback HTTP server, which
answers as the API documents (see there), reached by the real submit command in a subprocess through a
kubeconfig with a bearer token.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import submit
from kubefake import KUEUE, FakeCluster, cluster_queue, kubeconfig, node, running

from gpujobs.base.errors import ConfigError
from gpujobs.config.kube_names import quantity_value

IMAGE = "registry.example.com/team/rec:1"
KUBE = ("+experiment=rec", "cluster=kubernetes", "cluster.dry_run=true", "cluster.volume.claim=team-runs",
        "container=podman", f"container.image={IMAGE}", "cluster.namespace=ml")
QUEUED = ("cluster.queue=team-a", "cluster.node_selector={nvidia.com/gpu.product: A100}")
#: The four reads of a queued job's preflight, in order.
QUEUED_READS = ["/api/v1/namespaces/ml", f"{KUEUE}/namespaces/ml/localqueues/team-a", f"{KUEUE}/clusterqueues/team-cq",
                "/api/v1/nodes?labelSelector=nvidia.com/gpu.product%3DA100"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[FakeCluster]:
    with running(tmp_path / "kubeconfig") as fake:
        yield fake


def run(tmp_path: Path, *overrides: str, config: Optional[Path] = None) -> Any:
    """The real submit of a dry run under tmp_path/runs with KUBECONFIG=`config` (default: the fixture's)."""
    run_dir = tmp_path / "runs" / "rec"
    run_dir.parent.mkdir(exist_ok=True)
    env = {"KUBECONFIG": str(config or tmp_path / "kubeconfig")}
    return submit(run_dir, *KUBE, f"cluster.volume.mount_path={tmp_path / 'runs'}", *overrides, env=env)


def notes(stderr: str) -> str:
    """What a dry run said on stderr besides its memory plan (the block that starts `memory plan:`) and the CPUs
    a GPU rank was given (the nodes' CPUs are unknown from here)."""
    kept, in_plan = [], False
    for line in stderr.splitlines():
        in_plan = line.startswith("memory plan:") or (in_plan and line.startswith("  "))
        if not in_plan and not line.startswith("gpujobs: resources.cpus_per_task=null:"):
            kept.append(line)
    return "\n".join(kept).strip()


def assert_refused(proc: Any, tmp_path: Path, key: str) -> str:
    """Exit 2, stdout empty, one line on stderr naming `key`, no run dir; the line."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert f"{key}=" in line, line
    assert not (tmp_path / "runs" / "rec").exists()
    return str(line)


def test_a_job_that_fits_renders_after_asking_each_object_once(tmp_path: Path, cluster: FakeCluster) -> None:
    cluster.validate()
    proc = run(tmp_path, *QUEUED, "resources.nodes=1", "resources.gpus_per_node=8")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["kind"] == "JobSet"
    assert notes(proc.stderr) == "" and "memory plan: parallel=ddp, 8 ranks" in proc.stderr
    assert cluster.requests == QUEUED_READS


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (("cluster.namespace=other",), "cluster.namespace", "a namespace that exists at http://127.0.0.1:"),
        (("cluster.queue=team-b",), "cluster.queue", "a Kueue LocalQueue of namespace ml"),
        (("cluster.queue=orphan",), "cluster.queue", "points at ClusterQueue gone-cq, which does not"),
        (("resources.nodes=2", "resources.gpus_per_node=8"), "resources.nodes",
         "at most 1 nodes of 8 nvidia.com/gpu (at most 8 in all: ClusterQueue team-cq, flavor a100: nominal 8, "
         "in no cohort to borrow from)"),
        (("resources.gpus_per_node=16",), "resources.gpus_per_node", "at most 8 nvidia.com/gpu in all"),
        (("cluster.gpu_resource=nvidia.com/mig-1g.10gb", "resources.gpus_per_node=2"), "resources.gpus_per_node",
         "0 nvidia.com/mig-1g.10gb through LocalQueue ml/team-a: ClusterQueue team-cq has no quota of it"),
    ],
)
def test_a_job_the_namespace_or_queue_can_never_hold_is_refused(
        tmp_path: Path, cluster: FakeCluster, overrides: tuple[str, ...], key: str, allowed: str) -> None:
    proc = run(tmp_path, *QUEUED, "resources.gpus_per_node=4", *overrides)
    line = assert_refused(proc, tmp_path, key)
    assert line.startswith(f"gpujobs: config error: {key}="), line
    assert allowed in line, line


def test_a_pod_no_node_can_hold_is_refused(tmp_path: Path, cluster: FakeCluster) -> None:
    small = run(tmp_path, "cluster.node_selector={nvidia.com/gpu.product: T4}", "resources.gpus_per_node=4")
    assert "at most 2 nvidia.com/gpu per node (the most allocatable on any of the 1 nodes with the labels" \
        in assert_refused(small, tmp_path, "resources.gpus_per_node")
    cluster.nodes = [node("gpu-1", "4", "A100")]
    assert_refused(run(tmp_path, "resources.gpus_per_node=8"), tmp_path, "resources.gpus_per_node")
    nowhere = run(tmp_path, "cluster.node_selector={nvidia.com/gpu.product: H100}", "resources.gpus_per_node=2")
    assert "labels that some node has (no node has them all)" in assert_refused(nowhere, tmp_path,
                                                                                "cluster.node_selector")
    fits = run(tmp_path, "resources.gpus_per_node=4", "resources.nodes=3")  # no queue: the nodes alone are asked
    assert fits.returncode == 0, fits.stderr


@pytest.mark.parametrize(
    ("borrowing", "fits"),
    [(8, True), ("8", True), (None, True), (0, False), ("7", False)],
)
def test_borrowing_in_a_cohort_counts_up_to_its_limit(
        tmp_path: Path, cluster: FakeCluster, borrowing: Any, fits: bool) -> None:
    """Two nodes of 8 GPUs on a queue of 8 nominal: they fit with 8 to borrow, or with no borrowing limit
    (Kueue: null is no limit), not with less."""
    cluster.objects[f"{KUEUE}/clusterqueues/team-cq"] = cluster_queue(8, cohort="research", borrowing=borrowing)
    cluster.validate()
    proc = run(tmp_path, *QUEUED, "resources.nodes=2", "resources.gpus_per_node=8")
    if fits:
        assert proc.returncode == 0, proc.stderr
        assert yaml.safe_load(proc.stdout)["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 2
    else:
        line = assert_refused(proc, tmp_path, "resources.nodes")
        assert f"nominal 8 + borrowing {borrowing} from cohort research" in line, line


@pytest.mark.parametrize(
    ("path", "code", "reason", "key"),
    [
        ("/api/v1/namespaces/ml", 403, "Forbidden", "cluster.namespace"),
        (f"{KUEUE}/clusterqueues/team-cq", 500, "InternalError", "cluster.queue"),
        ("/api/v1/nodes", 403, "Forbidden", "resources.gpus_per_node"),
    ],
)
def test_an_api_refusal_refuses_the_submit_in_one_line(
        tmp_path: Path, cluster: FakeCluster, path: str, code: int, reason: str, key: str) -> None:
    cluster.failures[path] = (code, reason)
    line = assert_refused(run(tmp_path, *QUEUED, "resources.gpus_per_node=4"), tmp_path, key)
    assert line.startswith(f"gpujobs: cannot check {key}="), line
    phrase = HTTPStatus(code).phrase  # the status line's; the Status body's message follows
    assert "could not get " in line and f"HTTP {code} {phrase}: {reason.lower()} for {path}: as the test asked" in line
    assert ("it needs RBAC" in line) == (code == 403), line
    assert sum(r.startswith(path) for r in cluster.requests) == 1  # a refusal is not retried


def test_an_unreachable_api_server_refuses_the_submit_in_one_line(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = server.server_address[1]
    server.server_close()  # a port nothing listens on
    config = kubeconfig(tmp_path / "kubeconfig", f"http://127.0.0.1:{port}")
    line = assert_refused(run(tmp_path, config=config), tmp_path, "cluster.namespace")
    assert f"cannot reach the Kubernetes API at http://127.0.0.1:{port} to get namespace ml" in line, line
    assert "Connection refused" in line, line


@pytest.mark.parametrize(
    ("text", "why"),
    [("current-context: nope\ncontexts: []\n", "Expected object with name nope"),
     (": : [\n", "while parsing a block mapping")],
)
def test_a_kubeconfig_the_client_cannot_use_refuses_the_submit_in_one_line(tmp_path: Path, text: str, why: str) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(text)
    proc = run(tmp_path, config=config)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"gpujobs: cannot use the kubeconfig {config}: ") and why in line, line
    assert not (tmp_path / "runs" / "rec").exists()


def test_without_a_kubeconfig_the_dry_run_renders_and_says_the_cluster_was_not_asked(tmp_path: Path) -> None:
    proc = run(tmp_path, *QUEUED, "resources.gpus_per_node=4", config=tmp_path / "no-such-kubeconfig")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["kind"] == "JobSet"
    (line,) = notes(proc.stderr).splitlines()
    assert line == ("gpujobs: the cluster was not asked whether the job can ever fit: no kubeconfig found "
                    "(KUBECONFIG, else ~/.kube/config)")


def test_without_the_kubernetes_package_the_dry_run_renders_and_says_so(tmp_path: Path, cluster: FakeCluster) -> None:
    """The real submit with `kubernetes` made unimportable (None in sys.modules, as Python's import system
    reads it): a kubeconfig is there, but nothing can ask; the server hears nothing."""
    run_dir = tmp_path / "runs" / "rec"
    run_dir.parent.mkdir()
    unimportable = ("import runpy, sys; sys.modules['kubernetes'] = None; sys.argv[0] = 'gpujobs.submit'; "
                    "runpy.run_module('gpujobs.submit', run_name='__main__')")
    cmd = [sys.executable, "-c", unimportable, f"hydra.run.dir={run_dir}", *KUBE,
           f"cluster.volume.mount_path={tmp_path / 'runs'}"]
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig")}
    proc = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["kind"] == "JobSet"
    assert notes(proc.stderr) == ("gpujobs: the cluster was not asked whether the job can ever fit: the kubernetes "
                                  "package is not installed (pip install 'gpujobs[kubernetes]')")
    assert cluster.requests == []


def test_a_sweep_asks_the_cluster_once(tmp_path: Path, cluster: FakeCluster) -> None:
    sweep_dir = tmp_path / "runs" / "sweep"
    sweep_dir.parent.mkdir()
    cmd = [sys.executable, "-m", "gpujobs.submit", "-m", f"hydra.sweep.dir={sweep_dir}", *KUBE, *QUEUED,
           f"cluster.volume.mount_path={tmp_path / 'runs'}", "resources.gpus_per_node=2,4,8"]
    env = {**os.environ, "KUBECONFIG": str(tmp_path / "kubeconfig")}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    documents = list(yaml.safe_load_all(proc.stdout[proc.stdout.index("apiVersion:"):]))
    assert len(documents) == 3
    assert cluster.requests == QUEUED_READS


def test_quantities_are_read_as_kubernetes_parses_them() -> None:
    cases = {"8": 8, 8: 8, "1Ki": 1024, "250m": Decimal("0.25"), "1e3": 1000, "1E": 10**18, "1.5Gi": 3 * 2**29,
             "+2k": 2000, ".5": Decimal("0.5")}
    for text, value in cases.items():
        assert quantity_value("q", text) == value, text
    for bad in ("1Mb", "", "1 Gi", True, None, 1.5):
        with pytest.raises(ConfigError):
            quantity_value("q", bad)


def test_the_fakes_are_checked_against_the_schemas(cluster: FakeCluster) -> None:
    """The shape checks can fail: a queue or node the API would refuse is refused."""
    broken = FakeCluster()
    broken.objects[f"{KUEUE}/clusterqueues/team-cq"]["spec"]["resourceGroups"][0]["flavors"][0]["resources"][2][
        "nominalQuota"] = "8 GPUs"
    with pytest.raises(jsonschema.ValidationError):
        broken.validate()
    broken = FakeCluster()
    broken.nodes[0]["status"]["allocatable_typo"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        broken.validate()
