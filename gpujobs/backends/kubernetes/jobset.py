"""Render, then send: the one JobSet (`jobset.x-k8s.io/v1alpha2`) of a `cluster=kubernetes` job (pure functions,
but for the run dir's metrics, read for how long a stop took there: `grace_period_s`).

One replicated job, `node`: an Indexed Job of `resources.nodes` pods (parallelism = completions), one pod a
node, each running the per-node launcher (`POD_COMMAND`), which starts one rank per GPU (or
`procs_per_node` CPU ranks) as the Slurm step does on a node. JobSet's headless service
(`network.enableDNSHostnames`) names the pods `<jobset>-node-0-<index>.<jobset>`, so pod 0 is the
rendezvous. What a dry run prints, and what `kubectl apply -f` takes, is `render_jobset`'s text.

The restart policy, as JobSet v0.12 and the Job controller express it (`failure_policy`, `pod_failure_policy`):
a pod evicted or preempted (its `DisruptionTarget` condition: a node drain, the kubelet's or the scheduler's
preemption) fails its Job through the pod failure policy's rule 0, and the JobSet restarts without counting it
against `maxRestarts` (`RestartJobSetAndIgnoreMaxRestarts`); a rank that exits 2 (bad input, a busy run dir)
fails its Job through rule 1, and the JobSet fails at once (`FailJobSet`); any other failure (`backoffLimit: 0`:
the first pod that fails) restarts the whole JobSet, counted against `maxRestarts` = `cluster.max_restarts`.
The Job controller's failure message names the rule's index ("... matching FailJob rule at index N",
`pkg/controller/job/pod_failure_policy.go`), which is how the JobSet's rules tell the two apart. A Kueue
preemption suspends the JobSet instead (its pods get SIGTERM and `terminationGracePeriodSeconds`): no failure.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

from gpujobs.backends.container_words import CONTAINER_PYTHON
from gpujobs.base.nvml import CUDA_ORDER_ENV
from gpujobs.config.kube_names import quantity
from gpujobs.config.load import JobConfig
from gpujobs.rundir.files import read_submissions
from gpujobs.rundir.records import CheckpointRecord, TrainRecord, read_metrics

API_VERSION = "jobset.x-k8s.io/v1alpha2"
#: The one replicated job, and the pods' one container (the pod failure policy names it).
REPLICATED_JOB = "node"
CONTAINER = "rank"
#: The per-node launcher each pod runs (`python3 -m POD_MODULE --folder RUN_DIR/FOLDER RUN_DIR`, the same
#: arguments as Slurm's `gpujobs.rank.srun`). The contract it keeps: node rank from JOB_COMPLETION_INDEX (the
#: Job controller sets it in every pod of an Indexed Job); NNODES_ENV nodes of RANKS_PER_NODE_ENV ranks; the
#: rendezvous at MASTER_ADDR:MASTER_PORT (pod 0's DNS name); SIGTERM taken as USR2 (the agreed checkpoint);
#: exit code 2 on refused input (`gpujobs.attempt.pod`).
POD_MODULE = "gpujobs.attempt.pod"
NNODES_ENV = "GPUJOBS_NNODES"
RANKS_PER_NODE_ENV = "GPUJOBS_RANKS_PER_NODE"
#: The JobSet's name (the job that holds the run dir's lease), and its restart attempt, which JobSet keeps in
#: every pod's annotation `RESTART_ANNOTATION` (0, then one more at each restart of the whole set).
JOBSET_ENV = "GPUJOBS_JOBSET"
RESTART_ENV = "GPUJOBS_RESTART_ATTEMPT"
#: Which submission of the run dir the JobSet is (1, 2, ...): a resubmitted JobSet has the old one's name and
#: restarts from 0 again, so the attempt's files (`hung.<attempt>`, heartbeats, submitit's) need this to differ.
SUBMISSION_ENV = "GPUJOBS_SUBMISSION"
RESTART_ANNOTATION = "jobset.sigs.k8s.io/restart-attempt"
MASTER_PORT = 29500
#: Exit code 2: refused input (a bad value, a busy run dir); retrying cannot help.
BAD_INPUT_EXIT = 2
#: The Job's failure reason when its pod failure policy fails it (batch/v1 `JobReasonPodFailurePolicy`).
POD_FAILURE_POLICY_REASON = "PodFailurePolicy"
#: The indices of the pod failure policy's two rules (`pod_failure_policy`), which its messages name.
_RULE_EVICTED, _RULE_BAD_INPUT = 0, 1
#: JobSet names the pods `<jobset>-<replicatedJob>-<job index>-<pod index>`: a hostname is a DNS-1123 label
#: (63 characters), so the JobSet's name leaves room for the rest.
_NAME_ROOM = 40
_NOT_NAME = re.compile(r"[^a-z0-9-]+")


def jobset_name(job: JobConfig, run_dir: Path) -> str:
    """The JobSet's name: the job's name as a DNS-1035 label, and 8 hex digits of the run dir's resolved path
    (two run dirs of one experiment are two JobSets; the same run dir, by any path, is always the same one)."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:8]
    base = _NOT_NAME.sub("-", job.name.lower()).strip("-")
    if not base[:1].isalpha():
        base = f"gpujobs-{base}".rstrip("-")
    return f"{base[:_NAME_ROOM - len(digest) - 1].rstrip('-')}-{digest}"


