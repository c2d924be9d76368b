"""`cluster=kubernetes` renders one JobSet that the real schemas accept, and refuses every bad value at submit.

No Kubernetes cluster can run here, so nothing in this file has run against one. What stands in for the API
server's checks is its own schemas: the JobSet CRD's `openAPIV3Schema` (JobSet v0.12.0, tests/data/k8s/) with
`jsonschema`, and the Job and Pod templates inside it with `kubernetes-validate` (Kubernetes' OpenAPI
schemas, strict: an unknown field fails). The restart policy's two message patterns are checked against the
Job controller's own message format (`pkg/controller/job/pod_failure_policy.go`).
"""

from __future__ import annotations

import copy
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from conftest import assert_golden, compose_job, submit

from gpujobs.backends import backend_named
from gpujobs.backends.kubernetes import jobset as js
from gpujobs.config import kube_names as kube
from gpujobs.rank.metrics import MetricsLog
from gpujobs.rundir.files import record_cancel, record_submission
from gpujobs.rundir.records import CheckpointRecord, TrainRecord

CRD = Path(__file__).parent / "data" / "k8s" / "jobset-v0.12.0.jobsets.crd.yaml"
K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 ships
#: A run dir on the volume, as a user's would be (the render takes it as given: golden files stay put).
MOUNT = "/mnt/runs"
IMAGE = "registry.example.com/team/rec:1"
KUBE = ("+experiment=rec", "cluster=kubernetes", "cluster.dry_run=true", f"cluster.volume.mount_path={MOUNT}",
        "cluster.volume.claim=team-runs", f"container.image={IMAGE}")  # the image alone: the kubelet runs it
#: Every placement key set, so that the golden files show each where it lands.
PLACED = ("cluster.namespace=ml", "cluster.queue=team-a", "cluster.priority_class=high",
          "cluster.service_account=trainer", "cluster.node_selector={nvidia.com/gpu.product: H100-SXM}",
          "cluster.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]")
SHAPES = {
    "1node_cpu": ("resources.nodes=1", "resources.procs_per_node=2"),
    "2node_cpu": ("resources.nodes=2", "resources.procs_per_node=2", "resources.mem_gb=8"),
    "1node_gpu": ("resources.nodes=1", "resources.gpus_per_node=8", "resources.cpus_per_task=4", *PLACED),
    "2node_gpu": ("resources.nodes=2", "resources.gpus_per_node=4", "resources.mem_gb=512", "cluster.max_restarts=3",
                  *PLACED),
}


def crd_schema() -> dict[str, Any]:
    """The JobSet CRD's schema of v1alpha2, the version rendered."""
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


SCHEMA = crd_schema()


def validate_crd(manifest: dict[str, Any]) -> None:
    """The JobSet against its CRD's schema (which embeds the Job template's, without refusing unknown fields:
    the API server prunes those)."""
    jsonschema.validate(manifest, SCHEMA, cls=jsonschema.Draft7Validator)


def validate_templates(manifest: dict[str, Any]) -> None:
    """Each Job template as a batch/v1 Job and its pod template as a v1 Pod, strictly (an unknown field fails)."""
    for replicated in manifest["spec"]["replicatedJobs"]:
        job_spec = replicated["template"]["spec"]
        metadata = {"name": f"{manifest['metadata']['name']}-{replicated['name']}-0"}
        kubernetes_validate.validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata,
                                      "spec": job_spec}, K8S_VERSION, strict=True)
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
                                      "spec": job_spec["template"]["spec"]}, K8S_VERSION, strict=True)


def validate(manifest: dict[str, Any]) -> None:
    """Both: what the API server would check of a JobSet and of the Job and Pods it makes."""
    validate_crd(manifest)
    validate_templates(manifest)


