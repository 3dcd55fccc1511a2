"""A pod's status as the kubelet writes it: container states, restart counts, conditions, IPs.

Each write is one ``Store.modify`` (one resourceVersion, one watch event), reading the
previous status so ``lastState``, ``restartCount`` and unchanged conditions' transition
times carry over as a real kubelet's status manager keeps them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from kube_emulator import store
from kube_emulator.pods import PodRuntime
from kube_emulator.store import Obj, Store


def modify(objects: Store, rt: PodRuntime, mutate: Callable[[Obj], None]) -> None:
    """Write ``rt``'s pod, if the object of that name is still this pod (by uid): a pod
    created again under the same name is not its predecessor's to write."""
    pod = objects.get("pods", rt.namespace, rt.name)
    if pod is not None and pod["metadata"]["uid"] == rt.uid:
        objects.modify("pods", rt.namespace, rt.name, mutate)


def _container_status(pod: Obj, rt: PodRuntime, **state: Any) -> dict[str, Any]:
    container = pod["spec"]["containers"][0]
    image = container.get("image", "")
    pulled = bool(rt.container_id)
    return {
        "name": container["name"],
        "image": image,
        "imageID": f"{image}@sha256:{hashlib.sha256(image.encode()).hexdigest()}" if pulled else "",
        **state,
    }


def set_container(
    objects: Store,
    rt: PodRuntime,
    *,
    waiting: dict[str, Any] | None = None,
    terminated: dict[str, Any] | None = None,
    running: bool = False,
) -> None:
    now = store.now()

    def mutate(pod: dict[str, Any]) -> None:
        status = pod.setdefault("status", {})
        previous = (status.get("containerStatuses") or [{}])[0]
        last_state = previous.get("lastState") or {}
        restarts = previous.get("restartCount", 0)
        if waiting is not None:
            state: dict[str, Any] = {"waiting": waiting}
            if previous.get("state", {}).get("terminated"):
                last_state = {"terminated": previous["state"]["terminated"]}
        else:
            term = {
                "startedAt": rt.started_at or None,
                "finishedAt": now,
                "containerID": rt.container_id or None,
                **(terminated or {}),
            }
            state = {"terminated": term}
        cs = _container_status(
            pod,
            rt,
            ready=False,
            started=False,
            restartCount=restarts,
            state=state,
            lastState=last_state,
        )
        if rt.container_id:
            cs["containerID"] = rt.container_id
        status["containerStatuses"] = [cs]
        conditions(pod, now, ready=False, reason="ContainersNotReady", containers=[cs["name"]])

    modify(objects, rt, mutate)


def set_running(objects: Store, rt: PodRuntime, host_ip: str) -> None:
    """The container runs: Ready, with its addresses."""
    now = store.now()

    def mutate(pod: dict[str, Any]) -> None:
        status = pod.setdefault("status", {})
        previous = (status.get("containerStatuses") or [{}])[0]
        restarts = previous.get("restartCount", 0)
        last_state = previous.get("lastState") or {}
        prev_state = previous.get("state") or {}
        if prev_state.get("terminated"):
            last_state = {"terminated": prev_state["terminated"]}
        if rt.exits:
            restarts = rt.exits
        cs = _container_status(
            pod,
            rt,
            ready=True,
            started=True,
            restartCount=restarts,
            state={"running": {"startedAt": rt.started_at}},
            lastState=last_state,
            containerID=rt.container_id,
        )
        status["containerStatuses"] = [cs]
        status["phase"] = "Running"
        status.setdefault("startTime", now)
        set_ips(pod, rt.ip, host_ip)
        conditions(pod, now, ready=True)

    modify(objects, rt, mutate)


def set_phase_done(objects: Store, rt: PodRuntime, code: int) -> None:
    """The container exited for good (its restart policy says so): Succeeded or Failed."""
    now = store.now()

    def mutate(pod: dict[str, Any]) -> None:
        status = pod["status"]
        status["phase"] = "Succeeded" if code == 0 else "Failed"
        conditions(pod, now, ready=False, reason="PodCompleted" if code == 0 else "PodFailed")

    modify(objects, rt, mutate)


def set_failed(objects: Store, rt: PodRuntime, reason: str, message: str) -> None:
    """The kubelet ended the pod itself (its active deadline): Failed, with why."""
    now = store.now()

    def mutate(pod: dict[str, Any]) -> None:
        status = pod.setdefault("status", {})
        status.update(phase="Failed", reason=reason, message=message)
        conditions(pod, now, ready=False, reason="PodFailed")

    modify(objects, rt, mutate)


def set_start_time(objects: Store, rt: PodRuntime) -> None:
    """The kubelet took the pod: its startTime, from which its active deadline counts."""
    now = store.now()
    modify(objects, rt, lambda pod: pod.setdefault("status", {}).setdefault("startTime", now))


def set_ips(pod: dict[str, Any], ip: str | None, host_ip: str) -> None:
    status = pod.setdefault("status", {})
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    status["hostIP"] = host_ip
    status["hostIPs"] = [{"ip": host_ip}]


def conditions(
    pod: dict[str, Any],
    now: str,
    *,
    ready: bool,
    reason: str | None = None,
    containers: list[str] | None = None,
) -> None:
    """Set the kubelet's pod conditions, keeping lastTransitionTime when a status is unchanged."""
    status = pod.setdefault("status", {})
    existing = {c["type"]: c for c in status.get("conditions") or []}
    ready_s = "True" if ready else "False"
    wanted: dict[str, tuple[str, str | None, str | None]] = {
        "PodReadyToStartContainers": ("True", None, None),
        "Initialized": ("True", None, None),
        "Ready": (ready_s, reason, None),
        "ContainersReady": (ready_s, reason, None),
        "PodScheduled": ("True", None, None),
    }
    if not ready and reason == "ContainersNotReady" and containers:
        msg = f"containers with unready status: [{' '.join(containers)}]"
        wanted["Ready"] = (ready_s, reason, msg)
        wanted["ContainersReady"] = (ready_s, reason, msg)
    out = []
    for type_, (value, why, message) in wanted.items():
        old = existing.get(type_)
        cond: dict[str, Any] = {"type": type_, "status": value, "lastProbeTime": None}
        cond["lastTransitionTime"] = old["lastTransitionTime"] if old and old.get("status") == value else now
        if why:
            cond["reason"] = why
        if message:
            cond["message"] = message
        out.append(cond)
    status["conditions"] = out
