"""The emulated control plane: API semantics over the store, the scheduler loop, events.

What a real API server does between the HTTP layer and etcd (defaulting, validation with
the same 422/409/404 answers, graceful pod deletion, label-selected collection deletes),
plus the scheduler and event recording.  No HTTP here (``server.py``) and no processes
(``kubelet.py``): everything runs on the event loop thread, so nothing needs a lock.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import datetime
import ipaddress
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kube_emulator import admission, scheduler
from kube_emulator.dns import DnsServer
from kube_emulator.faults import Faults
from kube_emulator.kubelet import Kubelet
from kube_emulator.selectors import FieldSelector, LabelSelector
from kube_emulator.store import Obj, Store, random_suffix

log = logging.getLogger(__name__)

PENDING_TAINT = {"key": "emulator.pytest-sky/fault", "value": "pending", "effect": "NoSchedule"}
GPU_TAINT = {"key": scheduler.GPU, "value": "present", "effect": "NoSchedule"}
KUBERNETES_VERSION = "v1.31.0"

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*"
_DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_LABEL_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"


@dataclass(frozen=True)
class ResourceInfo:
    """Static facts of a served resource (discovery and error messages use them)."""

    name: str
    kind: str
    namespaced: bool
    verbs: tuple[str, ...]
    short_names: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()


_RW = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
RESOURCES: dict[str, ResourceInfo] = {
    "pods": ResourceInfo(
        "pods",
        "Pod",
        True,
        _RW,
        ("po",),
        (
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ),
    ),
    "secrets": ResourceInfo("secrets", "Secret", True, _RW, (), ("type",)),
    "services": ResourceInfo("services", "Service", True, _RW, ("svc",)),
    "limitranges": ResourceInfo("limitranges", "LimitRange", True, _RW, ("limits",)),
    "resourcequotas": ResourceInfo("resourcequotas", "ResourceQuota", True, _RW, ("quota",)),
    "persistentvolumeclaims": ResourceInfo("persistentvolumeclaims", "PersistentVolumeClaim", True, _RW, ("pvc",)),
    "events": ResourceInfo(
        "events",
        "Event",
        True,
        _RW,
        ("ev",),
        (
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ),
    ),
    "nodes": ResourceInfo("nodes", "Node", False, ("get", "list", "watch"), ("no",), ("spec.unschedulable",)),
    "namespaces": ResourceInfo(
        "namespaces", "Namespace", False, ("create", "delete", "get", "list", "watch"), ("ns",), ("status.phase",)
    ),
}


def field_allowed(resource: str) -> Any:
    info = RESOURCES[resource]
    return lambda path: path in ("metadata.name", "metadata.namespace") or path in info.fields


class ApiError(Exception):
    """An API answer other than success, with the Status body a real server sends."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details:
            body["details"] = self.details
        return body


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})


def invalid(kind: str, name: str, errors: list[tuple[str, str]]) -> ApiError:
    """422 Invalid: ``errors`` are (field, message) as the API server's field errors."""
    texts = [f"{f}: {m}" for f, m in errors]
    joined = texts[0] if len(texts) == 1 else "[" + ", ".join(texts) + "]"
    return ApiError(
        422,
        "Invalid",
        f'{kind} "{name}" is invalid: {joined}',
        {
            "name": name,
            "kind": kind,
            "causes": [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in errors],
        },
    )


def _dns_errors(value: str, path: str, kind: str) -> list[tuple[str, str]]:
    if kind == "subdomain":
        ok = len(value) <= 253 and re.fullmatch(_DNS1123_SUBDOMAIN, value)
        text = (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
            f"validation is '{_DNS1123_SUBDOMAIN}')"
        )
    elif kind == "label":
        ok = len(value) <= 63 and re.fullmatch(_DNS1123_LABEL, value)
        text = (
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
            f"start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
            f"validation is '{_DNS1123_LABEL}')"
        )
    else:
        ok = len(value) <= 63 and re.fullmatch(_DNS1035_LABEL, value)
        text = (
            "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
            "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', "
            f"regex used for validation is '{_DNS1035_LABEL}')"
        )
    return [] if ok else [(path, f'Invalid value: "{value}": {text}')]


def _label_errors(labels: Any, path: str) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    if labels is None:
        return errors
    if not isinstance(labels, dict):
        return [(path, "Invalid value: must be a map of strings")]
    for key, value in labels.items():
        prefix, _, name = key.rpartition("/")
        if (
            (prefix and not re.fullmatch(_DNS1123_SUBDOMAIN, prefix))
            or len(name) > 63
            or not re.fullmatch(_LABEL_NAME, name)
        ):
            errors.append(
                (
                    path,
                    f'Invalid value: "{key}": name part must consist of alphanumeric characters, '
                    "'-', '_' or '.', and must start and end with an alphanumeric character",
                )
            )
        if not isinstance(value, str) or len(value) > 63 or (value and not re.fullmatch(_LABEL_NAME, value)):
            errors.append(
                (
                    f"{path}",
                    f'Invalid value: "{value}": a valid label must be an empty string or '
                    "consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
                    "an alphanumeric character",
                )
            )
    return errors