def pod_command(job: JobConfig, run_dir: Path) -> list[str]:
    """What each pod runs: the per-node launcher, told its run dir (`POD_MODULE`)."""
    folder = run_dir / job.cluster.folder
    return [CONTAINER_PYTHON, "-u", "-m", POD_MODULE, "--folder", str(folder), str(run_dir)]


def submission_number(run_dir: Path) -> int:
    """The number the run dir's next submission will have: one more than the submissions it recorded."""
    return 1 + sum(1 for submission in read_submissions(run_dir) if submission.submitted is not None)


def pod_env(job: JobConfig, name: str, submission: int) -> list[dict[str, Any]]:
    """The pods' environment: the JobSet and its submission number, the node count and ranks a node, the
    rendezvous, NCCL's settings; the restart attempt from the pod's annotation (the downward API)."""
    res = job.resources
    env = {
        JOBSET_ENV: name,
        SUBMISSION_ENV: str(submission),
        NNODES_ENV: str(res.nodes),
        RANKS_PER_NODE_ENV: str(res.ranks_per_node),
        "MASTER_ADDR": f"{name}-{REPLICATED_JOB}-0-0.{name}",
        "MASTER_PORT": str(MASTER_PORT),
        **job.nccl.to_env(),
        **CUDA_ORDER_ENV,
    }
    restart = {"name": RESTART_ENV,
               "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{RESTART_ANNOTATION}']"}}}
    return [*({"name": key, "value": value} for key, value in sorted(env.items())), restart]


def container_resources(job: JobConfig) -> dict[str, Any]:
    """Each pod's requests and limits: CPUs for all its ranks, memory (`resources.mem_gb`), GPUs (limits only:
    an extended resource's request is its limit)."""
    res, cluster = job.resources, job.cluster
    requests: dict[str, Any] = {"cpu": quantity("resources.cpus_per_task", str(res.cpus * res.ranks_per_node))}
    limits: dict[str, Any] = {}
    if res.mem_gb is not None:
        requests["memory"] = limits["memory"] = quantity("resources.mem_gb", f"{int(res.mem_gb * 1024)}Mi")
    if res.gpus_per_node:
        limits[cluster.gpu_resource] = res.gpus_per_node
    return {"requests": requests, **({"limits": limits} if limits else {})}