def rendered(shape: str) -> tuple[str, dict[str, Any]]:
    job = compose_job(*KUBE, *SHAPES[shape])
    run_dir = Path(MOUNT) / f"rec-{shape}"
    return backend_named("kubernetes").render(job, run_dir), js.jobset(job, run_dir)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_jobset_validates_against_the_crd_and_kubernetes_schemas_and_matches_its_golden_file(
        shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # the golden files' submitting user, whoever runs the test
    monkeypatch.setattr(os, "getegid", lambda: 1000)
    text, manifest = rendered(shape)
    assert yaml.safe_load(text) == manifest
    validate(manifest)
    assert_golden(text, f"kubernetes_{shape}.yaml")


def test_the_grace_period_covers_the_stop_the_run_dir_measured(tmp_path: Path) -> None:
    """SIGTERM to SIGKILL: `cluster.signal_lead_s` on a new run dir; where earlier attempts measured a stop that
    takes longer (the vote's wait of 10 + 1 steps of the slowest rank's median 2 s step, a 150 s save: 172 s),
    1.5 times that plus 10 s. An asynchronous save's blocking time is not its write: it does not count."""
    job = compose_job(*KUBE, f"cluster.volume.mount_path={tmp_path}", "trainer.stop_check_every=10")
    run_dir = tmp_path / "rec"
    run_dir.mkdir()
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    for step in (10, 20, 30):
        metrics.write(TrainRecord(step=step, loss=0.5, samples_per_s=1.0, step_time_s=[1.0, 2.0]))
    metrics.write(TrainRecord(step=40, loss=0.5, samples_per_s=1.0, step_time_s=[1.0, 9.0]))  # not the median
    metrics.write(CheckpointRecord(step=20, blocking_s=90.0))
    metrics.write(CheckpointRecord(step=30, blocking_s=150.0))
    metrics.write(CheckpointRecord(step=40, blocking_s=400.0, background=True))
    metrics.close()

    def grace(run: Path) -> int:
        pod = js.jobset(job, run)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        return int(pod["terminationGracePeriodSeconds"])

    assert grace(tmp_path / "new") == job.cluster.signal_lead_s == 120
    assert grace(run_dir) == math.ceil(1.5 * (11 * 2.0 + 150.0)) + 10 == 268


def test_the_jobset_says_what_the_config_asks() -> None:
    _, manifest = rendered("2node_gpu")
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    pod = job["template"]["spec"]
    (container,) = pod["containers"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (2, 2, "Indexed")
    assert container["resources"]["limits"] == {"memory": "524288Mi", "nvidia.com/gpu": 4}
    assert container["resources"]["requests"] == {"cpu": "4", "memory": "524288Mi"}
    assert manifest["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-a"}
    assert manifest["metadata"]["namespace"] == "ml"
    assert (pod["priorityClassName"], pod["serviceAccountName"]) == ("high", "trainer")
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100-SXM"}
    assert pod["terminationGracePeriodSeconds"] == 120  # cluster.signal_lead_s
    # the pods run as the submitting user, who owns the run dir they refuse to use if it is not their user's
    assert pod["securityContext"] == {"runAsUser": os.geteuid(), "runAsGroup": os.getegid()}
    assert manifest["spec"]["network"]["enableDNSHostnames"] is True
    assert manifest["spec"]["failurePolicy"]["maxRestarts"] == 3
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    name = manifest["metadata"]["name"]
    assert env["MASTER_ADDR"] == f"{name}-node-0-0.{name}"  # JobSet's pod 0 on its headless service
    assert env[js.JOBSET_ENV] == name
    assert env[js.RESTART_ENV] == {"fieldRef": {"fieldPath": f"metadata.annotations['{js.RESTART_ANNOTATION}']"}}
    assert (env[js.NNODES_ENV], env[js.RANKS_PER_NODE_ENV]) == ("2", "4")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[MOUNT]]["persistentVolumeClaim"] == {"claimName": "team-runs"}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory"}
    assert container["command"][-1] == f"{MOUNT}/rec-2node_gpu"


def test_the_validators_refuse_what_the_api_server_would() -> None:
    """The checks above can fail: each broken copy is refused by the validator that owns its part."""
    _, manifest = rendered("1node_gpu")
    template = ("spec", "replicatedJobs", 0, "template", "spec")
    breakages = [
        (validate_crd, ("spec", "failurePolicy", "rules", 0, "action"), "RestartForever"),
        (validate_crd, ("spec", "network", "enableDNSHostnames"), "yes"),
        (validate_crd, (*template, "completionMode"), 7),
        (validate_templates, (*template, "completionMode"), 7),
        (validate_templates, (*template, "template", "spec", "restartPolicy"), 3),
        (validate_templates, (*template, "template", "spec", "hostname_typo"), "x"),
        (validate_templates, (*template, "podFailurePolicy", "rules", 0, "onPodConditions"), "DisruptionTarget"),
    ]
    errors = (jsonschema.ValidationError, kubernetes_validate.ValidationError)
    for validator, path, value in breakages:
        broken = copy.deepcopy(manifest)
        node: Any = broken
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        with pytest.raises(errors):
            validator(broken)


def job_controller_message(rule: int, *, exit_code: int | None = None) -> str:
    """The Job controller's failure message for a pod that matched FailJob rule `rule`: by an exit code, or
    (None) by its DisruptionTarget condition (the format strings of `pod_failure_policy.go`)."""
    if exit_code is not None:
        return f"Container {js.CONTAINER} for pod ml/rec-abc-node-0-1-xk2p failed with exit code {exit_code} " \
               f"matching FailJob rule at index {rule}"
    return f"Pod ml/rec-abc-node-0-1-xk2p has condition DisruptionTarget matching FailJob rule at index {rule}"


def jobset_action(manifest: dict[str, Any], reason: str, message: str) -> str:
    """The JobSet controller's choice for a failed Job: the first rule whose reasons and patterns match,
    else RestartJobSet (the CRD's description of `failurePolicy.rules`)."""
    for rule in manifest["spec"]["failurePolicy"]["rules"]:
        reasons, patterns = rule.get("onJobFailureReasons", []), rule.get("onJobFailureMessagePatterns", [])
        if (not reasons or reason in reasons) and (not patterns or any(re.search(p, message) for p in patterns)):
            return str(rule["action"])
    return "RestartJobSet"


def test_the_failure_policy_tells_an_eviction_from_bad_input_from_a_failure() -> None:
    _, manifest = rendered("2node_gpu")
    pod_rules = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    evicted = pod_rules.index(next(r for r in pod_rules if "onPodConditions" in r))
    bad_input = pod_rules.index(next(r for r in pod_rules if "onExitCodes" in r))
    assert pod_rules[bad_input]["onExitCodes"]["values"] == [2]
    cases = [
        ("PodFailurePolicy", job_controller_message(evicted), "RestartJobSetAndIgnoreMaxRestarts"),
        ("PodFailurePolicy", job_controller_message(bad_input, exit_code=2), "FailJobSet"),
        ("BackoffLimitExceeded", "Job has reached the specified backoff limit", "RestartJobSet"),  # exit 1, a crash
        ("PodFailurePolicy", job_controller_message(bad_input + 10, exit_code=2), "RestartJobSet"),  # not ours
    ]
    for reason, message, action in cases:
        assert jobset_action(manifest, reason, message) == action, message


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("cluster.namespace=Team_A", "cluster.namespace"),
        (f"cluster.namespace={'a' * 64}", "cluster.namespace"),
        ("cluster.queue=Team-A", "cluster.queue"),
        (f"cluster.queue={'q' * 64}", "cluster.queue"),  # a subdomain, but too long for the label's value
        ("cluster.priority_class=-high", "cluster.priority_class"),
        ("cluster.service_account=trainer_1", "cluster.service_account"),
        ("cluster.node_selector={gpu type: a100}", "cluster.node_selector"),
        ("cluster.node_selector={gpu: a 100}", "cluster.node_selector.gpu"),
        ("cluster.tolerations=[{key: gpu, operator: Maybe}]", "cluster.tolerations[0].operator"),
        ("cluster.tolerations=[{key: gpu, effect: NoRun}]", "cluster.tolerations[0].effect"),
        ("cluster.tolerations=[{key: gpu, seconds: '3'}]", "cluster.tolerations[0].seconds"),
        ("cluster.gpu_resource=gpu", "cluster.gpu_resource"),
        ("cluster.gpu_resource=kubernetes.io/gpu", "cluster.gpu_resource"),
        ("cluster.volume.claim=Team_Runs", "cluster.volume.claim"),
        ("cluster.volume.claim=null", "cluster.volume.claim"),
        ("cluster.volume.mount_path=runs", "cluster.volume.mount_path"),
        ("container.image=null", "container.image"),
        ("container.mounts=[/tmp:/data]", "container.mounts"),
        ("resources.min_nodes=1", "resources.min_nodes"),
        ("cluster.dry_run=false", "cluster.dry_run"),
    ],
)
def test_a_bad_value_is_refused_in_one_line_and_nothing_is_written(tmp_path: Path, override: str, key: str) -> None:
    run_dir = tmp_path / "runs" / "rec"
    run_dir.parent.mkdir()
    mount = f"cluster.volume.mount_path={tmp_path / 'runs'}"
    extra = ("resources.nodes=2",) if key == "resources.min_nodes" else ()
    proc = submit(run_dir, *KUBE, mount, *extra, override)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"gpujobs: config error: {key}="), line
    assert not run_dir.exists()
    if key == "cluster.dry_run":
        # conftest's KUBECONFIG=/dev/null: nothing can create the JobSet (test_kubernetes_api.py creates them)
        assert "no kubeconfig found (KUBECONFIG, else ~/.kube/config) (a dry run prints it for kubectl apply -f)" \
            in line, line


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("cluster.tolerations=[a,b]", "cluster.tolerations=['a', 'b'] is invalid: allowed a list of mappings of names "
                                      "to strings (cluster.tolerations[0] is 'a')"),
        ("cluster.node_selector=[a]", "cluster.node_selector=['a'] is invalid: allowed a mapping of names to strings, "
                                      "or null (it is a list)"),
        ("cluster.tolerations=[{key: [a]}]", "cluster.tolerations=[{'key': ['a']}] is invalid: allowed a list of "
                                             "mappings of names to strings (cluster.tolerations[0].key is a list)"),
    ],
)
def test_a_wrong_shape_under_cluster_names_its_key_and_value(tmp_path: Path, override: str, line: str) -> None:
    """Issue 36: a list where a mapping is due (or a string in a list of them) was reported as OmegaConf's
    merge found it, `cluster.0=None is invalid: allowed a value of type ?`, or the whole cluster section."""
    run_dir = tmp_path / "runs" / "rec"
    run_dir.parent.mkdir()
    proc = submit(run_dir, *KUBE, f"cluster.volume.mount_path={tmp_path / 'runs'}", override)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.strip().splitlines() == [f"gpujobs: config error: {line}"]
    assert not run_dir.exists()


