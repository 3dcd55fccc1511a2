"""Events, recorded as client-go's event recorder records them (aggregated repeats,
names that sort in the order they happened)."""

from __future__ import annotations

import time

from kube_emulator import store
from kube_emulator.store import Obj, Store


class EventRecorder:
    """Records Events about objects of one store, for every component (scheduler, kubelet)."""

    def __init__(self, objects: Store) -> None:
        self.store = objects
        self._events: dict[tuple[str, str, str, str], tuple[str, str]] = {}
        self._last_event_ns = 0

    def record(
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
        now = store.now()
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
