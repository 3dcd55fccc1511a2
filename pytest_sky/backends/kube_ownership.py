"""Which objects of a namespace are a launch's own, and deleting exactly those.

A cleanup never deletes an object pytest-sky did not create: each object the launch may have
made is read by name (never a collection), counts as ours only if it carries the launch's
label (for a journal from before launch ids: the cluster's and managed-by labels), and is
deleted with its uid as a precondition, so a same-named object made since by someone else
survives.  Deleted pods linger while they terminate; "gone" is awaited by their uids.
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

    kind: str  # "Pod", "Secret", "Service"
    name: str


def launch_refs(name: str, record: KubeRecord) -> list[ObjectRef]:
    """Every object the launch the journal describes may have made: its pods, Secret, Service."""
    pods = [ObjectRef("Pod", p) for p in record.pods]
    return [*pods, ObjectRef("Secret", manifests.secret_name(name)), ObjectRef("Service", name)]


def ownership_selector(name: str, record: KubeRecord) -> str:
    """The label selector of the launch's own pods (the cluster's, before launch ids)."""
    return manifests.selector(name, record.launch) if record.launch else manifests.selector(name)


def is_ours(labels: dict[str, str], name: str, record: KubeRecord) -> bool:
    """Whether an object of these labels was made by the launch the journal describes."""
    if record.launch:
        return labels.get(manifests.LABEL_LAUNCH) == record.launch
    return labels.get(manifests.LABEL_CLUSTER) == name and all(
        labels.get(k) == v for k, v in manifests.MANAGED_BY.items()
    )


def leftovers(name: str, record: KubeRecord, namespace: str) -> str:
    """Where the cluster's objects may still be, for a record forgotten without them."""
    if not record.pods:
        return "nothing: no object was created"
    ns = record.namespace or namespace
    objects = [f"pod/{p}" for p in record.pods] + [f"secret/{manifests.secret_name(name)}", f"service/{name}"]
    sel = f"{manifests.LABEL_LAUNCH}={record.launch}" if record.launch else manifests.selector(name)
    return (
        f"kube context {record.context!r}, namespace {ns!r}: {' '.join(objects)} "
        f"(remove them with `kubectl --context {record.context} delete pod,secret,service -n {ns} -l {sel}`)"
    )


class Ownership:
    """Reads and deletes a launch's objects in the client's namespace, and only those."""

    def __init__(self, client: KubeClient) -> None:
        self.client = client

    def _verbs(self, kind: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        api = self.client.api()
        return {
            "Pod": (api.read_namespaced_pod, api.delete_namespaced_pod),
            "Secret": (api.read_namespaced_secret, api.delete_namespaced_secret),
            "Service": (api.read_namespaced_service, api.delete_namespaced_service),
        }[kind]

    def uid_if_ours(self, ref: ObjectRef, name: str, record: KubeRecord) -> str | None:
        """The uid of the object ``ref`` names if it exists and this launch made it."""
        try:
            obj = self._verbs(ref.kind)[0](ref.name, self.client.namespace, _request_timeout=30)
        except kube_client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        mine = is_ours(obj.metadata.labels or {}, name, record)
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
        ``terminationGracePeriodSeconds``) unless ``grace_period`` is given: 0 is a force
        delete on a real API server, which only a simulated crash asks for.
        False when it was gone or replaced already."""
        options = self.client.delete_options(uid, grace_period)
        try:
            self._verbs(ref.kind)[1](ref.name, self.client.namespace, body=options, _request_timeout=30)
        except kube_client.ApiException as exc:
            if exc.status in (404, 409):  # gone, or a new object of that name: not ours
                return False
            raise
        return True

    def delete_owned(self, owned: list[tuple[ObjectRef, str]]) -> dict[str, str]:
        """Delete each of ``owned``, pods first; the pods whose deletion was accepted (name to uid)."""
        pods = {r.name: uid for r, uid in owned if r.kind == "Pod" and self.delete(r, uid)}
        for ref, uid in owned:
            if ref.kind != "Pod":
                self.delete(ref, uid)
        return pods

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

    def cluster_names(self) -> list[str]:
        """Cluster names that have pods here (the reaper compares them with its records)."""
        pods = self.client.api().list_namespaced_pod(
            self.client.namespace, label_selector="app.kubernetes.io/managed-by=pytest-sky"
        )
        return sorted({p.metadata.labels.get(manifests.LABEL_CLUSTER, "") for p in pods.items} - {""})
