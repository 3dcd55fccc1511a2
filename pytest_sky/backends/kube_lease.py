"""A cluster's lifetime, held by the cluster and not by the runner's disk: one
``coordination.k8s.io/v1`` Lease per cluster (DESIGN.md section 6, "Lifetimes").

The Lease is made before anything else of the cluster, named after it and labelled with its
launch, and every other object of the cluster names it as its owner (``ownerReferences``),
so that deleting it lets the cluster's garbage collector take the rest.  Its holder is the
process that launched the cluster (host and pid); a renewer thread of that process renews it
:data:`RENEWALS_PER_LEASE` times per lease length while the cluster lives, whatever the test
body does.  A runner that vanished renews nothing: once ``renewTime`` is older than
``leaseDurationSeconds``, any later session with access to the namespace reaps the cluster
(``kube_reaping``).  A cluster kept on purpose has a lease that says so (annotation
``pytest-sky/kept``), which nothing reaps, and no renewer.

The Lease also carries what a reaper on another machine could not read otherwise: the uid of
the cluster's Secret (the Role grants no read of Secrets; a delete preconditioned on that uid
removes ours and only ours).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from pytest_sky import settings
from pytest_sky.backends import kube_client
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kube_client import KubeClient

log = logging.getLogger(__name__)

API_VERSION = "coordination.k8s.io/v1"
KIND = "Lease"
#: A kept cluster's lease: nothing reaps it, whatever its age.
KEPT = "pytest-sky/kept"
#: The uid of the cluster's Secret, for a reaper that may not read Secrets.
SECRET_UID = "pytest-sky/secret-uid"
#: The lease's length when ``--kube-lease-seconds`` says none: a runner gone two minutes has
#: its clusters reaped by the next session that looks; an owner cut off from the API server
#: longer than that loses them.
DEFAULT_LEASE_SECONDS = settings.LEASE_SECONDS
#: Renewals per lease length (at least three: one lost or late renewal never expires it).
RENEWALS_PER_LEASE = 4
#: The least a renewal's request may take before it is given up (a short lease's quarter is
#: less than a loaded API server may need).
REQUEST_TIMEOUT = 5.0
#: A pod's ``activeDeadlineSeconds`` when ``--kube-max-lifetime`` says none: 6 h, a CI job's
#: usual ceiling (GitHub Actions stops one at 6 h unless told otherwise), longer than any test.
DEFAULT_MAX_LIFETIME = settings.MAX_LIFETIME


def holder_identity() -> str:
    """Who holds a lease: this host and process (what ``status`` and ``doctor`` show)."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def micro_time(when: datetime.datetime | None = None) -> str:
    """A Lease's ``MicroTime``: RFC 3339 in UTC with microseconds."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def body(cluster: str, namespace: str, *, launch: str, seconds: float, kept: bool) -> dict[str, Any]:
    """The cluster's Lease as created: held by this process from now, for ``seconds``."""
    now = micro_time()
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": cluster,
            "namespace": namespace,
            "labels": manifests.labels(cluster, launch=launch),
            "annotations": {KEPT: "true"} if kept else {},
        },
        "spec": {
            "holderIdentity": holder_identity(),
            "leaseDurationSeconds": max(1, round(seconds)),
            "acquireTime": now,
            "renewTime": now,
        },
    }


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """What the cluster's other objects say of their owner, the Lease.  No
    ``blockOwnerDeletion``: setting it asks for ``update`` on ``leases/finalizers`` where the
    OwnerReferencesPermissionEnforcement admission plugin runs, and the backend deletes the
    lease last anyway."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": name, "uid": uid}


def _when(value: object) -> datetime.datetime | None:
    """A time as the client gives it (a datetime, or text from an older client)."""
    if isinstance(value, datetime.datetime):
        return value if value.tzinfo else value.replace(tzinfo=datetime.timezone.utc)
    if isinstance(value, str) and value:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return None


@dataclass(frozen=True)
class LeaseView:
    """One cluster's lease as read from the API server: what a reaper decides on and what
    ``status`` and ``doctor`` show."""

    cluster: str
    uid: str
    resource_version: str
    holder: str
    launch: str | None
    kept: bool
    created: datetime.datetime | None
    renewed: datetime.datetime | None
    seconds: float
    secret_uid: str | None

    @classmethod
    def of(cls, lease: Any) -> LeaseView:
        meta, spec = lease.metadata, lease.spec
        labels, notes = meta.labels or {}, meta.annotations or {}
        return cls(
            cluster=labels.get(manifests.LABEL_CLUSTER) or meta.name,
            uid=meta.uid,
            resource_version=meta.resource_version,
            holder=(spec.holder_identity if spec else None) or "",
            launch=labels.get(manifests.LABEL_LAUNCH),
            kept=notes.get(KEPT) == "true",
            created=_when(meta.creation_timestamp),
            renewed=_when((spec.renew_time or spec.acquire_time) if spec else None),
            seconds=float((spec.lease_duration_seconds if spec else None) or DEFAULT_LEASE_SECONDS),
            secret_uid=notes.get(SECRET_UID),
        )

    def expired(self, now: datetime.datetime | None = None) -> bool:
        """Not renewed for a whole lease length (by this machine's clock: a live owner's
        renewTime is at most a quarter of a lease old, so clocks may disagree by most of one)."""
        if self.kept:
            return False
        now = now or datetime.datetime.now(datetime.timezone.utc)
        last = self.renewed or self.created
        return last is not None and (now - last).total_seconds() > self.seconds

    def age(self, now: datetime.datetime | None = None) -> float | None:
        now = now or datetime.datetime.now(datetime.timezone.utc)
        return (now - self.created).total_seconds() if self.created else None


def create(client: KubeClient, manifest: dict[str, Any]) -> Any:
    """Create the lease; the API server's answer (its uid)."""
    return client.coordination().create_namespaced_lease(client.namespace, manifest, _request_timeout=30)


