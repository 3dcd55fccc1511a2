"""The garbage collector: objects whose owners are gone go too, as kube-controller-manager's
garbage collector makes them go (pkg/controller/garbagecollector, Kubernetes 1.31-1.35).

An object names its owners in ``metadata.ownerReferences`` (apiVersion, kind, name, uid).
When an owner is deleted, and when an object is created naming an owner that does not exist,
the collector looks at each dependent afterwards, on its own (a real one works from its
informers, a moment later): an owner counts only if an object of that kind and name exists
with that uid; a dependent left with no owner is deleted (in the background, a pod with its
grace period), one that still has some loses its references to the absent ones.  The three
propagation policies of a delete (``DeleteOptions.propagationPolicy``):

- ``Background`` (the default): the owner goes at once, its dependents after it;
- ``Foreground``: the owner stays, marked for deletion with the ``foregroundDeletion``
  finalizer, until its dependents that set ``blockOwnerDeletion`` are gone; the others are
  deleted too, but do not hold it;
- ``Orphan``: the dependents lose their reference to it and stay.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from kube_emulator import store
from kube_emulator.api import RESOURCES, ApiError
from kube_emulator.store import Change, Obj, Store

FOREGROUND = "foregroundDeletion"
POLICIES = ("Background", "Foreground", "Orphan")


class Collected(Protocol):
    """What the collector needs of the API side (``cluster.Cluster``)."""

    store: Store

    def delete(self, resource: str, namespace: str, name: str, options: dict[str, Any] | None = None) -> Obj: ...


def _resource_of(ref: dict[str, Any]) -> str | None:
    """The served resource an owner reference's apiVersion and kind name (None: not served)."""
    group = str(ref.get("apiVersion") or "").rpartition("/")[0]
    for name, info in RESOURCES.items():
        if info.kind == ref.get("kind") and info.group == group:
            return name
    return None


class GarbageCollector:
    """Deletes the dependents of absent owners, a step after the change that made them so."""

    def __init__(self, host: Collected) -> None:
        self.host = host
        self._pending: set[tuple[str, str]] = set()  # namespaces to look at again ("" too)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.host.store.listeners.append(self._on_change)

    def _on_change(self, change: Change) -> None:
        """A deletion may leave dependents ownerless (or release a foreground owner); a new
        object may name an owner that is not there."""
        obj = change.new
        meta = obj["metadata"]
        if change.type == "DELETED" or (change.type == "ADDED" and meta.get("ownerReferences")):
            self._pending.add((change.resource, meta.get("namespace", "")))
            if self._loop is not None and len(self._pending) == 1:
                self._loop.call_soon(self._collect)

    def owner_exists(self, namespace: str, ref: dict[str, Any]) -> bool:
        resource = _resource_of(ref)
        if resource is None:
            return False
        owner = self.host.store.get(resource, namespace if RESOURCES[resource].namespaced else "", ref.get("name", ""))
        return owner is not None and owner["metadata"]["uid"] == ref.get("uid")

    def _collect(self) -> None:
        namespaces = {ns for _, ns in self._pending}
        self._pending.clear()
        for namespace in sorted(namespaces):
            for resource, info in RESOURCES.items():
                if info.namespaced or not namespace:
                    for obj in list(self.host.store.items(resource, namespace if info.namespaced else None)):
                        self._attempt(resource, obj)
            self._release_foreground(namespace)

    def _attempt(self, resource: str, obj: Obj) -> None:
        """One dependent: deleted if none of its owners exists, its dangling references
        dropped if some do."""
        meta = obj["metadata"]
        refs = meta.get("ownerReferences") or []
        if not refs or meta.get("deletionTimestamp"):
            return
        namespace = meta.get("namespace", "")
        solid = [r for r in refs if self.owner_exists(namespace, r)]
        if len(solid) == len(refs) and not any(self._owner_in_foreground(namespace, r) for r in solid):
            return
        staying = {r["uid"] for r in solid if not self._owner_in_foreground(namespace, r)}
        if staying:
            uids = staying
            self.host.store.modify(
                resource, namespace, meta["name"], lambda o: _keep_refs(o, lambda r: r.get("uid") in uids)
            )
            return
        options = {"propagationPolicy": "Background", "preconditions": {"uid": meta["uid"]}}
        try:
            self.host.delete(resource, namespace, meta["name"], options)
        except ApiError:
            pass  # gone or replaced meanwhile: nothing of this one's to collect

    def _owner_in_foreground(self, namespace: str, ref: dict[str, Any]) -> bool:
        resource = _resource_of(ref)
        owner = self.host.store.get(resource, namespace, ref.get("name", "")) if resource else None
        return owner is not None and FOREGROUND in (owner["metadata"].get("finalizers") or [])

    def _release_foreground(self, namespace: str) -> None:
        """An owner deleted in the foreground goes once no dependent that blocks it is left."""
        for resource, info in RESOURCES.items():
            if not info.namespaced:
                continue
            for owner in list(self.host.store.items(resource, namespace)):
                meta = owner["metadata"]
                if FOREGROUND in (meta.get("finalizers") or []) and not self.blocking(namespace, meta["uid"]):
                    self.host.store.delete(resource, namespace, meta["name"])

    def blocking(self, namespace: str, uid: str) -> list[Obj]:
        """The dependents that hold an owner of ``uid`` deleted in the foreground."""
        return [
            obj
            for resource, info in RESOURCES.items()
            if info.namespaced
            for obj in self.host.store.items(resource, namespace)
            if any(
                r.get("uid") == uid and r.get("blockOwnerDeletion")
                for r in obj["metadata"].get("ownerReferences") or []
            )
        ]

    def orphan(self, namespace: str, uid: str) -> None:
        """``Orphan``: every dependent of the owner ``uid`` loses its reference to it."""
        for resource, info in RESOURCES.items():
            if not info.namespaced:
                continue
            for obj in list(self.host.store.items(resource, namespace)):
                if any(r.get("uid") == uid for r in obj["metadata"].get("ownerReferences") or []):
                    self.host.store.modify(
                        resource,
                        namespace,
                        obj["metadata"]["name"],
                        lambda o: _keep_refs(o, lambda ref: ref.get("uid") != uid),
                    )

    def mark_foreground(self, resource: str, namespace: str, name: str) -> Obj | None:
        """``Foreground``: the owner marked for deletion, held by the finalizer until its
        blocking dependents are gone (the collector deletes every dependent meanwhile)."""

        def mark(obj: Obj) -> None:
            meta = obj["metadata"]
            meta.setdefault("deletionTimestamp", store.now())
            meta["deletionGracePeriodSeconds"] = 0
            finalizers = meta.setdefault("finalizers", [])
            if FOREGROUND not in finalizers:
                finalizers.append(FOREGROUND)

        marked = self.host.store.modify(resource, namespace, name, mark)
        self._pending.add((resource, namespace))
        if self._loop is not None:
            self._loop.call_soon(self._collect)
        return marked


def _keep_refs(obj: Obj, keep: Any) -> None:
    refs = [r for r in obj["metadata"].get("ownerReferences") or [] if keep(r)]
    if refs:
        obj["metadata"]["ownerReferences"] = refs
    else:
        obj["metadata"].pop("ownerReferences", None)
