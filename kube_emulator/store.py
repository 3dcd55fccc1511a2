"""The emulator's object store: etcd's role, with one resourceVersion counter and watches.

Everything runs on the server's event loop thread, so the store needs no locks; objects are
plain JSON dicts exactly as they go over the wire.  Every change bumps one global
``resourceVersion`` (as etcd's revision does) and is kept in a bounded history, so a watch
can resume from a version it saw ("410 Gone" when that version fell out of the history,
which the official client's ``Watch`` handles).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import secrets
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kube_emulator.selectors import FieldSelector, LabelSelector

HISTORY = 5000

Obj = dict[str, Any]


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_uid() -> str:
    return str(uuid.uuid4())


def random_suffix(n: int = 5) -> str:
    """``generateName`` suffixes use consonants and digits, like the API server's."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    return "".join(secrets.choice(alphabet) for _ in range(n))


@dataclass
class Change:
    """One entry of the history: what a watch replays."""

    rv: int
    resource: str
    type: str  # ADDED, MODIFIED, DELETED
    old: Obj | None
    new: Obj


@dataclass(eq=False)
class Watcher:
    """A live watch: its filter and the queue the store feeds."""

    resource: str
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector
    queue: asyncio.Queue[tuple[str, Obj] | None] = field(default_factory=asyncio.Queue)

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(obj)

    def translate(self, change: Change) -> tuple[str, Obj] | None:
        """The event this watcher sees: an object moving into or out of the selection is
        ADDED or DELETED for it, as on a real server."""
        if change.resource != self.resource:
            return None
        was, now_ = self.matches(change.old), self.matches(change.new)
        if change.type == "ADDED":
            return ("ADDED", change.new) if now_ else None
        if change.type == "DELETED":
            return ("DELETED", change.new) if (was or now_) else None
        if was and now_:
            return ("MODIFIED", change.new)
        if now_:
            return ("ADDED", change.new)
        if was:
            return ("DELETED", change.new)
        return None


class Expired(Exception):
    """The requested resourceVersion is older than the history (HTTP 410)."""


class Store:
    """Objects by resource, then (namespace, name); cluster-scoped objects use namespace ""."""

    def __init__(self) -> None:
        self.rv = 1
        self.objects: dict[str, dict[tuple[str, str], Obj]] = {}
        self.history: deque[Change] = deque(maxlen=HISTORY)
        self.watchers: set[Watcher] = set()
        self.listeners: list[Callable[[Change], None]] = []

    # -- reads ------------------------------------------------------------------------------

    def get(self, resource: str, namespace: str, name: str) -> Obj | None:
        return self.objects.get(resource, {}).get((namespace, name))

    def items(self, resource: str, namespace: str | None = None) -> Iterator[Obj]:
        for (ns, _), obj in sorted(self.objects.get(resource, {}).items()):
            if namespace is None or ns == namespace:
                yield obj

    # -- writes -----------------------------------------------------------------------------

    def _commit(self, resource: str, type_: str, old: Obj | None, new: Obj) -> Obj:
        self.rv += 1
        new["metadata"]["resourceVersion"] = str(self.rv)
        snapshot = copy.deepcopy(new)
        change = Change(self.rv, resource, type_, old, snapshot)
        self.history.append(change)
        for watcher in list(self.watchers):
            event = watcher.translate(change)
            if event is not None:
                watcher.queue.put_nowait(event)
        for listener in self.listeners:
            listener(change)
        return new

    def create(self, resource: str, obj: Obj) -> Obj:
        meta = obj.setdefault("metadata", {})
        key = (meta.get("namespace", ""), meta["name"])
        meta["uid"] = new_uid()
        meta["creationTimestamp"] = now()
        self.objects.setdefault(resource, {})[key] = obj
        return self._commit(resource, "ADDED", None, obj)

    def update(self, resource: str, obj: Obj) -> Obj:
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        old = self.objects.get(resource, {}).get(key)
        if old is None:
            raise KeyError(key)
        snapshot_old = self.history_copy(resource, key)
        self.objects[resource][key] = obj
        return self._commit(resource, "MODIFIED", snapshot_old, obj)

    def modify(self, resource: str, namespace: str, name: str, mutate: Callable[[Obj], None]) -> Obj | None:
        """Apply ``mutate`` to the stored object and commit it as MODIFIED; None if it is gone."""
        obj = self.get(resource, namespace, name)
        if obj is None:
            return None
        new = copy.deepcopy(obj)
        mutate(new)
        if new == obj:
            return obj  # no change, no new resourceVersion (as an unchanged update on a real server)
        return self.update(resource, new)

    def delete(self, resource: str, namespace: str, name: str) -> Obj | None:
        obj = self.objects.get(resource, {}).pop((namespace, name), None)
        if obj is None:
            return None
        old = copy.deepcopy(obj)
        return self._commit(resource, "DELETED", old, obj)

    def history_copy(self, resource: str, key: tuple[str, str]) -> Obj | None:
        obj = self.objects.get(resource, {}).get(key)
        return copy.deepcopy(obj) if obj is not None else None

    # -- watches ----------------------------------------------------------------------------

    def watch(self, watcher: Watcher, resource_version: str | None) -> list[tuple[str, Obj]]:
        """Register ``watcher``; return the events to send first.

        No version (or "0"): every matching object as ADDED, then live changes.  A version:
        the changes after it from the history, or :class:`Expired` when it is too old.
        """
        initial: list[tuple[str, Obj]] = []
        if not resource_version or resource_version == "0":
            for obj in self.items(watcher.resource, watcher.namespace):
                if watcher.matches(obj):
                    initial.append(("ADDED", copy.deepcopy(obj)))
        else:
            try:
                since = int(resource_version)
            except ValueError as exc:
                raise ValueError(f"invalid resource version: {resource_version!r}") from exc
            oldest = self.history[0].rv if self.history else self.rv + 1
            if since < oldest - 1 and since < self.rv:
                raise Expired(f"too old resource version: {since} ({oldest - 1})")
            for change in self.history:
                if change.rv > since:
                    event = watcher.translate(change)
                    if event is not None:
                        initial.append(event)
        self.watchers.add(watcher)
        return initial

    def unwatch(self, watcher: Watcher) -> None:
        self.watchers.discard(watcher)

    def close_watches(self) -> None:
        for watcher in list(self.watchers):
            watcher.queue.put_nowait(None)
