"""The scheduler's loop: pending pods in creation order, each placed (``scheduler.py``
decides where it fits) and bound, or marked Unschedulable with the scheduler's message.

It runs on the event loop, woken by whatever may change a decision (a pod created or gone,
faults changed), as the real scheduler's queue is by cluster events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kube_emulator import scheduler, store
from kube_emulator.events import EventRecorder
from kube_emulator.faults import Faults
from kube_emulator.store import Obj, Store

log = logging.getLogger(__name__)

PENDING_TAINT = {"key": "emulator.pytest-sky/fault", "value": "pending", "effect": "NoSchedule"}


class SchedulerLoop:
    """Binds pending pods to nodes; ``bind`` hands a bound pod to the kubelet."""

    def __init__(self, objects: Store, faults: Faults, events: EventRecorder, bind: Callable[[Obj], None]) -> None:
        self.store = objects
        self.faults = faults
        self.events = events
        self.bind = bind
        self._queue: dict[tuple[str, str], str] = {}  # unscheduled pods, in creation order
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def enqueue(self, pod: Obj) -> None:
        """A new pod waits for a node."""
        meta = pod["metadata"]
        self._queue[(meta["namespace"], meta["name"])] = meta["uid"]
        self.trigger()

    def forget(self, namespace: str, name: str) -> None:
        self._queue.pop((namespace, name), None)

    def trigger(self) -> None:
        """Look at the pending pods again (one pass, however many triggers came meanwhile)."""
        if self._wake is not None:
            self._wake.set()

    async def _loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self._schedule_pending()
            except Exception:
                log.exception("emulated scheduler failed")

    def _schedule_pending(self) -> None:
        nodes = [scheduler.node_view(n) for n in self.store.items("nodes")]
        for key, uid in list(self._queue.items()):
            pod = self.store.get("pods", *key)
            if pod is None or pod["metadata"]["uid"] != uid or pod["metadata"].get("deletionTimestamp"):
                self._queue.pop(key, None)
                continue
            preset = pod["spec"].get("nodeName")
            if preset:
                # Bound by its creator (no scheduler involved): run it if that node exists.
                if any(n.name == preset for n in nodes):
                    self._queue.pop(key, None)
                    self.bind(pod)
                continue
            bound = [p for p in self.store.items("pods") if p["spec"].get("nodeName")]
            taint = PENDING_TAINT if self.faults.matches("pending", pod) else None
            decision = scheduler.schedule(pod, nodes, bound, extra_taint=taint)
            if decision.node is None:
                self._unschedulable(pod, decision.message)
                continue
            self._queue.pop(key, None)
            node = decision.node
            now = store.now()

            def assign(p: Obj, node: str = node, now: str = now) -> None:
                p["spec"]["nodeName"] = node
                conds = [c for c in p["status"].get("conditions") or [] if c["type"] != "PodScheduled"]
                conds.append(
                    {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
                )
                p["status"]["conditions"] = conds

            bound_pod = self.store.modify("pods", key[0], key[1], assign)
            if bound_pod is None:
                continue
            self.events.record(
                bound_pod,
                "Normal",
                "Scheduled",
                f"Successfully assigned {key[0]}/{key[1]} to {node}",
                component="default-scheduler",
            )
            self.bind(bound_pod)

    def _unschedulable(self, pod: Obj, message: str) -> None:
        conds = pod["status"].get("conditions") or []
        current = next((c for c in conds if c["type"] == "PodScheduled"), None)
        if current is None or current.get("message") != message:
            now = store.now()

            def mark(p: Obj) -> None:
                p["status"]["conditions"] = [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "lastProbeTime": None,
                        "lastTransitionTime": now,
                        "reason": "Unschedulable",
                        "message": message,
                    }
                ]

            pod = self.store.modify("pods", pod["metadata"]["namespace"], pod["metadata"]["name"], mark) or pod
        self.events.record(pod, "Warning", "FailedScheduling", message, component="default-scheduler")
