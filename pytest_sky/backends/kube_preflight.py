"""What is checked of a kube context before anything is created there: the API server
answers, the namespace exists, the context may do all the backend will do there, the shared
directory's claim suits, and whether GPUs are seen.

Each check says in one line what is wrong and what to pass or ask for; a launch that would
fail half-way on one of these fails here, with nothing to clean up.
"""

from __future__ import annotations

from pytest_sky.backends import kube_client, kube_permissions
from pytest_sky.backends.kube_client import KubeClient
from pytest_sky.backends.kube_errors import api_message, unreachable
from pytest_sky.errors import BackendUnavailableError


def check_namespace(client: KubeClient) -> None:
    """The namespace exists and the context's credentials are accepted.  A 403 passes: a
    context may run pods in a namespace it may not read."""
    api = client.api()
    try:
        api.read_namespace(client.namespace, _request_timeout=30)
    except kube_client.ApiException as exc:
        if exc.status == 404:
            raise BackendUnavailableError(
                f"namespace {client.namespace!r} does not exist in kube context {client.context!r}; "
                "create it or pass --kube-namespace"
            ) from None
        if exc.status not in (401, 403):  # may not list namespaces, yet run pods: try
            raise BackendUnavailableError(f"kube context {client.context!r}: {api_message(exc)}") from None
        if exc.status == 401:
            raise BackendUnavailableError(
                f"kube context {client.context!r} is not authorised (401): check its credentials"
            ) from None
    except Exception as exc:  # noqa: BLE001 - connection errors come as urllib3 exceptions
        raise unreachable(exc, client.context, client.server) from None


def check_permissions(client: KubeClient, *, shared_claim: bool) -> None:
    """The context's RBAC rules in the namespace grant every verb the backend will use
    (:mod:`~pytest_sky.backends.kube_permissions`).  A server that cannot list a user's
    rules, or lists them incomplete, proves nothing missing: the launch goes on."""
    try:
        rules, complete = client.rules_review()
        # The newest rules ask the most; the version matters only if they are not all met.
        lacking = kube_permissions.missing(rules, kube_permissions.needed(None, shared_claim=shared_claim))
        if lacking and complete:
            needed = kube_permissions.needed(client.server_version(), shared_claim=shared_claim)
            lacking = kube_permissions.missing(rules, needed)
    except kube_client.ApiException:
        return
    if lacking and complete:
        raise BackendUnavailableError(kube_permissions.missing_line(client.context, client.namespace, lacking))


def check_claim(client: KubeClient, claim_name: str | None, shared_dir: str) -> None:
    """The shared directory's claim exists here and many pods may write to it at once."""
    try:
        claim = client.api().read_namespaced_persistent_volume_claim(claim_name, client.namespace)
    except kube_client.ApiException as exc:
        if exc.status == 404:
            raise BackendUnavailableError(
                f"shared_dir={shared_dir}: no PersistentVolumeClaim {claim_name!r} in namespace "
                f"{client.namespace!r}; create it (ReadWriteMany) or pass another --kube-shared-pvc"
            ) from None
        raise BackendUnavailableError(f"shared_dir={shared_dir}: {api_message(exc)}") from None
    modes = (claim.status.access_modes if claim.status else None) or claim.spec.access_modes or []
    if "ReadWriteMany" not in modes:
        shown = ", ".join(modes) or "unbound"
        raise BackendUnavailableError(
            f"shared_dir={shared_dir}: PersistentVolumeClaim {claim_name!r} is {shown}, "
            "not ReadWriteMany: every node must mount it at once"
        )


def visible_gpus(client: KubeClient) -> tuple[bool, str]:
    """Whether any node has allocatable nvidia.com/gpu, and if none is seen because the
    context may not list nodes (a namespaced Role cannot grant it), why: GPU tests then
    skip, saying so, rather than fail on a cluster that may have no GPU at all."""
    try:
        nodes = client.api().list_node(_request_timeout=30).items
    except kube_client.ApiException as exc:
        return False, (
            f"kube context {client.context!r} may not list nodes ({exc.status} {exc.reason}), so no GPU "
            "is visible: grant list on nodes (a ClusterRole) to run GPU tests"
        )
    return any(int((n.status.allocatable or {}).get("nvidia.com/gpu", "0") or 0) > 0 for n in nodes), ""


def node_labels(client: KubeClient) -> list[dict[str, str]] | None:
    """Every node's labels, or None where the context may not list nodes."""
    try:
        return [dict(n.metadata.labels or {}) for n in client.api().list_node(_request_timeout=30).items]
    except kube_client.ApiException:
        return None
