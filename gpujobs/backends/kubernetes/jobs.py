"""A JobSet once it is queued, through the API client (`api.py`): create it, read its state, follow it, delete it.

A JobSet is known by its id `NAMESPACE/NAME`, recorded in the run dir's submissions as a Slurm job's id is.
Its state is read from what the JobSet controller and Kueue write:
- `COMPLETED` or `FAILED`: its terminal state (or the `Completed`/`Failed` condition);
- `PENDING`: suspended (Kueue holds a JobSet suspended until its queue admits it, and suspends it again
  when it preempts it);
- `STOPPING`: being deleted (`gpujobs cancel`, a resubmission, or by hand). gpujobs deletes in the foreground,
  so the JobSet stays until its pods are gone: they get SIGTERM and their grace period to save the agreed
  checkpoint, and meanwhile the run dir's lease stays theirs;
- `RUNNING` otherwise.
A JobSet that was deleted has no state: the run dir's files speak for it.

The JobSet's name is the same for every submission of a run dir (`jobset.jobset_name`): its pods hold the run
dir's lease under it. So a resubmission first deletes the ended JobSet of that name, and waits until it is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpujobs.base.atomic import write_text_atomic
from gpujobs.base.errors import SchedulerError, SubmitError
from gpujobs.config.load import JobConfig
from gpujobs.rundir import lease
from gpujobs.rundir.files import record_submission

if TYPE_CHECKING:
    from gpujobs.backends.kubernetes.api import ClusterApi

#: The run dir's copy of the JobSet that was created (what a dry run prints), for `kubectl apply -f` by hand.
JOBSET_FILE = "jobset.yaml"
LEASE_HOLDER = "kubernetes"
FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED"})
FAILED = frozenset({"FAILED"})
CANCELLED = "CANCELLED"
STOPPING = "STOPPING"
#: Why `cancel` found no JobSet to delete (`already_ended` reads it).
GONE = "no such JobSet (it was deleted, or never created)"
#: How long a resubmission waits for the old JobSet of the same name to be gone, beyond its pods' grace period.
DELETE_WAIT_S = 60.0
#: terminationGracePeriodSeconds where a pod template does not say (Kubernetes' default).
DEFAULT_GRACE_S = 30
#: The longest pause between two reads of a followed JobSet's state (the first pauses are shorter).
FOLLOW_EVERY_S = 10.0


def job_id_of(namespace: str, name: str) -> str:
    """The id gpujobs records for JobSet `name` of `namespace`."""
    return f"{namespace}/{name}"


def split_id(job_id: str) -> tuple[str, str]:
    """(namespace, name) of a JobSet id."""
    namespace, _, name = job_id.partition("/")
    return namespace, name


def rank_log_path(folder: Path, name: str, rank: int, *, err: bool = False) -> Path:
    """Where global rank `rank` of JobSet `name` keeps its stdout (stderr: `err`) under the pods' `folder`
    (`--folder`): the name a Slurm job's logs have, with the JobSet's name for the job id. The pods write
    them (`gpujobs.attempt.rank_output`), `gpujobs logs` reads them."""
    return folder / f"{name}_{rank}_log.{'err' if err else 'out'}"


@contextlib.contextmanager
def connected() -> Iterator[ClusterApi]:
    """A connection to the kubeconfig's cluster, closed after use. SchedulerError where there can be none (no
    `kubernetes` package, no kubeconfig), KubernetesApiError where the kubeconfig cannot be used."""
    from gpujobs.backends.kubernetes.preflight import why_not_asked

    why = why_not_asked()
    if why is not None:
        raise SchedulerError(f"cannot ask the Kubernetes cluster about its JobSets: {why}")
    from gpujobs.backends.kubernetes.api import ClusterApi

    api = ClusterApi()
    try:
        yield api
    finally:
        api.close()


def state_of(jobset: dict[str, Any]) -> str:
    """A JobSet's state, in the words `gpujobs status` shows (see the module docstring)."""
    if (jobset.get("metadata") or {}).get("deletionTimestamp"):
        return STOPPING
    status = jobset.get("status") or {}
    true = {c.get("type") for c in status.get("conditions") or [] if c.get("status") == "True"}
    terminal = status.get("terminalState")
    if terminal == "Completed" or "Completed" in true:
        return "COMPLETED"
    if terminal == "Failed" or "Failed" in true:
        return "FAILED"
    if (jobset.get("spec") or {}).get("suspend") or "Suspended" in true:
        return "PENDING"
    return "RUNNING"


def submit_jobset(job: JobConfig, run_dir: Path) -> str:
    """Create the run dir's JobSet; keep its YAML as `jobset.yaml`; hand the lease to it; return its id.

    SubmitError, with nothing of the submission left in the run dir, when the API server refuses it.
    """
    from gpujobs.backends.kubernetes.jobset import jobset, to_yaml

    lease.check_free(run_dir, lease.here())
    body = jobset(job, run_dir.absolute())
    job_id = job_id_of(body["metadata"]["namespace"], body["metadata"]["name"])
    try:
        with connected() as api:
            _create(api, body, job_id)
    except SchedulerError as err:  # KubernetesApiError: the API server refused, or could not be reached
        raise SubmitError(str(err)) from None
    lease.replace(run_dir, dataclasses.replace(lease.here(job_id), holder=LEASE_HOLDER))
    (run_dir / job.cluster.folder).mkdir(parents=True, exist_ok=True)  # the pods' rank logs go there
    write_text_atomic(run_dir / JOBSET_FILE, to_yaml(body))
    record_submission(run_dir, job_id, run_dir / job.cluster.folder, cluster=LEASE_HOLDER)
    return job_id


