"""Discovery: what ``/api``, ``/api/v1``, ``/apis`` and ``/apis/GROUP/v1`` tell a client.

kubectl resolves every resource name it is given (``kubectl get po``, ``apply`` of a Role)
through these lists before it sends a request, so they name exactly what the emulator
serves (:data:`~kube_emulator.api.RESOURCES` and the access reviews), with the verbs and
short names a real server gives.  The aggregated form (``apidiscovery.k8s.io/v2``) is not
served; kubectl then falls back to these, as it does with older servers.
"""

from __future__ import annotations

from typing import Any

from kube_emulator import access_review
from kube_emulator.api import GROUPS, RESOURCES

#: The subresources of pods, with their verbs and the kind each takes.
POD_SUBRESOURCES = {
    "exec": (["create", "get"], "PodExecOptions"),
    "portforward": (["create", "get"], "PodPortForwardOptions"),
    "log": (["get"], "Pod"),
    "status": (["get"], "Pod"),
}


def core_versions(address: str) -> dict[str, Any]:
    """``/api``."""
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
    }


def group_list() -> dict[str, Any]:
    """``/apis``: the API groups beyond the core one."""
    groups = []
    for name in (*GROUPS, access_review.GROUP):
        version = {"groupVersion": f"{name}/v1", "version": "v1"}
        groups.append({"name": name, "versions": [version], "preferredVersion": version})
    return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}


def resource_list(group: str) -> dict[str, Any] | None:
    """``/api/v1`` (``group`` "") or ``/apis/GROUP/v1``; None for a group not served."""
    if group == access_review.GROUP:
        return access_review.resource_list()
    if group and group not in GROUPS:
        return None
    resources = []
    for info in RESOURCES.values():
        if info.group != group:
            continue
        entry: dict[str, Any] = {
            "name": info.name,
            "singularName": info.kind.lower(),
            "namespaced": info.namespaced,
            "kind": info.kind,
            "verbs": list(info.verbs),
        }
        if info.short_names:
            entry["shortNames"] = list(info.short_names)
        resources.append(entry)
    if not group:
        for sub, (verbs, kind) in POD_SUBRESOURCES.items():
            resources.append(
                {"name": f"pods/{sub}", "singularName": "", "namespaced": True, "kind": kind, "verbs": verbs}
            )
    return {"kind": "APIResourceList", "groupVersion": f"{group}/v1" if group else "v1", "resources": resources}