def test_a_run_dir_off_the_volume_is_refused(tmp_path: Path) -> None:
    run_dir = tmp_path / "elsewhere" / "rec"
    run_dir.parent.mkdir()
    proc = submit(run_dir, *KUBE, f"cluster.volume.mount_path={tmp_path / 'runs'}")
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"gpujobs: config error: hydra.run.dir='{run_dir}'"), line
    assert f"cluster.volume.mount_path={tmp_path / 'runs'}" in line
    assert not run_dir.exists()


def test_a_dry_run_prints_the_jobset_alone_and_leaves_nothing(tmp_path: Path) -> None:
    """`container.image` alone (no runtime: the kubelet runs it); the volume's mount path, which Hydra made
    above the run dir, goes with it."""
    run_dir = tmp_path / "runs" / "rec"
    overrides = (*KUBE, f"cluster.volume.mount_path={tmp_path / 'runs'}", "resources.nodes=2")
    assert "container=podman" not in overrides
    cmd = [sys.executable, "-m", "gpujobs.submit", f"hydra.run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)  # stdout is the YAML and nothing else
    assert manifest == js.jobset(compose_job(*overrides), run_dir)
    assert manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
        "image"] == IMAGE
    validate(manifest)
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_sweep_prints_one_jobset_a_point(tmp_path: Path) -> None:
    sweep_dir = tmp_path / "runs" / "sweep"
    cmd = [sys.executable, "-m", "gpujobs.submit", "-m", f"hydra.sweep.dir={sweep_dir}", *KUBE,
           f"cluster.volume.mount_path={tmp_path / 'runs'}", "resources.nodes=1,2"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    documents = [d for d in yaml.safe_load_all(proc.stdout[proc.stdout.index("apiVersion:"):])]
    assert [d["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] for d in documents] == [1, 2]
    assert len({d["metadata"]["name"] for d in documents}) == 2  # one JobSet a point's run dir
    for document in documents:
        validate(document)
    assert not sweep_dir.exists()


def test_names_follow_kubernetes_definitions() -> None:
    assert kube.DNS_LABEL.fullmatch("a" * 63) and not kube.DNS_LABEL.fullmatch("a" * 64)
    assert not kube.DNS_LABEL.fullmatch("a.b") and kube.DNS_SUBDOMAIN.fullmatch("a.b")
    assert not kube.DNS_SUBDOMAIN.fullmatch("a..b") and not kube.DNS_SUBDOMAIN.fullmatch(("a" * 63 + ".") * 4 + "a")
    assert kube.is_qualified_name("node.kubernetes.io/instance-type") and not kube.is_qualified_name("a/b/c")
    assert kube.LABEL_VALUE.fullmatch("") and not kube.LABEL_VALUE.fullmatch("-x")
    for resource in ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "amd.com/gpu"):
        assert kube.EXTENDED_RESOURCE.fullmatch(resource)
    for resource in ("gpu", "kubernetes.io/gpu", "foo.kubernetes.io/gpu", "Nvidia.com/gpu"):
        assert not kube.EXTENDED_RESOURCE.fullmatch(resource)
    for text in ("100Mi", "1", "0.5", "250m", "1e3", "1.5Gi", "+2k"):
        assert kube.QUANTITY.fullmatch(text)
    for text in ("1Mb", "abc", "1 Gi", "", "1.2.3"):
        assert not kube.QUANTITY.fullmatch(text)


def test_the_jobset_name_is_a_dns_label_that_leaves_room_for_pod_hostnames() -> None:
    job = compose_job(*KUBE, "name=1_Very_Long_Experiment_Name_With_Caps_And_Underscores_And_More")
    name = js.jobset_name(job, Path(MOUNT) / "x")
    assert kube.DNS_LABEL.fullmatch(name) and name[0].isalpha()
    assert len(f"{name}-{js.REPLICATED_JOB}-0-99999") <= 63
    assert name != js.jobset_name(job, Path(MOUNT) / "y")


def test_each_submission_of_a_run_dir_is_numbered_in_its_pods_environment(tmp_path: Path) -> None:
    """The pods of a resubmission know they are not the first JobSet of that name (`gpujobs.attempt.pod`)."""
    job = compose_job(*KUBE)
    run_dir = Path(MOUNT) / "runs" / "numbered"

    def number(where: Path) -> list[str]:
        spec = js.jobset(job, where)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        return [item["value"] for item in spec["containers"][0]["env"] if item["name"] == js.SUBMISSION_ENV]

    assert number(run_dir) == ["1"]
    here = tmp_path / "run"
    here.mkdir()
    record_submission(here, "ml/rec-0a1b2c3d", here / "submitit", cluster="kubernetes")
    record_cancel(here, "ml/rec-0a1b2c3d", cluster="kubernetes")  # a cancel is no submission
    assert number(here) == ["2"]


def test_a_run_dir_reached_through_a_symlink_is_the_same_jobset(tmp_path: Path) -> None:
    """One run dir, one JobSet name, whichever path to it the submit was given (its lease is the same)."""
    job = compose_job(*KUBE)
    (tmp_path / "runs" / "rec").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    assert js.jobset_name(job, tmp_path / "link" / "rec") == js.jobset_name(job, tmp_path / "runs" / "rec")
    assert js.jobset_name(job, tmp_path / "link" / "rec") != js.jobset_name(job, tmp_path / "runs" / "other")


def test_a_kubernetes_key_with_another_cluster_is_refused_not_ignored(tmp_path: Path) -> None:
    """Only conf/cluster/kubernetes.yaml sets the Kubernetes keys: on cluster=local `cluster.namespace` is an
    unknown key, one line, exit 2, nothing written."""
    run_dir = tmp_path / "run"
    proc = submit(run_dir, "+experiment=rec", "+debug=tiny", "cluster=local", "cluster.namespace=ml")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gpujobs: config error: cluster.namespace='ml' is invalid: allowed a key of cluster:"), line
    assert "namespace" not in line.split("allowed", 1)[1] and not run_dir.exists()