@dataclass
class ClusterConfig:
    """The emulated cluster's shape (CLI flags and :class:`Emulator` keywords)."""

    nodes: int = 3
    gpus_per_node: int = 0
    #: Small nodes, as kind on a laptop or a small node pool: CI's smoke suite (3-node clusters,
    #: two at a time under ``-n 2``) fits at the backend's default requests, and no more.
    cpus_per_node: str = "4"
    memory_per_node: str = "8Gi"
    gpu_taint: bool = False
    mtu: int = 65535
    #: What ``/version`` and the nodes report, and which RBAC rules of streams apply (rbac.py).
    kube_version: str = KUBERNETES_VERSION
    #: The GPU product label value of GPU nodes (GPU feature discovery's ``nvidia.com/gpu.product``,
    #: e.g. ``NVIDIA-A100-SXM4-80GB`` or ``Tesla-T4``); None: no product label.
    gpu_product: str | None = None
    #: The ``default`` namespace enforces policies as a real cluster's often does: Pod Security
    #: "baseline", a LimitRange that defaults limits, and a ResourceQuota on requests and limits
    #: (:meth:`Cluster.default_policies`).
    policies: bool = True
    #: ReadWriteMany claims in the ``default`` namespace, as an administrator provisions one
    #: for a team's shared directories (``--kube-shared-pvc``).
    shared_claims: tuple[str, ...] = ()