def grace_period_s(job: JobConfig, run_dir: Path) -> int:
    """`terminationGracePeriodSeconds`, the time from SIGTERM to SIGKILL: `cluster.signal_lead_s`, or more where
    the run dir's metrics (of its earlier attempts) measured that a stop takes longer. A stop waits for the
    ranks' next vote (`trainer.stop_check_every` steps, read a step later) of the median slowest-rank step,
    then saves a checkpoint (the longest synchronous save measured; an asynchronous one's blocking time says
    nothing of its write): 1.5 times that, plus 10 s to exit."""
    records = read_metrics(run_dir)
    saves = [r.blocking_s for r in records if isinstance(r, CheckpointRecord) and not r.background]
    steps = sorted(max(r.step_time_s) for r in records if isinstance(r, TrainRecord) and r.step_time_s)
    if not saves or not steps:
        return job.cluster.signal_lead_s
    stop_s = (job.trainer.stop_check_every + 1) * steps[len(steps) // 2] + max(saves)
    return max(job.cluster.signal_lead_s, math.ceil(1.5 * stop_s) + 10)


def pod_spec(job: JobConfig, run_dir: Path, name: str) -> dict[str, Any]:
    """The pod template's spec: one container, the run dir's volume, /dev/shm in memory, placement."""
    cluster, volume = job.cluster, job.cluster.volume
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": job.container.image,
        "command": pod_command(job, run_dir),
        "workingDir": job.container.workdir or str(run_dir),
        "env": pod_env(job, name, submission_number(run_dir)),
        "resources": container_resources(job),
        "volumeMounts": [{"name": "run-dir", "mountPath": volume.mount_path},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the Job's pod failure policy needs it; JobSet restarts the whole set
        "terminationGracePeriodSeconds": grace_period_s(job, run_dir),
        "securityContext": run_as_submitter(),
    }
    if cluster.priority_class is not None:
        spec["priorityClassName"] = cluster.priority_class
    if cluster.service_account is not None:
        spec["serviceAccountName"] = cluster.service_account
    if cluster.node_selector:
        spec["nodeSelector"] = dict(sorted(cluster.node_selector.items()))
    if cluster.tolerations:
        spec["tolerations"] = [dict(t) for t in cluster.tolerations]
    spec["containers"] = [container]
    spec["volumes"] = [{"name": "run-dir", "persistentVolumeClaim": {"claimName": volume.claim}},
                       {"name": "dshm", "emptyDir": {"medium": "Memory"}}]  # NCCL's and the data loaders' shm
    return spec


def run_as_submitter() -> dict[str, int]:
    """The pods' user and group: the submitting user's, who owns the run dir on the volume. An image's own user
    (often root) would own nothing there, and every gpujobs process refuses a run dir that is not its user's."""
    return {"runAsUser": os.geteuid(), "runAsGroup": os.getegid()}


def pod_failure_policy() -> dict[str, Any]:
    """The Job's pod failure policy: an evicted pod (rule 0) and exit code 2 (rule 1) each fail the Job, with a
    message naming the rule, for the JobSet's `failure_policy` to tell apart."""
    evicted = {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    bad_input = {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                      "values": [BAD_INPUT_EXIT]}}
    return {"rules": [evicted, bad_input]}  # in the order of _RULE_EVICTED, _RULE_BAD_INPUT


def failure_policy(job: JobConfig) -> dict[str, Any]:
    """The JobSet's failure policy: eviction restarts uncounted, exit code 2 fails, the rest counts."""
    def rule(name: str, action: str, index: int, what: str) -> dict[str, Any]:
        return {"name": name, "action": action, "onJobFailureReasons": [POD_FAILURE_POLICY_REASON],
                "onJobFailureMessagePatterns": [f"{what} matching FailJob rule at index {index}$"]}

    return {
        "maxRestarts": job.cluster.max_restarts,
        "rules": [
            rule("Evicted", "RestartJobSetAndIgnoreMaxRestarts", _RULE_EVICTED, "has condition DisruptionTarget"),
            rule("BadInput", "FailJobSet", _RULE_BAD_INPUT, f"failed with exit code {BAD_INPUT_EXIT}"),
        ],
    }


def jobset(job: JobConfig, run_dir: Path) -> dict[str, Any]:
    """The JobSet of `job` running in `run_dir`, as a mapping (keys in the order they are printed)."""
    name, nodes = jobset_name(job, run_dir), job.resources.nodes
    labels = {"kueue.x-k8s.io/queue-name": job.cluster.queue} if job.cluster.queue else {}
    metadata: dict[str, Any] = {"name": name, "namespace": job.cluster.namespace}
    if labels:
        metadata["labels"] = labels
    metadata["annotations"] = {"gpujobs/run-dir": str(run_dir)}
    job_spec = {
        "parallelism": nodes,
        "completions": nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,  # one failed pod fails the Job: the JobSet restarts every pod together
        "podFailurePolicy": pod_failure_policy(),
        "template": {"spec": pod_spec(job, run_dir, name)},
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "failurePolicy": failure_policy(job),
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job_spec}}],
        },
    }


def render_jobset(job: JobConfig, run_dir: Path) -> str:
    """The JobSet as YAML: what a dry run prints and `kubectl apply -f` takes."""
    return to_yaml(jobset(job, run_dir))


def to_yaml(body: dict[str, Any]) -> str:
    """A manifest as the YAML gpujobs prints and keeps (`jobset.yaml`)."""
    return yaml.safe_dump(body, sort_keys=False, default_flow_style=False, width=120)
