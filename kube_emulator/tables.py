"""Server-side ``Table``s: what ``kubectl get`` prints.

kubectl asks for ``application/json;as=Table;v=v1;g=meta.k8s.io`` and prints the columns the
server chooses; a server that answers with plain objects gets NAME and AGE only, which hides
exactly what a user debugging a launch looks for (a pod's STATUS and RESTARTS, a node's
ROLES, a Service's CLUSTER-IP).  The columns, their order, their priority (1: only with
``-o wide``) and the cells follow the API server's printers
(``pkg/printers/internalversion/printers.go``); resources without a printer get the server's
default, NAME and CREATED AT.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

from kube_emulator.store import Obj

#: The media type parameter that asks for a Table.
TABLE_PARAMETER = "as=Table"

Column = tuple[str, str, int]  # name, type, priority
Printer = tuple[tuple[Column, ...], Callable[[Obj], list[Any]]]


def wants_table(accept: str) -> bool:
    """Whether the Accept header asks for a Table (kubectl's human-readable output does)."""
    first = accept.split(",")[0]
    return TABLE_PARAMETER in first and "g=meta.k8s.io" in first


def table(resource: str, objects: list[Obj], resource_version: str) -> dict[str, Any]:
    """The Table of ``objects`` of ``resource`` (each row's object: its metadata only, as
    ``includeObject=Metadata``, the default, gives)."""
    columns, cells = PRINTERS.get(resource, _DEFAULT)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [
            {"name": name, "type": type_, "format": "name" if name == "Name" else "", "description": "", "priority": p}
            for name, type_, p in columns
        ],
        "rows": [
            {
                "cells": cells(o),
                "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]},
            }
            for o in objects
        ],
    }


def age(timestamp: str | None, now: datetime.datetime | None = None) -> str:
    """``duration.HumanDuration`` of the time since ``timestamp`` ("<unknown>" without one)."""
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    seconds = int(((now or datetime.datetime.now(datetime.timezone.utc)) - then).total_seconds())
    return human_duration(max(seconds, 0))


def human_duration(seconds: int) -> str:
    """Go's ``k8s.io/apimachinery/pkg/util/duration.HumanDuration`` for whole seconds."""
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if hours < 24 * 365 * 2:
        return f"{days}d"
    if hours < 24 * 365 * 8:
        years = days // 365
        return f"{years}y{days % 365}d" if days % 365 else f"{years}y"
    return f"{days // 365}y"


def _created(o: Obj) -> str:
    return age(o["metadata"].get("creationTimestamp"))


def _name(o: Obj) -> str:
    return o["metadata"]["name"]


# -- pods ------------------------------------------------------------------------------------


def _pod_cells(pod: Obj) -> list[Any]:
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    ready = sum(1 for c in statuses if c.get("ready"))
    restarts = sum(int(c.get("restartCount") or 0) for c in statuses)
    gates = spec.get("readinessGates") or []
    return [
        _name(pod),
        f"{ready}/{len(spec.get('containers') or [])}",
        pod_status(pod),
        str(restarts),
        _created(pod),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
        status.get("nominatedNodeName") or "<none>",
        f"{len(gates)}/{len(gates)}" if gates else "<none>",
    ]


def pod_status(pod: Obj) -> str:
    """The STATUS column: the reason of the first container that is not running, else the
    phase; ``Terminating`` once the pod is being deleted (as the printer reads it)."""
    status = pod.get("status") or {}
    reason = status.get("reason") or status.get("phase") or "Unknown"
    for c in status.get("initContainerStatuses") or []:
        state = c.get("state") or {}
        terminated = state.get("terminated")
        if terminated and terminated.get("exitCode") == 0:
            continue
        if terminated:
            reason = f"Init:{terminated.get('reason') or 'Error'}"
            break
        if (state.get("waiting") or {}).get("reason") not in (None, "PodInitializing"):
            reason = f"Init:{state['waiting']['reason']}"
            break
    else:
        for c in reversed(status.get("containerStatuses") or []):
            state = c.get("state") or {}
            if (state.get("waiting") or {}).get("reason"):
                reason = state["waiting"]["reason"]
            elif (state.get("terminated") or {}).get("reason"):
                reason = state["terminated"]["reason"]
    if pod["metadata"].get("deletionTimestamp"):
        reason = "Terminating"
    return reason


# -- nodes, services and the rest ------------------------------------------------------------


