"""A stand-in for a Kubernetes API server, for the tests of `cluster=kubernetes` that talk to one.

No Kubernetes API server can run on these machines, so the cluster here is a real HTTP server on loopback
that answers the paths the official `kubernetes` client calls (`gpujobs/backends/kubernetes/api.py`) with
bodies shaped as the API documents them:
- GET of a Namespace, a Kueue LocalQueue and ClusterQueue (`v1beta1`), a NodeList (filtered by
  `labelSelector` as the API server does);
- a JobSet's create (POST, validated against the pinned JobSet CRD's `openAPIV3Schema` as the API server
  validates a custom object: 422 if it does not hold, 409 if the name is taken, 404 without the namespace),
  get, list and delete: a background deletion removes the object at once (its pods are deleted later, by
  the garbage collector), a foreground one (`propagationPolicy=Foreground`) marks it with a
  `deletionTimestamp` and the `foregroundDeletion` finalizer, and it is gone only after `deletion_reads`
  more reads of it (while its pods stop);
- a `Status` with the HTTP code for what is absent (404) or refused (403, 500, on any path the test names).
The queues it serves are validated against the Kueue v0.19.2 CRDs (tests/data/k8s/), the Namespace and Nodes
against Kubernetes' own schemas (`kubernetes-validate`), so the fakes have the documented shape. The client
reaches it through a kubeconfig with a bearer token (the server refuses a request without it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional
from urllib.parse import parse_qs, urlsplit

import jsonschema
import kubernetes_validate
import yaml

K8S = Path(__file__).parent / "data" / "k8s"
K8S_VERSION = "1.37.0"  # the newest schemas kubernetes-validate 1.37.0 ships
TOKEN = "gpujobs-test-token"
KUEUE = "/apis/kueue.x-k8s.io/v1beta1"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{}/jobsets"


def crd_schema(name: str) -> dict[str, Any]:
    """The v1beta1 `openAPIV3Schema` of a Kueue CRD in tests/data/k8s/."""
    crd = yaml.safe_load((K8S / f"kueue-v0.19.2.{name}.crd.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1beta1"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


def jobset_schema() -> dict[str, Any]:
    """The JobSet v0.12.0 CRD's `openAPIV3Schema` of v1alpha2 (tests/data/k8s/)."""
    crd = yaml.safe_load((K8S / "jobset-v0.12.0.jobsets.crd.yaml").read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema: dict[str, Any] = version["schema"]["openAPIV3Schema"]
    return schema


SCHEMAS = {"LocalQueue": crd_schema("localqueues"), "ClusterQueue": crd_schema("clusterqueues"),
           "JobSet": jobset_schema()}


def namespace(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {
        "kubernetes.io/metadata.name": name}}, "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}


def local_queue(name: str, cluster_queue: str) -> dict[str, Any]:
    return {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "LocalQueue",
            "metadata": {"name": name, "namespace": "ml"}, "spec": {"clusterQueue": cluster_queue}}


def cluster_queue(gpus: Any, *, cohort: Optional[str] = None, borrowing: Any = None) -> dict[str, Any]:
    """ClusterQueue team-cq: flavor a100 with `gpus` nominal GPUs (and `borrowing`, in `cohort`), beside a
    flavor with none (that may borrow none: without a limit, it could borrow the cohort's)."""
    gpu: dict[str, Any] = {"name": "nvidia.com/gpu", "nominalQuota": gpus}
    if borrowing is not None:
        gpu["borrowingLimit"] = borrowing
    flavors = [{"name": "a100", "resources": [{"name": "cpu", "nominalQuota": 256},
                                              {"name": "memory", "nominalQuota": "2Ti"}, gpu]},
               {"name": "cpu-only", "resources": [{"name": "cpu", "nominalQuota": "64"},
                                                  {"name": "memory", "nominalQuota": "256Gi"},
                                                  {"name": "nvidia.com/gpu", "nominalQuota": 0,
                                                   **({"borrowingLimit": 0} if cohort else {})}]}]
    spec: dict[str, Any] = {"namespaceSelector": {}, "resourceGroups": [
        {"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": flavors}]}
    if cohort:
        spec["cohort"] = cohort
    return {"apiVersion": "kueue.x-k8s.io/v1beta1", "kind": "ClusterQueue", "metadata": {"name": "team-cq"},
            "spec": spec}


def node(name: str, gpus: str, product: str) -> dict[str, Any]:
    resources = {"cpu": "96", "memory": "1056Gi", "nvidia.com/gpu": gpus, "pods": "110"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.product": product}},
            "status": {"allocatable": resources, "capacity": resources}}


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    """The API's error body (a meta/v1 Status)."""
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeCluster:
    """What the loopback API server holds: objects by path, nodes, JobSets by namespace and name, failures
    to answer by (method and) path, and every request as `METHOD target` (GETs as the target alone)."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {
            "/api/v1/namespaces/ml": namespace("ml"),
            f"{KUEUE}/namespaces/ml/localqueues/team-a": local_queue("team-a", "team-cq"),
            f"{KUEUE}/namespaces/ml/localqueues/orphan": local_queue("orphan", "gone-cq"),
            f"{KUEUE}/clusterqueues/team-cq": cluster_queue(8),
        }
        self.nodes = [node("gpu-1", "8", "A100"), node("gpu-2", "8", "A100"), node("small-1", "2", "T4")]
        self.jobsets: dict[tuple[str, str], dict[str, Any]] = {}
        self.deleting: dict[tuple[str, str], int] = {}
        """JobSets being deleted: reads of them left before they are gone."""
        self.deletion_reads = 0
        self.failures: dict[str, tuple[int, str]] = {}
        self.requests: list[str] = []
        self.lock = threading.Lock()

    def answer(self, method: str, target: str, authorization: Optional[str],
               body: Optional[dict[str, Any]] = None) -> tuple[int, dict[str, Any]]:
        """The HTTP code and JSON body the API server would send for `method target` (with `body`)."""
        with self.lock:
            self.requests.append(target if method == "GET" else f"{method} {target}")
            url = urlsplit(target)
            if authorization != f"Bearer {TOKEN}":
                return 401, status(401, "Unauthorized", "Unauthorized")
            failure = self.failures.get(f"{method} {url.path}") or (self.failures.get(url.path) if method == "GET"
                                                                      else None)
            if failure is not None:
                code, reason = failure
                return code, status(code, reason, f"{reason.lower()} for {url.path}: as the test asked")
            parts = url.path.strip("/").split("/")
            if url.path.startswith("/apis/jobset.x-k8s.io/") and len(parts) in (6, 7):
                policy = parse_qs(url.query).get("propagationPolicy", ["Background"])[0]
                return self.jobset_answer(method, parts[4], parts[6] if len(parts) == 7 else None, body, policy)
            if method != "GET":
                return 405, status(405, "MethodNotAllowed", f"{method} is not allowed on {url.path}")
            if url.path == "/api/v1/nodes":
                return 200, self.node_list(parse_qs(url.query).get("labelSelector", [""])[0])
            if url.path in self.objects:
                return 200, self.objects[url.path]
            kind, name = url.path.rsplit("/", 2)[-2:]
            return 404, status(404, "NotFound", f'{kind} "{name}" not found')

    def jobset_answer(self, method: str, ns: str, name: Optional[str], body: Optional[dict[str, Any]],
                      policy: str = "Background") -> tuple[int, dict[str, Any]]:
        """What the API server answers on the JobSets of namespace `ns` (one named `name`, or all); `policy`:
        a deletion's propagationPolicy."""
        if f"/api/v1/namespaces/{ns}" not in self.objects:
            return 404, status(404, "NotFound", f'namespaces "{ns}" not found')
        if name is None and method == "GET":
            items = [copy.deepcopy(o) for (n, _), o in sorted(self.jobsets.items()) if n == ns]
            for key in [key for key in self.deleting if key[0] == ns]:  # a list reads each of them
                self.settle(key)
            return 200, {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSetList",
                         "metadata": {"resourceVersion": "7"}, "items": items}
        if name is None and method == "POST":
            return self.create(ns, body or {})
        key = (ns, name or "")
        if key not in self.jobsets:
            return 404, status(404, "NotFound", f'jobsets.jobset.x-k8s.io "{name}" not found')
        if method == "DELETE":
            if policy != "Foreground":
                return 200, copy.deepcopy(self.jobsets.pop(key))
            self.deleting.setdefault(key, self.deletion_reads)
            self.jobsets[key]["metadata"].update(deletionTimestamp="2026-12-04T10:00:00Z",
                                                 finalizers=["foregroundDeletion"])
            answer = copy.deepcopy(self.jobsets[key])
            self.settle(key)
            return 200, answer
        answer = copy.deepcopy(self.jobsets[key])
        self.settle(key)
        return 200, answer

    def settle(self, key: tuple[str, str]) -> None:
        """A JobSet being deleted is gone once its reads run out."""
        if key in self.deleting:
            self.deleting[key] -= 1
            if self.deleting[key] < 0:
                del self.deleting[key], self.jobsets[key]

    def create(self, ns: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST of a JobSet: refused as the API server refuses it, else stored with what the server adds."""
        name = str(body.get("metadata", {}).get("name"))
        try:
            jsonschema.validate(body, SCHEMAS["JobSet"], cls=jsonschema.Draft7Validator)
        except jsonschema.ValidationError as err:
            return 422, status(422, "Invalid", f'JobSet.jobset.x-k8s.io "{name}" is invalid: {err.message}')
        if body.get("metadata", {}).get("namespace") not in (None, ns):
            return 400, status(400, "BadRequest", "the namespace of the object does not match the request")
        if (ns, name) in self.jobsets:
            return 409, status(409, "AlreadyExists", f'jobsets.jobset.x-k8s.io "{name}" already exists')
        stored = copy.deepcopy(body)
        stored["metadata"].update(namespace=ns, uid=f"uid-{len(self.requests)}", generation=1,
                                  creationTimestamp="2026-12-04T10:00:00Z")
        stored["status"] = {}
        self.jobsets[(ns, name)] = stored
        return 201, copy.deepcopy(stored)

    def set_status(self, ns: str, name: str, *, terminal: Optional[str] = None, suspend: bool = False,
                   restarts: int = 0) -> None:
        """What the JobSet controller and Kueue would write: `terminal` (Completed, Failed), `suspend`."""
        with self.lock:
            jobset = self.jobsets[(ns, name)]
            jobset["spec"]["suspend"] = suspend
            conditions = [{"type": terminal, "status": "True", "reason": f"AllJobs{terminal}", "message": "",
                           "lastTransitionTime": "2026-12-04T10:05:00Z"}] if terminal else []
            jobset["status"] = {"restarts": restarts, "conditions": conditions,
                                **({"terminalState": terminal} if terminal else {})}

    def node_list(self, selector: str) -> dict[str, Any]:
        """The NodeList of the nodes with every `key=value` label of `selector` (equality selectors only)."""
        wanted = dict(term.split("=", 1) for term in selector.split(",") if term)
        items = [n for n in self.nodes if all(n["metadata"]["labels"].get(k) == v for k, v in wanted.items())]
        return {"apiVersion": "v1", "kind": "NodeList", "metadata": {"resourceVersion": "42"}, "items": items}

    def validate(self) -> None:
        """Every object served has its kind's documented shape."""
        for obj in [*self.objects.values(), *self.nodes]:
            if obj["kind"] in SCHEMAS:
                jsonschema.validate(obj, SCHEMAS[obj["kind"]], cls=jsonschema.Draft7Validator)
            else:
                kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def serve(cluster: FakeCluster) -> ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 (a free port) answering from `cluster`, serving in a thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.reply("GET")

        def do_POST(self) -> None:
            self.reply("POST")

        def do_DELETE(self) -> None:
            self.reply("DELETE")

        def reply(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            sent = json.loads(self.rfile.read(length)) if length else None
            code, body = cluster.answer(method, self.path, self.headers.get("Authorization"), sent)
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # the requests are counted in cluster.requests

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig whose current context is `server` with the test's bearer token."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "loopback", "cluster": {"server": server}}],
        "users": [{"name": "alice", "user": {"token": TOKEN}}],
        "contexts": [{"name": "test", "context": {"cluster": "loopback", "user": "alice"}}]}))
    return path




@contextlib.contextmanager
def running(config: Path) -> Iterator[FakeCluster]:
    """A fake cluster served on loopback, with a kubeconfig for it written at `config`."""
    fake = FakeCluster()
    server = serve(fake)
    kubeconfig(config, f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()