def note_secret(client: KubeClient, cluster: str, uid: str) -> None:
    """Write the Secret's uid on the lease, for a reaper that may not read Secrets."""
    patch = {"metadata": {"annotations": {SECRET_UID: uid}}}
    client.coordination().patch_namespaced_lease(cluster, client.namespace, patch, _request_timeout=30)


def written(api: Any, lease: Any) -> dict[str, Any]:
    """A lease as read, to be written back: its times as ``MicroTime`` (six digits always; the
    client's own serialisation drops a fraction that happens to be zero, which the API server
    refuses)."""
    manifest = api.api_client.sanitize_for_serialization(lease)
    spec = manifest.setdefault("spec", {})
    for key, value in (("acquireTime", lease.spec.acquire_time), ("renewTime", lease.spec.renew_time)):
        when = _when(value)
        if when is not None:
            spec[key] = micro_time(when)
    return manifest


def take(client: KubeClient, view: LeaseView, holder: str) -> bool:
    """Become the holder of an expired lease, if it is still exactly what was read (its
    resourceVersion): an owner that renewed meanwhile wins, and two reapers never both do."""
    spec = {
        "holderIdentity": holder,
        "leaseDurationSeconds": max(1, round(view.seconds)),
        "renewTime": micro_time(),
    }
    api = client.coordination()
    lease = api.read_namespaced_lease(view.cluster, client.namespace, _request_timeout=30)
    if lease.metadata.resource_version != view.resource_version:
        return False
    manifest = written(api, lease)
    manifest["spec"] = {**(manifest.get("spec") or {}), **spec}
    try:
        api.replace_namespaced_lease(view.cluster, client.namespace, manifest, _request_timeout=30)
    except kube_client.ApiException as exc:
        if exc.status in (404, 409):  # renewed, taken or deleted meanwhile: not ours to reap
            return False
        raise
    return True


class Renewer:
    """Renews one cluster's lease from a thread of the process that holds it, until
    :meth:`stop`; stops by itself once the lease is gone or held by someone else (reaped as
    stale: its owner was cut off for a whole lease length)."""

    def __init__(self, client: KubeClient, cluster: str, seconds: float) -> None:
        self.client = client
        self.cluster = cluster
        self.interval = seconds / RENEWALS_PER_LEASE
        self.holder = holder_identity()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pytest-sky lease {cluster}", daemon=True)

    def start(self) -> Renewer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    def _run(self) -> None:
        api = self.client.coordination(own=True)  # a connection pool of its own, for its thread
        while not self._stop.wait(self.interval):
            try:
                if not self.renew(api):
                    return
            except Exception as exc:  # noqa: BLE001 - a renewal that failed is tried again next time
                log.warning("could not renew the lease of cluster %s: %s", self.cluster, exc)

    def renew(self, api: Any) -> bool:
        """One renewal (read, check we hold it, write it back with renewTime now); False when
        there is nothing more to renew."""
        ns, timeout = self.client.namespace, max(self.interval, REQUEST_TIMEOUT)
        try:
            lease = api.read_namespaced_lease(self.cluster, ns, _request_timeout=timeout)
        except kube_client.ApiException as exc:
            if exc.status == 404:  # torn down by another process (the CLI's down), or reaped
                log.info("the lease of cluster %s is gone: no longer renewing it", self.cluster)
                return False
            raise
        if (lease.spec.holder_identity or "") != self.holder:
            log.warning(
                "cluster %s's lease is held by %r now (reaped as stale?): no longer renewing it",
                self.cluster,
                lease.spec.holder_identity,
            )
            return False
        manifest = written(api, lease)
        manifest["spec"]["renewTime"] = micro_time()
        try:
            api.replace_namespaced_lease(self.cluster, ns, manifest, _request_timeout=timeout)
        except kube_client.ApiException as exc:
            if exc.status != 409:  # 409: changed meanwhile; the next renewal reads it again
                raise
        return True