class Cluster:
    """API semantics, the scheduler loop and the kubelet of one emulated cluster."""

    def __init__(self, config: ClusterConfig, faults: Faults, instance_dir: Path) -> None:
        self.config = config
        self.faults = faults
        self.store = Store()
        self.kubelet = Kubelet(self, instance_dir, mtu=config.mtu)
        self.dns = DnsServer(self.store)
        self.instance_dir = instance_dir
        self._queue: dict[tuple[str, str], str] = {}  # unscheduled pods, in creation order
        self._events: dict[tuple[str, str, str, str], tuple[str, str]] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._service_ips = 10
        self._last_event_ns = 0
        self.portforwards: set[Any] = set()  # open port-forward sessions (drop on demand)

    # -- life -------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.kubelet.start)
        await self.dns.start(self.kubelet.host_ip)  # on the bridge: the pods' nameserver
        for ns in ("default", "kube-system", "kube-public", "kube-node-lease"):
            self._create_namespace({"metadata": {"name": ns}})
        if self.config.policies:
            self.default_policies()
        for claim in self.config.shared_claims:
            spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}
            self.create("persistentvolumeclaims", "default", {"metadata": {"name": claim}, "spec": spec})
        for i in range(self.config.nodes):
            self.store.create("nodes", self._node(i))
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._scheduler_loop(), name="scheduler")

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.store.close_watches()
        await self.dns.stop()
        await self.kubelet.shutdown()

    def default_policies(self) -> None:
        """What an administrator commonly sets on a shared namespace, sized so that the smoke
        suite passes: Pod Security "baseline" enforced; a LimitRange that fills in limits of
        one node's size (and small requests for containers that state none); a ResourceQuota
        on requests (the nodes' total) and limits (ten times that), so a pod must state both,
        which the LimitRange's defaults see to."""

        def label(ns: Obj) -> None:
            ns["metadata"]["labels"][admission.ENFORCE_LABEL] = "baseline"

        self.store.modify("namespaces", "", "default", label)
        cpu, memory = self.config.cpus_per_node, self.config.memory_per_node
        total_cpu = scheduler.parse_quantity(cpu) * self.config.nodes
        total_memory = scheduler.parse_quantity(memory) * self.config.nodes
        limits = {
            "type": "Container",
            "default": {"cpu": cpu, "memory": memory},
            "defaultRequest": {"cpu": "100m", "memory": "128Mi"},
        }
        self.create("limitranges", "default", {"metadata": {"name": "defaults"}, "spec": {"limits": [limits]}})
        hard = {
            "pods": str(110 * self.config.nodes),
            "requests.cpu": admission.format_quantity(total_cpu, False),
            "requests.memory": admission.format_quantity(total_memory, True),
            "limits.cpu": admission.format_quantity(total_cpu * 10, False),
            "limits.memory": admission.format_quantity(total_memory * 10, True),
        }
        self.create("resourcequotas", "default", {"metadata": {"name": "compute"}, "spec": {"hard": hard}})

    @staticmethod
    def now() -> str:
        return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _node(self, i: int) -> Obj:
        name = f"emu-node-{i}"
        capacity = {
            "cpu": self.config.cpus_per_node,
            "memory": self.config.memory_per_node,
            "pods": "110",
            "ephemeral-storage": "100Gi",
        }
        labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "node.kubernetes.io/instance-type": "emulated",
        }
        taints = []
        if self.config.gpus_per_node > 0:
            capacity[scheduler.GPU] = str(self.config.gpus_per_node)
            labels["nvidia.com/gpu.present"] = "true"
            labels["nvidia.com/gpu.count"] = str(self.config.gpus_per_node)
        if self.config.gpu_product:
            labels["nvidia.com/gpu.product"] = self.config.gpu_product
            if self.config.gpu_taint:
                taints.append(dict(GPU_TAINT))
        return {
            "metadata": {"name": name, "labels": labels, "annotations": {}},
            "spec": {
                "podCIDR": self.kubelet.subnet,
                "podCIDRs": [self.kubelet.subnet],
                **({"taints": taints} if taints else {}),
            },
            "status": self._node_status(name, capacity),
        }

    def _node_status(self, name: str, capacity: dict[str, str]) -> Obj:
        """A Ready node's status, as its kubelet posts it."""
        now = self.now()
        return {
            "capacity": capacity,
            "allocatable": dict(capacity),
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "addresses": [
                {"type": "InternalIP", "address": self.kubelet.host_ip},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": "",
                "containerRuntimeVersion": "pytest-sky-emulator://0.1",
                "kernelVersion": _kernel(),
                "kubeProxyVersion": self.config.kube_version,
                "kubeletVersion": self.config.kube_version,
                "machineID": "",
                "operatingSystem": "linux",
                "osImage": "pytest-sky kube emulator",
                "systemUUID": "",
            },
        }

    # -- generic API operations -------------------------------------------------------------

    def namespace_active(self, namespace: str) -> None:
        ns = self.store.get("namespaces", "", namespace)
        if ns is None:
            raise not_found("namespaces", namespace)
        if ns.get("status", {}).get("phase") == "Terminating":
            raise ApiError(
                403,
                "Forbidden",
                f"unable to create new content in namespace {namespace} because it is being terminated",
                {"name": namespace, "kind": "namespaces"},
            )

    def get(self, resource: str, namespace: str, name: str) -> Obj:
        obj = self.store.get(resource, namespace, name)
        if obj is None:
            raise not_found(resource, name)
        return obj

    def list(self, resource: str, namespace: str | None, labels: LabelSelector, fields: FieldSelector) -> list[Obj]:
        return [
            o
            for o in self.store.items(resource, namespace)
            if labels.matches(o["metadata"].get("labels")) and fields.matches(o)
        ]

    def create(self, resource: str, namespace: str, body: Any) -> Obj:
        info = RESOURCES[resource]
        if not isinstance(body, dict):
            raise ApiError(
                400,
                "BadRequest",
                "the body of the request was in an unknown format - accepted media types include: "
                "application/json, application/yaml",
            )
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {}) or {}
        obj["metadata"] = meta
        if info.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + random_suffix()
        if not meta.get("name"):
            raise invalid(info.kind, "", [("metadata.name", "Required value: name or generateName is required")])
        for key in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp"):
            meta.pop(key, None)
        if resource != "events":
            obj.pop("status", None)
        obj["kind"], obj["apiVersion"] = info.kind, "v1"
        if resource == "namespaces":
            errors = _dns_errors(meta["name"], "metadata.name", "label")
            errors += _label_errors(meta.get("labels"), "metadata.labels")
            if errors:
                raise invalid(info.kind, meta["name"], errors)
            if self.store.get("namespaces", "", meta["name"]):
                raise _exists("namespaces", meta["name"])
            return self._create_namespace(obj)
        self.namespace_active(namespace)
        if self.store.get(resource, namespace, meta["name"]) is not None:
            raise _exists(resource, meta["name"])
        if resource == "pods":
            admission.limit_ranger_mutate(obj, self.store.items("limitranges", namespace))
        validate = getattr(self, f"_prepare_{resource}", None)
        if validate is not None:
            validate(obj)
        if resource == "pods":
            self._admit_pod(obj, namespace)
        created = self.store.create(resource, obj)
        if resource == "pods":
            self._queue[(namespace, meta["name"])] = meta["uid"]
            self.trigger_scheduler()
        return created

    def _create_namespace(self, obj: Obj) -> Obj:
        meta = obj.setdefault("metadata", {})
        obj["kind"], obj["apiVersion"] = "Namespace", "v1"
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
        obj["spec"] = {"finalizers": ["kubernetes"]}
        obj["status"] = {"phase": "Active"}
        return self.store.create("namespaces", obj)

    def delete(self, resource: str, namespace: str, name: str, options: dict[str, Any] | None = None) -> Obj:
        """Delete one object; the answer is what a real server returns for that resource."""
        obj = self.get(resource, namespace, name)
        if resource == "nodes":
            raise ApiError(405, "MethodNotAllowed", "the emulator's nodes cannot be deleted")
        _check_preconditions(resource, obj, (options or {}).get("preconditions") or {})
        if resource == "pods":
            return self._delete_pod(obj, options or {})
        if resource == "namespaces":
            return self._delete_namespace(obj)
        gone = self.store.delete(resource, namespace, name)
        assert gone is not None
        if resource == "services":
            return gone
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {"name": name, "kind": resource, "uid": gone["metadata"]["uid"]},
        }

    def delete_collection(
        self,
        resource: str,
        namespace: str | None,
        labels: LabelSelector,
        fields: FieldSelector,
        options: dict[str, Any] | None,
    ) -> Obj:
        info = RESOURCES[resource]
        deleted = []
        for obj in self.list(resource, namespace, labels, fields):
            meta = obj["metadata"]
            result = self.delete(resource, meta.get("namespace", ""), meta["name"], options)
            deleted.append(result if result.get("kind") != "Status" else copy.deepcopy(obj))
        for item in deleted:
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {
            "kind": f"{info.kind}List",
            "apiVersion": "v1",
            "metadata": {"resourceVersion": str(self.store.rv)},
            "items": deleted,
        }

    def replace(self, resource: str, namespace: str, name: str, body: Any) -> Obj:
        current = self.get(resource, namespace, name)
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of the request was in an unknown format")
        meta = body.get("metadata") or {}
        if meta.get("name") not in (None, name):
            raise ApiError(400, "BadRequest", "the name of the object does not match the name on the URL")
        rv = meta.get("resourceVersion")
        if rv and rv != current["metadata"]["resourceVersion"]:
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
                {"name": name, "kind": resource},
            )
        return self._write(resource, current, copy.deepcopy(body))

    def patch(self, resource: str, namespace: str, name: str, patch: Any, content_type: str) -> Obj:
        current = self.get(resource, namespace, name)
        new = copy.deepcopy(current)
        if "json-patch" in content_type:
            if not isinstance(patch, list):
                raise ApiError(400, "BadRequest", "json patch must be a list of operations")
            new = _json_patch(new, patch)
        else:
            if not isinstance(patch, dict):
                raise ApiError(400, "BadRequest", "merge patch must be a JSON object")
            new = _merge_patch(new, patch)
        return self._write(resource, current, new)

    def _write(self, resource: str, current: Obj, new: Obj) -> Obj:
        info = RESOURCES[resource]
        meta = new.setdefault("metadata", {})
        for key in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp", "resourceVersion"):
            if key in current["metadata"]:
                meta[key] = current["metadata"][key]
        errors = _label_errors(meta.get("labels"), "metadata.labels")
        if errors:
            raise invalid(info.kind, meta["name"], errors)
        new["kind"], new["apiVersion"] = info.kind, "v1"
        if resource in ("pods", "nodes", "namespaces"):
            new["status"] = current.get("status")
        if resource == "pods" and new.get("spec") != current.get("spec"):
            raise invalid(
                "Pod",
                meta["name"],
                [
                    (
                        "spec",
                        "Forbidden: pod updates may not change fields other than `spec.containers[*].image`, "
                        "`spec.initContainers[*].image`, `spec.activeDeadlineSeconds`, `spec.tolerations` "
                        "(only additions to existing tolerations), `spec.terminationGracePeriodSeconds` (allow it "
                        "to be set to 1 if it was previously negative)",
                    )
                ],
            )
        if resource == "secrets":
            self._prepare_secrets(new)
        if resource == "services":
            spec = new.setdefault("spec", {})
            old_ip = (current.get("spec") or {}).get("clusterIP")
            if spec.get("clusterIP") not in (None, "", old_ip):
                raise invalid("Service", meta["name"], [("spec.clusterIP", "Invalid value: field is immutable")])
            spec["clusterIP"] = old_ip
            spec["clusterIPs"] = (current.get("spec") or {}).get("clusterIPs")
        return self.store.update(resource, new)

    # -- pods -------------------------------------------------------------------------------

    def _prepare_pods(self, pod: Obj) -> None:
        """Validate and default a new pod as the API server's admission and defaulting do."""
        meta, spec = pod["metadata"], pod.get("spec")
        name = meta["name"]
        errors = _dns_errors(name, "metadata.name", "subdomain")
        errors += _label_errors(meta.get("labels"), "metadata.labels")
        if not isinstance(spec, dict):
            raise invalid("Pod", name, [*errors, ("spec.containers", "Required value")])
        containers = spec.get("containers")
        if not containers or not isinstance(containers, list):
            errors.append(("spec.containers", "Required value"))
            containers = []
        volume_names, volume_errors = _volume_errors(spec.get("volumes") or [])
        errors += volume_errors
        seen: set[str] = set()
        for i, c in enumerate(containers):
            errors += _container_errors(f"spec.containers[{i}]", c, seen, volume_names)
        for field in ("hostname", "subdomain"):
            if spec.get(field):
                errors += _dns_errors(spec[field], f"spec.{field}", "label")
        policy = spec.get("restartPolicy")
        if policy not in (None, "Always", "OnFailure", "Never"):
            errors.append(
                (
                    "spec.restartPolicy",
                    f'Unsupported value: "{policy}": supported values: "Always", "OnFailure", "Never"',
                )
            )
        if errors:
            raise invalid("Pod", name, errors)
        _default_pod_spec(spec, containers)
        pod["status"] = {"phase": "Pending", "qosClass": _qos(containers)}

    def _admit_pod(self, pod: Obj, namespace: str) -> None:
        """The validating admission plugins, in the API server's order: LimitRanger,
        PodSecurity, ResourceQuota (last, so only admitted pods are charged)."""
        errors = admission.limit_ranger_validate(pod, self.store.items("limitranges", namespace))
        if not errors:
            ns = self.store.get("namespaces", "", namespace) or {}
            violation = admission.pod_security(pod, ns)
            errors = [violation] if violation else []
        if not errors:
            pods = list(self.store.items("pods", namespace))
            exceeded = admission.resource_quota(pod, self.store.items("resourcequotas", namespace), pods)
            errors = [exceeded] if exceeded else []
        if errors:
            name = pod["metadata"]["name"]
            text = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
            raise ApiError(403, "Forbidden", f'pods "{name}" is forbidden: {text}', {"name": name, "kind": "pods"})

    def _prepare_limitranges(self, obj: Obj) -> None:
        admission.default_limit_range(obj)

    def _prepare_resourcequotas(self, obj: Obj) -> None:
        hard = dict((obj.get("spec") or {}).get("hard") or {})
        used = admission.quota_used(obj, self.store.items("pods", obj["metadata"]["namespace"]))
        shown = {k: admission.format_quantity(v, k.endswith("memory")) for k, v in used.items()}
        obj["status"] = {"hard": hard, "used": shown}

    def _delete_pod(self, pod: Obj, options: dict[str, Any]) -> Obj:
        meta = pod["metadata"]
        ns, name = meta["namespace"], meta["name"]
        self._queue.pop((ns, name), None)
        if meta.get("deletionTimestamp"):
            return pod
        grace = options.get("gracePeriodSeconds")
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        running = self.kubelet.runtimes.get((ns, name)) is not None
        if not running:
            self.kubelet.discard_files(ns, name, meta["uid"])
            gone = self.store.delete("pods", ns, name)
            self.trigger_scheduler()
            return gone or pod

        def mark(p: Obj) -> None:
            p["metadata"]["deletionTimestamp"] = self.now()
            p["metadata"]["deletionGracePeriodSeconds"] = grace

        marked = self.store.modify("pods", ns, name, mark)
        container = pod["spec"]["containers"][0]["name"]
        self.record_event(pod, "Normal", "Killing", f"Stopping container {container}", component="kubelet", container=0)
        self.kubelet.kill(ns, name)
        return marked or pod

    def pod_stopped_for_deletion(self, namespace: str, name: str, uid: str) -> None:
        """The kubelet stopped a pod being deleted: the object goes (DELETED)."""
        pod = self.store.get("pods", namespace, name)
        if pod is not None and pod["metadata"]["uid"] == uid:
            self.store.delete("pods", namespace, name)
        self._finish_namespace(namespace)

    # -- namespaces -------------------------------------------------------------------------

    def _delete_namespace(self, ns: Obj) -> Obj:
        name = ns["metadata"]["name"]
        if name in ("default", "kube-system", "kube-public"):
            raise ApiError(
                403,
                "Forbidden",
                f'namespaces "{name}" is forbidden: this namespace may not be deleted',
                {"name": name, "kind": "namespaces"},
            )

        def mark(obj: Obj) -> None:
            obj["metadata"]["deletionTimestamp"] = self.now()
            obj["status"]["phase"] = "Terminating"

        marked = self.store.modify("namespaces", "", name, mark)
        for resource in ("services", "secrets", "events", "limitranges", "resourcequotas"):
            for obj in list(self.store.items(resource, name)):
                self.store.delete(resource, name, obj["metadata"]["name"])
        for pod in list(self.store.items("pods", name)):
            self._delete_pod(pod, {})
        self._finish_namespace(name)
        return marked or ns

    def _finish_namespace(self, name: str) -> None:
        ns = self.store.get("namespaces", "", name)
        if ns is None or ns["status"].get("phase") != "Terminating":
            return
        if next(iter(self.store.items("pods", name)), None) is None:
            self.store.delete("namespaces", "", name)

    # -- secrets and services ---------------------------------------------------------------

    def _prepare_persistentvolumeclaims(self, claim: Obj) -> None:
        """A claim needs access modes and a storage request, and is bound at once (the
        emulator provisions a directory of its own for it when a pod first mounts it)."""
        name = claim["metadata"]["name"]
        spec = claim.get("spec") or {}
        errors = _dns_errors(name, "metadata.name", "subdomain")
        modes = spec.get("accessModes") or []
        if not modes:
            errors.append(("spec.accessModes", "Required value: at least 1 access mode is required"))
        allowed = ("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod")
        errors += [("spec.accessModes", f'Unsupported value: "{m}"') for m in modes if m not in allowed]
        if not ((spec.get("resources") or {}).get("requests") or {}).get("storage"):
            errors.append(("spec.resources[storage]", "Required value"))
        if errors:
            raise invalid("PersistentVolumeClaim", name, errors)
        claim["status"] = {"phase": "Bound", "accessModes": list(modes)}

    def _prepare_secrets(self, secret: Obj) -> None:
        name = secret["metadata"]["name"]
        errors = _dns_errors(name, "metadata.name", "subdomain")
        errors += _label_errors(secret["metadata"].get("labels"), "metadata.labels")
        data = secret.get("data") or {}
        for key, value in (secret.pop("stringData", None) or {}).items():
            data[key] = base64.b64encode(str(value).encode()).decode()
        total = 0
        for key, value in data.items():
            if not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
                errors.append(
                    (
                        f"data[{key}]",
                        f'Invalid value: "{key}": a valid config key must consist of '
                        "alphanumeric characters, '-', '_' or '.'",
                    )
                )
            try:
                total += len(base64.b64decode(str(value), validate=True))
            except (binascii.Error, ValueError):
                raise ApiError(
                    400,
                    "BadRequest",
                    f'Secret in version "v1" cannot be handled as a Secret: illegal base64 data in data[{key}]',
                ) from None
        if total > 1024 * 1024:
            errors.append(("data", "Too long: must have at most 1048576 bytes"))
        if errors:
            raise invalid("Secret", name, errors)
        secret["data"] = data
        secret.setdefault("type", "Opaque")

    def _prepare_services(self, svc: Obj) -> None:
        name = svc["metadata"]["name"]
        errors = _dns_errors(name, "metadata.name", "dns1035")
        errors += _label_errors(svc["metadata"].get("labels"), "metadata.labels")
        spec = svc.setdefault("spec", {})
        for i, port in enumerate(spec.get("ports") or []):
            number = port.get("port")
            if not isinstance(number, int) or not 0 < number < 65536:
                errors.append(
                    (f"spec.ports[{i}].port", f"Invalid value: {number}: must be between 1 and 65535, inclusive")
                )
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", number)
        if not spec.get("ports") and spec.get("clusterIP") != "None":
            errors.append(("spec.ports", "Required value"))
        if errors:
            raise invalid("Service", name, errors)
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
        spec.setdefault("internalTrafficPolicy", "Cluster")
        if spec.get("clusterIP") != "None":
            self._service_ips += 1
            spec["clusterIP"] = str(ipaddress.IPv4Address("10.96.0.0") + self._service_ips)
        spec["clusterIPs"] = [spec["clusterIP"]]
        svc["status"] = {"loadBalancer": {}}

    # -- events -----------------------------------------------------------------------------

    def record_event(
        self,
        obj: Obj,
        type_: str,
        reason: str,
        message: str,
        *,
        component: str,
        container: int | None = None,
    ) -> None:
        """Record an Event about ``obj``; a repeat of the same one bumps its count, as the
        client-go event recorder aggregates."""
        meta = obj["metadata"]
        ns = meta.get("namespace") or "default"
        if self.store.get("namespaces", "", ns) is None:
            return
        key = (meta["uid"], type_, reason, message)
        now = self.now()
        existing = self._events.get(key)
        if existing is not None and self.store.get("events", *existing) is not None:

            def bump(ev: Obj) -> None:
                ev["count"] = ev.get("count", 1) + 1
                ev["lastTimestamp"] = now

            self.store.modify("events", existing[0], existing[1], bump)
            return
        involved = {
            "kind": obj.get("kind") or "Pod",
            "namespace": ns,
            "name": meta["name"],
            "uid": meta["uid"],
            "apiVersion": "v1",
            "resourceVersion": meta.get("resourceVersion", ""),
        }
        if container is not None:
            involved["fieldPath"] = f"spec.containers{{{obj['spec']['containers'][container]['name']}}}"
        host = (obj.get("spec") or {}).get("nodeName")
        event = {
            "kind": "Event",
            "apiVersion": "v1",
            "metadata": {"name": self._event_name(meta["name"]), "namespace": ns},
            "involvedObject": involved,
            "reason": reason,
            "message": message,
            "source": {"component": component, **({"host": host} if host and component == "kubelet" else {})},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "type": type_,
            "eventTime": None,
            "reportingComponent": component,
            "reportingInstance": host if component == "kubelet" and host else "",
        }
        created = self.store.create("events", event)
        self._events[key] = (ns, created["metadata"]["name"])

    def _event_name(self, name: str) -> str:
        """``<object>.<hex nanoseconds>`` as client-go names events: lists come back in
        key order, which is then the order they happened in."""
        stamp = max(time.time_ns(), self._last_event_ns + 1)
        self._last_event_ns = stamp
        return f"{name}.{stamp:x}"

    # -- scheduling -------------------------------------------------------------------------

    def trigger_scheduler(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _scheduler_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self._schedule_pending()
            except Exception:
                log.exception("emulated scheduler failed")

    def _schedule_pending(self) -> None:
        nodes = [scheduler.node_view(n) for n in self.store.items("nodes")]
        for key, uid in list(self._queue.items()):
            pod = self.store.get("pods", *key)
            if pod is None or pod["metadata"]["uid"] != uid or pod["metadata"].get("deletionTimestamp"):
                self._queue.pop(key, None)
                continue
            preset = pod["spec"].get("nodeName")
            if preset:
                # Bound by its creator (no scheduler involved): run it if that node exists.
                if any(n.name == preset for n in nodes):
                    self._queue.pop(key, None)
                    self.kubelet.bind(pod)
                continue
            bound = [p for p in self.store.items("pods") if p["spec"].get("nodeName")]
            taint = PENDING_TAINT if self.faults.matches("pending", pod) else None
            decision = scheduler.schedule(pod, nodes, bound, extra_taint=taint)
            if decision.node is None:
                self._unschedulable(pod, decision.message)
                continue
            self._queue.pop(key, None)
            node = decision.node
            now = self.now()

            def bind(p: Obj, node: str = node, now: str = now) -> None:
                p["spec"]["nodeName"] = node
                conds = [c for c in p["status"].get("conditions") or [] if c["type"] != "PodScheduled"]
                conds.append(
                    {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
                )
                p["status"]["conditions"] = conds

            bound_pod = self.store.modify("pods", key[0], key[1], bind)
            if bound_pod is None:
                continue
            self.record_event(
                bound_pod,
                "Normal",
                "Scheduled",
                f"Successfully assigned {key[0]}/{key[1]} to {node}",
                component="default-scheduler",
            )
            self.kubelet.bind(bound_pod)

    def _unschedulable(self, pod: Obj, message: str) -> None:
        conds = pod["status"].get("conditions") or []
        current = next((c for c in conds if c["type"] == "PodScheduled"), None)
        if current is None or current.get("message") != message:
            now = self.now()

            def mark(p: Obj) -> None:
                p["status"]["conditions"] = [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "lastProbeTime": None,
                        "lastTransitionTime": now,
                        "reason": "Unschedulable",
                        "message": message,
                    }
                ]

            pod = self.store.modify("pods", pod["metadata"]["namespace"], pod["metadata"]["name"], mark) or pod
        self.record_event(pod, "Warning", "FailedScheduling", message, component="default-scheduler")


def _check_preconditions(resource: str, obj: Obj, preconditions: dict[str, Any]) -> None:
    """DeleteOptions ``preconditions``: a uid or resourceVersion that is not the object's is
    409 Conflict, as the real registry answers (the delete then touches nothing)."""
    meta = obj["metadata"]
    for key, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
        wanted = preconditions.get(key)
        if wanted and wanted != meta.get(key):
            raise ApiError(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on {resource} "{meta["name"]}": Precondition failed: '
                f"{label} in precondition: {wanted}, {label} in object meta: {meta.get(key)}",
                {"name": meta["name"], "kind": resource},
            )


def _exists(resource: str, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists', {"name": name, "kind": resource})


def _qos(containers: Iterable[dict[str, Any]]) -> str:
    any_set, guaranteed = False, True
    for c in containers:
        res = c.get("resources") or {}
        req, lim = res.get("requests") or {}, res.get("limits") or {}
        if req or lim:
            any_set = True
        for rname in ("cpu", "memory"):
            if rname not in lim or str(req.get(rname, lim.get(rname))) != str(lim.get(rname)):
                guaranteed = False
    if not any_set:
        return "BestEffort"
    return "Guaranteed" if guaranteed else "Burstable"


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (strategic merge patches are applied the same way: enough
    for labels, annotations and maps, which is what clients patch on these resources)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if not isinstance(target, dict):
        target = {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            target.pop(key, None)
        else:
            target[key] = _merge_patch(target.get(key), value)
    return target


def _json_patch(doc: Any, ops: list[Any]) -> Any:
    """RFC 6902 add/remove/replace/test (what ``kubectl patch --type=json`` sends)."""

    def parts(pointer: str) -> list[str]:
        return [p.replace("~1", "/").replace("~0", "~") for p in pointer.split("/")[1:]]

    for op in ops:
        path = parts(op.get("path", ""))
        if not path:
            raise ApiError(422, "Invalid", "json patch: empty path")
        parent = doc
        for p in path[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent.setdefault(p, {})
        last = path[-1]
        kind = op.get("op")
        try:
            if kind in ("add", "replace"):
                if isinstance(parent, list):
                    idx = len(parent) if last == "-" else int(last)
                    if kind == "add":
                        parent.insert(idx, op.get("value"))
                    else:
                        parent[idx] = op.get("value")
                else:
                    parent[last] = op.get("value")
            elif kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif kind == "test":
                actual = parent[int(last)] if isinstance(parent, list) else parent.get(last)
                if actual != op.get("value"):
                    raise ApiError(422, "Invalid", f"json patch test failed at {op.get('path')}")
            else:
                raise ApiError(422, "Invalid", f"json patch: unsupported op {kind!r}")
        except (KeyError, IndexError, ValueError) as exc:
            raise ApiError(422, "Invalid", f"json patch {kind} {op.get('path')}: {exc}") from None
    return doc


def _kernel() -> str:
    import platform

    return platform.release()


def _volume_errors(volumes: list[Obj]) -> tuple[set[str], list[tuple[str, str]]]:
    """The pod's volume names, and what is wrong with them."""
    errors: list[tuple[str, str]] = []
    volume_names: set[str] = set()
    for i, vol in enumerate(volumes):
        vname = vol.get("name") or ""
        errors += _dns_errors(vname, f"spec.volumes[{i}].name", "label")
        if vname in volume_names:
            errors.append((f"spec.volumes[{i}].name", f'Duplicate value: "{vname}"'))
        volume_names.add(vname)
    return volume_names, errors


def _container_errors(path: str, c: Obj, seen: set[str], volume_names: set[str]) -> list[tuple[str, str]]:
    """What is wrong with one container (``seen``: the names of those before it, added to)."""
    errors: list[tuple[str, str]] = []
    cname = c.get("name") or ""
    if not cname:
        errors.append((f"{path}.name", "Required value"))
    else:
        errors += _dns_errors(cname, f"{path}.name", "label")
    if cname in seen:
        errors.append((f"{path}.name", f'Duplicate value: "{cname}"'))
    seen.add(cname)
    if not c.get("image"):
        errors.append((f"{path}.image", "Required value"))
    for j, vm in enumerate(c.get("volumeMounts") or []):
        if vm.get("name") not in volume_names:
            errors.append((f"{path}.volumeMounts[{j}].name", f'Not found: "{vm.get("name")}"'))
        if not str(vm.get("mountPath") or "").startswith("/"):
            errors.append((f"{path}.volumeMounts[{j}].mountPath", "Invalid value: must be an absolute path"))
    return errors + _resource_errors(path, c.get("resources") or {})


def _resource_errors(path: str, resources: Obj) -> list[tuple[str, str]]:
    """A container's requests and limits: quantities that parse, requests within limits,
    extended resources (``vendor/name``) with a limit equal to the request."""
    errors: list[tuple[str, str]] = []
    parsed: dict[str, dict[str, Any]] = {}
    for kind in ("requests", "limits"):
        for rname, qty in (resources.get(kind) or {}).items():
            try:
                parsed.setdefault(kind, {})[rname] = scheduler.parse_quantity(qty)
            except scheduler.QuantityError as exc:
                errors.append((f"{path}.resources.{kind}[{rname}]", f'Invalid value: "{qty}": {exc}'))
    req, lim = parsed.get("requests", {}), parsed.get("limits", {})
    for rname, value in req.items():
        if rname in lim and value > lim[rname]:
            errors.append(
                (
                    f"{path}.resources.requests",
                    f'Invalid value: "{resources["requests"][rname]}": must be '
                    f"less than or equal to {rname} limit of {resources['limits'][rname]}",
                )
            )
        if "/" in rname and not rname.startswith("kubernetes.io/") and rname in lim and value != lim[rname]:
            errors.append(
                (
                    f"{path}.resources.requests[{rname}]",
                    f'Invalid value: "{resources["requests"][rname]}": '
                    f"must be equal to {rname} limit of {resources['limits'][rname]}",
                )
            )
        if "/" in rname and rname not in lim:
            errors.append(
                (
                    f"{path}.resources.limits",
                    "Required value: Limit must be set for non overcommitable resources",
                )
            )
    return errors


def _default_pod_spec(spec: Obj, containers: list[Obj]) -> None:
    """The API server's defaulting of a valid pod's spec."""
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("securityContext", {})
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("serviceAccountName", "default")
    spec.setdefault("serviceAccount", spec["serviceAccountName"])
    spec.setdefault("enableServiceLinks", True)
    spec.setdefault("priority", 0)
    spec.setdefault("preemptionPolicy", "PreemptLowerPriority")
    tolerations = spec.setdefault("tolerations", [])
    for key in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"):
        if not any(t.get("key") == key for t in tolerations):
            tolerations.append({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300})
    for c in containers:
        image = c["image"]
        tag = image.rsplit("/", 1)[-1]
        c.setdefault(
            "imagePullPolicy",
            "Always" if (":" not in tag or tag.endswith(":latest")) and "@" not in tag else "IfNotPresent",
        )
        c.setdefault("terminationMessagePath", "/dev/termination-log")
        c.setdefault("terminationMessagePolicy", "File")
        res = c.setdefault("resources", {})
        if res.get("limits"):
            requests = res.setdefault("requests", {})
            for rname, qty in res["limits"].items():
                requests.setdefault(rname, qty)