def _node_cells(node: Obj) -> list[Any]:
    status = node.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    state = "Ready" if ready and ready.get("status") == "True" else "NotReady"
    if (node.get("spec") or {}).get("unschedulable"):
        state += ",SchedulingDisabled"
    labels = node["metadata"].get("labels") or {}
    roles = sorted(k.split("/", 1)[1] for k in labels if k.startswith("node-role.kubernetes.io/"))
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    info = status.get("nodeInfo") or {}
    return [
        _name(node),
        state,
        ",".join(roles) or "<none>",
        _created(node),
        info.get("kubeletVersion", ""),
        addresses.get("InternalIP") or "<none>",
        addresses.get("ExternalIP") or "<none>",
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


def _service_cells(svc: Obj) -> list[Any]:
    spec = svc.get("spec") or {}
    ports = [f"{p.get('port')}/{p.get('protocol') or 'TCP'}" for p in spec.get("ports") or []]
    external = spec.get("externalIPs") or []
    selector = spec.get("selector") or {}
    return [
        _name(svc),
        spec.get("type") or "ClusterIP",
        spec.get("clusterIP") or "<none>",
        ",".join(external) or "<none>",
        ",".join(ports) or "<none>",
        _created(svc),
        ",".join(f"{k}={v}" for k, v in sorted(selector.items())) or "<none>",
    ]


def _binding_cells(binding: Obj) -> list[Any]:
    ref = binding.get("roleRef") or {}
    subjects = binding.get("subjects") or []

    def named(kind: str) -> str:
        names = [
            (
                f"{s['namespace']}/{s.get('name', '')}"
                if kind == "ServiceAccount" and s.get("namespace")
                else s.get("name")
            )
            for s in subjects
            if s.get("kind") == kind
        ]
        return ", ".join(n for n in names if n)

    return [
        _name(binding),
        f"{ref.get('kind', '')}/{ref.get('name', '')}",
        _created(binding),
        named("User"),
        named("Group"),
        named("ServiceAccount"),
    ]


def _event_cells(event: Obj) -> list[Any]:
    involved = event.get("involvedObject") or {}
    last = event.get("lastTimestamp") or event.get("eventTime") or event["metadata"].get("creationTimestamp")
    return [
        age(last) if last else "<unknown>",
        event.get("type") or "",
        event.get("reason") or "",
        f"{(involved.get('kind') or '').lower()}/{involved.get('name', '')}",
        (event.get("message") or "").strip(),
    ]


def _columns(*names: str, wide: tuple[str, ...] = ()) -> tuple[Column, ...]:
    """String columns: ``names`` in every listing, ``wide`` in ``-o wide`` only (priority 1)."""
    return tuple((name, "string", 0) for name in names) + tuple((name, "string", 1) for name in wide)


_DEFAULT: Printer = (
    (("Name", "string", 0), ("Created At", "date", 0)),
    lambda o: [_name(o), o["metadata"].get("creationTimestamp")],
)
PRINTERS: dict[str, Printer] = {
    "pods": (
        _columns(
            "Name", "Ready", "Status", "Restarts", "Age", wide=("IP", "Node", "Nominated Node", "Readiness Gates")
        ),
        _pod_cells,
    ),
    "nodes": (
        _columns(
            "Name",
            "Status",
            "Roles",
            "Age",
            "Version",
            wide=("Internal-IP", "External-IP", "OS-Image", "Kernel-Version", "Container-Runtime"),
        ),
        _node_cells,
    ),
    "services": (
        _columns("Name", "Type", "Cluster-IP", "External-IP", "Port(s)", "Age", wide=("Selector",)),
        _service_cells,
    ),
    "namespaces": (
        _columns("Name", "Status", "Age"),
        lambda o: [_name(o), (o.get("status") or {}).get("phase", ""), _created(o)],
    ),
    "secrets": (
        _columns("Name", "Type", "Data", "Age"),
        lambda o: [_name(o), o.get("type", ""), str(len(o.get("data") or {})), _created(o)],
    ),
    "serviceaccounts": (
        _columns("Name", "Secrets", "Age"),
        lambda o: [_name(o), str(len(o.get("secrets") or [])), _created(o)],
    ),
    "events": (_columns("Last Seen", "Type", "Reason", "Object", "Message"), _event_cells),
    "rolebindings": (
        _columns("Name", "Role", "Age", wide=("Users", "Groups", "ServiceAccounts")),
        _binding_cells,
    ),
}
PRINTERS["clusterrolebindings"] = PRINTERS["rolebindings"]
PRINTERS["leases"] = (
    _columns("Name", "Holder", "Age"),
    lambda o: [_name(o), (o.get("spec") or {}).get("holderIdentity") or "", _created(o)],
)
