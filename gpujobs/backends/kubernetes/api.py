"""The few calls gpujobs makes to the Kubernetes API, through the official `kubernetes` client: the preflight's
reads, and a JobSet's create, get, list and delete (submit, status, cancel, resubmit).

This is the one module that imports `kubernetes` (an import-linter contract says so): the optional extra
`pip install 'gpujobs[kubernetes]'`. It connects as kubectl does: the kubeconfig files of `KUBECONFIG`
(a path list), else `~/.kube/config`, and their current context, with the credentials the context names
(`kubernetes.config.new_client_from_config`). Objects come back as the API sends them (JSON, camelCase, as
`kubectl get -o json` shows them), not as the client's model classes: the Kueue objects have none, and the
fit logic (`fit.py`) reads them all alike.

Every failure, from a kubeconfig the client cannot read to a refusal (403) or an API server that cannot be
reached, is one `KubernetesApiError` whose message is one line; an object that does not exist (404) is None.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import urllib3
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from gpujobs.base.errors import SchedulerError

KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta1"
JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSETS = "jobsets"
#: Seconds to connect and to read one answer: a preflight that hangs on a dead API server helps no one.
TIMEOUT_S = (5.0, 20.0)
#: urllib3's retries of a failed connection: none (its default, 3 without a pause, repeats a refusal and logs a
#: warning line each time; the user reruns the submit instead).
CONNECT_RETRIES = 0

Object = dict[str, Any]


class KubernetesApiError(SchedulerError):
    """The Kubernetes API could not answer: the kubeconfig, the connection, or the API's refusal (one line).
    `refused`: the API server refused this user (401, 403), which asking again will not change."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def kubeconfig_files() -> list[Path]:
    """The kubeconfig files kubectl would read: those of `KUBECONFIG` that exist (it is a path list), else
    `~/.kube/config` if it exists; empty when there is none (the cluster cannot be asked)."""
    listed = os.environ.get("KUBECONFIG", "")
    if listed:
        return [Path(p) for p in listed.split(os.pathsep) if p and Path(p).is_file()]
    default = Path("~/.kube/config").expanduser()
    return [default] if default.is_file() else []


def one_line(text: str) -> str:
    """`text` on one line, without urllib3's object reprs (`<HTTPConnection object at 0x..>: `)."""
    return " ".join(re.sub(r"<[^>]*>: ", "", text).split())


def status_message(err: ApiException) -> str:
    """`HTTP 403 Forbidden: <the Status' message>` for an error answer (the API's `Status` object says why)."""
    try:
        message = json.loads(err.body or "{}").get("message", "")
    except (ValueError, AttributeError):  # not a Status: a proxy's HTML page, say
        message = ""
    return one_line(f"HTTP {err.status} {err.reason or ''}" + (f": {message}" if message else ""))