def _create(api: ClusterApi, body: dict[str, Any], job_id: str) -> None:
    """Create `body`; where an ended JobSet of its name is still there (a resubmission), delete it first, and
    wait until it is gone: its pods' grace period, and `DELETE_WAIT_S` more."""
    namespace, name = split_id(job_id)
    old = api.jobset(namespace, name)
    if old is not None:
        state = state_of(old)
        if state not in FINAL | {STOPPING}:  # the run dir's lease would have said so, unless someone removed it
            raise SubmitError(f"JobSet {job_id} is {state}: it still runs this run dir (gpujobs cancel, then "
                              "resubmit)")
        if state != STOPPING:
            api.delete_jobset(namespace, name)
        wait_s = grace_period_of(old) + DELETE_WAIT_S
        deadline = time.monotonic() + wait_s
        while api.jobset(namespace, name) is not None:
            if time.monotonic() > deadline:
                raise SubmitError(f"JobSet {job_id} ({state}) was not gone {wait_s:.0f} s after its "
                                  "deletion: resubmit once `kubectl get jobset` no longer lists it")
            time.sleep(1.0)
    api.create_jobset(body)


def grace_period_of(jobset: dict[str, Any]) -> int:
    """The longest terminationGracePeriodSeconds of the JobSet's pod templates: how long its pods may take to
    stop once deleted."""
    graces = []
    for replicated in (jobset.get("spec") or {}).get("replicatedJobs") or []:
        pod = replicated
        for key in ("template", "spec", "template", "spec"):  # the Job template's pod template's spec
            pod = pod.get(key) or {}
        graces.append(int(pod.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)))
    return max(graces, default=DEFAULT_GRACE_S)


def states(job_ids: Sequence[str]) -> dict[str, str]:
    """The state of every JobSet of `job_ids` that exists, with one list call a namespace."""
    wanted: dict[str, set[str]] = {}
    for job_id in job_ids:
        namespace, name = split_id(job_id)
        wanted.setdefault(namespace, set()).add(name)
    found: dict[str, str] = {}
    if not wanted:
        return found
    with connected() as api:
        for namespace, names in sorted(wanted.items()):
            for item in api.jobsets(namespace):
                name = str((item.get("metadata") or {}).get("name"))
                if name in names:
                    found[job_id_of(namespace, name)] = state_of(item)
    return found


def cancel(job_ids: Sequence[str]) -> dict[str, str]:
    """Delete each JobSet (its pods get SIGTERM: the agreed checkpoint); the ids that could not be, and why."""
    from gpujobs.backends.kubernetes.api import KubernetesApiError

    failed: dict[str, str] = {}
    if not job_ids:
        return failed
    with connected() as api:
        for job_id in job_ids:
            try:
                if not api.delete_jobset(*split_id(job_id)):
                    failed[job_id] = GONE
            except KubernetesApiError as err:
                failed[job_id] = str(err)
    return failed


def liveness(job_id: str) -> tuple[bool, str]:
    """Whether JobSet `job_id`, which holds a run dir's lease, may still run: asked of the API server where it
    can be; where it cannot (a pod has no kubeconfig), the lease holds until someone who can look removes it."""
    from gpujobs.backends.kubernetes.api import KubernetesApiError
    from gpujobs.backends.kubernetes.preflight import why_not_asked

    why = why_not_asked()
    unknown = (f"cannot ask whether JobSet {job_id} still runs ({{}}): once `kubectl get jobset -n "
               f"{split_id(job_id)[0]} {split_id(job_id)[1]}` finds none, remove the run dir's lease.json")
    if why is not None:
        return True, unknown.format(why)
    try:
        with connected() as api:
            found = api.jobset(*split_id(job_id))
    except KubernetesApiError as err:
        return True, unknown.format(err)
    if found is None:
        return False, f"JobSet {job_id} no longer exists"
    state = state_of(found)
    return state not in FINAL, f"JobSet {job_id} is {state}"


def follow(job_id: str) -> int:
    """Say the JobSet's state each time it changes, until it ends; 0 only if it completed. The reads come
    after 1, 2, 4 ... seconds, then every `FOLLOW_EVERY_S`. An API server that cannot answer now (restarting,
    a network blip) is asked again; one that refuses this user (401, 403), or a kubeconfig gone, ends the
    follow with a line and 1 (the JobSet runs on: `gpujobs status` tells its end)."""
    from gpujobs.backends.kubernetes.api import KubernetesApiError

    said, pause = "", 1.0
    while True:
        try:
            state = states([job_id]).get(job_id, CANCELLED)  # gone: deleted, by `gpujobs cancel` or by hand
        except SchedulerError as err:
            if not isinstance(err, KubernetesApiError) or err.refused:
                print(f"gpujobs: JobSet {job_id}: cannot follow it: {err}", file=sys.stderr, flush=True)
                return 1
            state = f"unknown ({err})"
        if state != said:
            print(f"gpujobs: JobSet {job_id}: {state}", file=sys.stderr, flush=True)
            said = state
        if state in FINAL:
            return 0 if state == "COMPLETED" else 1
        time.sleep(pause)
        pause = min(pause * 2, FOLLOW_EVERY_S)
