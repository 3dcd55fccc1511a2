"""Which objects of a namespace are a launch's own, and deleting exactly those.

A cleanup never deletes an object pytest-sky did not create: each object the launch may have
made is read by name (never a collection), counts as ours only if it carries the launch's
label (for a journal from before launch ids: the cluster's and managed-by labels) and, where
the launch made a Lease, names that Lease (by uid) as its owner; and it is deleted with its
uid as a precondition, so a same-named object made since by someone else survives.  The
Secret is the exception to reading: the Role may not read Secrets, so it is deleted by the
uid its creation returned (a precondition that spares any other).  Deleted pods linger while
they terminate; "gone" is awaited by their uids, and the Lease goes last, in the background
(its garbage collector takes whatever of the cluster is left).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytest_sky.backends import kube_client
from pytest_sky.backends import kube_manifests as manifests
from pytest_sky.backends.kube_client import KubeClient
from pytest_sky.backends.kube_journal import KubeRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObjectRef:
    """One object a launch creates, by kind and name (in the backend's namespace)."""

    kind: str  # "Pod", "Secret", "Service", "Lease"
    name: str


def launch_refs(name: str, record: KubeRecord) -> list[ObjectRef]:
    """Every object the launch the journal describes may have made: its pods, Secret,
    Service and Lease (the last, so that it is deleted last)."""
    if record.leased and not record.lease_uid:
        return []  # its Lease, the first object, was never made: nothing was
    pods = [ObjectRef("Pod", p) for p in record.pods]
    lease = [ObjectRef("Lease", name)] if record.lease_uid else []
    return [*pods, ObjectRef("Secret", manifests.secret_name(name)), ObjectRef("Service", name), *lease]


def ownership_selector(name: str, record: KubeRecord) -> str:
    """The label selector of the launch's own pods (the cluster's, before launch ids)."""
    return manifests.selector(name, record.launch) if record.launch else manifests.selector(name)


def is_ours(meta: Any, name: str, record: KubeRecord) -> bool:
    """Whether an object of this metadata was made by the launch the journal describes: its
    label, and (where the launch made a Lease) the Lease as its owner, or that Lease itself."""
    labels = meta.labels or {}
    if not record.launch:
        return labels.get(manifests.LABEL_CLUSTER) == name and all(
            labels.get(k) == v for k, v in manifests.MANAGED_BY.items()
        )
    if labels.get(manifests.LABEL_LAUNCH) != record.launch:
        return False
    if not record.lease_uid or meta.uid == record.lease_uid:
        return True
    return any(ref.uid == record.lease_uid for ref in meta.owner_references or [])


def leftovers(name: str, record: KubeRecord, namespace: str) -> str:
    """Where the cluster's objects may still be, for a record forgotten without them."""
    if not record.pods:
        return "nothing: no object was created"
    ns = record.namespace or namespace
    objects = [f"pod/{p}" for p in record.pods] + [f"secret/{manifests.secret_name(name)}", f"service/{name}"]
    kinds = "pod,secret,service"
    if record.lease_uid:
        objects.insert(0, f"lease/{name}")
        kinds = "lease," + kinds
    sel = f"{manifests.LABEL_LAUNCH}={record.launch}" if record.launch else manifests.selector(name)
    return (
        f"kube context {record.context!r}, namespace {ns!r}: {' '.join(objects)} "
        f"(remove them with `kubectl --context {record.context} delete {kinds} -n {ns} -l {sel}`)"
    )


class Ownership:
    """Reads and deletes a launch's objects in the client's namespace, and only those."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    def _verbs(self, kind: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        api = self.client.api()
        if kind == "Lease":
            leases = self.client.coordination()
            return leases.read_namespaced_lease, leases.delete_namespaced_lease
        return {
            "Pod": (api.read_namespaced_pod, api.delete_namespaced_pod),
            "Secret": (api.read_namespaced_secret, api.delete_namespaced_secret),
            "Service": (api.read_namespaced_service, api.delete_namespaced_service),
        }[kind]

    def uid_if_ours(self, ref: ObjectRef, name: str, record: KubeRecord) -> str | None:
        """The uid of the object ``ref`` names if it exists and this launch made it.  The
        Secret of a launch that made a Lease is not read (the Role may not): its uid is the one
        its creation returned, or None (then the Lease's garbage collector takes it)."""
        if ref.kind == "Secret" and record.leased:
            return record.secret_uid
        try:
            obj = self._verbs(ref.kind)[0](ref.name, self.client.namespace, _request_timeout=30)
        except kube_client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        mine = is_ours(obj.metadata, name, record)
        if not mine:
            log.info("%s %s is not %s's: left alone", ref.kind, ref.name, name)
        return obj.metadata.uid if mine else None

    def owned(self, name: str, record: KubeRecord) -> list[tuple[ObjectRef, str]]:
        """Each object the launch may have made that exists now and is ours, with its uid."""
        found = ((ref, self.uid_if_ours(ref, name, record)) for ref in launch_refs(name, record))
        return [(ref, uid) for ref, uid in found if uid is not None]

    def delete(self, ref: ObjectRef, uid: str, grace_period: int | None = None) -> bool:
        """Delete one object if it is still the one we read (a uid precondition: a same-named
        replacement made since is never hit).  Pods get their own grace period (the spec's
        ``terminationGracePeriodSeconds``) unless ``grace_period`` is given (0 would be a force
        delete: the object goes while its container runs on).  The Lease goes in the background:
        its garbage collector takes what it still owns.  False when it was gone or replaced."""
        propagation = "Background" if ref.kind == "Lease" else None
        options = self.client.delete_options(uid, grace_period, propagation)
        try:
            self._verbs(ref.kind)[1](ref.name, self.client.namespace, body=options, _request_timeout=30)
        except kube_client.ApiException as exc:
            if exc.status in (404, 409):  # gone, or a new object of that name: not ours
                return False
            raise
        return True

    def remove(self, name: str, record: KubeRecord, owned: list[tuple[ObjectRef, str]]) -> None:
        """Delete each of ``owned``: the pods, then the Secret and Service, then, once the pods
        are gone, the Lease (a removal cut short leaves it, and its cluster reapable)."""
        pods = {r.name: uid for r, uid in owned if r.kind == "Pod" and self.delete(r, uid)}
        for ref, uid in owned:
            if ref.kind in ("Secret", "Service"):
                self.delete(ref, uid)
        self.wait_gone(pods, ownership_selector(name, record))
        for ref, uid in owned:
            if ref.kind == "Lease":
                self.delete(ref, uid)

    def wait_gone(self, pods: dict[str, str], sel: str, timeout: float = 120) -> list[str]:
        """Deleted pods linger while they terminate: "down" means gone, so list the pods of
        ``sel`` and watch for the DELETED event of each (by uid) until none is left.  Returns
        those still there at the deadline (logged)."""
        api, ns = self.client.api(), self.client.namespace
        deadline = time.monotonic() + timeout
        while True:
            listing = api.list_namespaced_pod(ns, label_selector=sel, _request_timeout=30)
            present = {p.metadata.uid for p in listing.items}
            pods = {n: u for n, u in pods.items() if u in present}
            left = deadline - time.monotonic()
            if not pods or left <= 0:
                break
            try:
                self._watch_deletions(pods, sel, listing.metadata.resource_version, min(left, 30))
            except kube_client.ApiException as exc:
                if exc.status != 410:  # 410 Gone: the list above is re-read
                    raise
        if pods:
            log.warning("pods of %s are still terminating after %.0f s: %s", sel, timeout, ", ".join(sorted(pods)))
        return sorted(pods)

    def _watch_deletions(self, pods: dict[str, str], sel: str, version: str, seconds: float) -> None:
        """Strike each pod of ``pods`` whose DELETED event (of its uid) comes within ``seconds``."""
        w, events = self.client.watch_pods(sel, version, seconds)
        for event in events:
            obj = event["object"]
            if event["type"] == "DELETED" and pods.get(obj.metadata.name) == obj.metadata.uid:
                del pods[obj.metadata.name]
                if not pods:
                    w.stop()