class ClusterApi:
    """A connection to the API server of the kubeconfig's current context, and the calls gpujobs makes."""

    def __init__(self) -> None:
        configuration = client.Configuration()
        configuration.retries = CONNECT_RETRIES
        try:
            self._client = config.new_client_from_config(client_configuration=configuration, persist_config=False)
        except (ConfigException, OSError, ValueError, yaml.YAMLError) as err:
            files = os.pathsep.join(str(p) for p in kubeconfig_files())
            raise KubernetesApiError(one_line(f"cannot use the kubeconfig {files}: {err}")) from None
        self.host: str = configuration.host
        self._core = client.CoreV1Api(self._client)
        self._custom = client.CustomObjectsApi(self._client)

    def close(self) -> None:
        """Close the connections (the client's thread pool too)."""
        self._client.close()

    def namespace(self, name: str) -> Optional[Object]:
        """The Namespace `name`, None if there is none (RBAC: get namespaces)."""
        return self._get(f"namespace {name}", "get namespaces", self._core.read_namespace, name)

    def local_queue(self, namespace: str, name: str) -> Optional[Object]:
        """The Kueue LocalQueue `namespace/name`, None if there is none (RBAC: get localqueues)."""
        return self._get(f"LocalQueue {namespace}/{name}", f"get localqueues.{KUEUE_GROUP}",
                         self._custom.get_namespaced_custom_object,
                         KUEUE_GROUP, KUEUE_VERSION, namespace, "localqueues", name)

    def cluster_queue(self, name: str) -> Optional[Object]:
        """The Kueue ClusterQueue `name` (cluster-scoped), None if there is none (RBAC: get clusterqueues)."""
        return self._get(f"ClusterQueue {name}", f"get clusterqueues.{KUEUE_GROUP}",
                         self._custom.get_cluster_custom_object,
                         KUEUE_GROUP, KUEUE_VERSION, "clusterqueues", name)

    def nodes(self, labels: dict[str, str]) -> list[Object]:
        """The Nodes that have every label of `labels` (all nodes when empty; RBAC: list nodes)."""
        selector = ",".join(f"{key}={value}" for key, value in labels.items())
        answer = self._get("the nodes", "list nodes", self._core.list_node, label_selector=selector)
        return list((answer or {}).get("items") or [])

    def create_jobset(self, body: Object) -> Object:
        """Create the JobSet `body` (in its metadata's namespace); the object the API server stored (RBAC:
        create jobsets). One that exists already (409) is refused as every other failure is."""
        namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
        created = self._call(f"JobSet {namespace}/{name}", f"create {JOBSETS}.{JOBSET_GROUP}", "create",
                             self._custom.create_namespaced_custom_object,
                             JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, body, absent_is_none=False)
        assert created is not None  # absent_is_none=False: a 404 raised
        return created

    def jobset(self, namespace: str, name: str) -> Optional[Object]:
        """The JobSet `namespace/name`, None if there is none (RBAC: get jobsets)."""
        return self._get(f"JobSet {namespace}/{name}", f"get {JOBSETS}.{JOBSET_GROUP}",
                         self._custom.get_namespaced_custom_object,
                         JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name)

    def jobsets(self, namespace: str) -> list[Object]:
        """Every JobSet of `namespace`, in one call (RBAC: list jobsets)."""
        answer = self._get(f"the JobSets of namespace {namespace}", f"list {JOBSETS}.{JOBSET_GROUP}",
                           self._custom.list_namespaced_custom_object,
                           JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS)
        return list((answer or {}).get("items") or [])

    def delete_jobset(self, namespace: str, name: str) -> bool:
        """Delete the JobSet `namespace/name` with its Jobs and pods; False if there was none (RBAC: delete
        jobsets). Foreground: the JobSet stays, with a `deletionTimestamp`, until its pods are gone (they get
        SIGTERM and their grace period to save), so that while any pod may still write to the run dir the
        JobSet is there to say so; a background deletion would remove it at once."""
        answer = self._call(f"JobSet {namespace}/{name}", f"delete {JOBSETS}.{JOBSET_GROUP}", "delete",
                            self._custom.delete_namespaced_custom_object,
                            JOBSET_GROUP, JOBSET_VERSION, namespace, JOBSETS, name,
                            propagation_policy="Foreground")
        return answer is not None

    def _get(self, what: str, rbac: str, read: Callable[..., Any], *args: Any, **kwargs: Any) -> Optional[Object]:
        """`read(*args, **kwargs)`'s object as JSON; None for a 404 (see `_call`)."""
        return self._call(what, rbac, "get", read, *args, **kwargs)

    def _call(self, what: str, rbac: str, verb: str, call: Callable[..., Any], *args: Any,
              absent_is_none: bool = True, **kwargs: Any) -> Optional[Object]:
        """`call(*args, **kwargs)`'s answer as JSON; None for a 404 (`absent_is_none`); KubernetesApiError for
        any other failure (naming `rbac`, the permission the call needs, when the API refused the user)."""
        try:
            answer = call(*args, _preload_content=False, _request_timeout=TIMEOUT_S, **kwargs)
            body: Object = json.loads(answer.data)
        except ApiException as err:
            if err.status == 404 and absent_is_none:
                return None
            refused = err.status in (401, 403)
            needs = f" (it needs RBAC {rbac}: docs/guides/kubernetes.md)" if refused else ""
            raise KubernetesApiError(f"{self.host} could not {verb} {what}: {status_message(err)}{needs}",
                                     refused=refused) from None
        except (urllib3.exceptions.HTTPError, OSError) as err:
            reason = getattr(err, "reason", None) or err
            raise KubernetesApiError(one_line(f"cannot reach the Kubernetes API at {self.host} to {verb} {what}: "
                                              f"{reason}")) from None
        except ValueError as err:  # a 200 whose body is no JSON: no API server answered
            raise KubernetesApiError(one_line(f"{self.host} answered no JSON object for {what}: {err}")) from None
        return body
