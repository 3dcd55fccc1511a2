"""The API's vocabulary: which resources are served, and the ``Status`` errors of a real server.

Every layer that answers a client (the cluster's semantics, the REST handlers, the exec and
port-forward streams) raises :class:`ApiError` with the code, reason and details a real API
server sends, because the backend turns those into its one-line messages; keeping them here,
below all of those layers, lets each raise them without importing the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kube_emulator.store import Obj


@dataclass(frozen=True)
class ResourceInfo:
    """Static facts of a served resource (discovery and error messages use them)."""

    name: str
    kind: str
    namespaced: bool
    verbs: tuple[str, ...]
    short_names: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    group: str = ""  # the API group ("": the core group, under /api/v1)

    @property
    def api_version(self) -> str:
        return f"{self.group}/v1" if self.group else "v1"


RBAC_GROUP = "rbac.authorization.k8s.io"
COORDINATION_GROUP = "coordination.k8s.io"
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
    "serviceaccounts": ResourceInfo("serviceaccounts", "ServiceAccount", True, _RW, ("sa",)),
    # Who may do what: objects a user applies (``kubectl apply -f examples/kubernetes/rbac.yaml``)
    # and the authorizer enforces (rbac_objects.py).
    "roles": ResourceInfo("roles", "Role", True, _RW, group=RBAC_GROUP),
    "rolebindings": ResourceInfo("rolebindings", "RoleBinding", True, _RW, group=RBAC_GROUP),
    "clusterroles": ResourceInfo("clusterroles", "ClusterRole", False, _RW, group=RBAC_GROUP),
    "clusterrolebindings": ResourceInfo("clusterrolebindings", "ClusterRoleBinding", False, _RW, group=RBAC_GROUP),
    # coordination.k8s.io/v1 Lease: who holds something, and until when (what pytest-sky's
    # clusters are owned by).
    "leases": ResourceInfo("leases", "Lease", True, _RW, group=COORDINATION_GROUP),
}
#: The API groups beyond the core one whose resources are in :data:`RESOURCES`.
GROUPS = (RBAC_GROUP, COORDINATION_GROUP)


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


def check_preconditions(resource: str, obj: Obj, preconditions: dict[str, Any]) -> None:
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


def already_exists(resource: str, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists', {"name": name, "kind": resource})
