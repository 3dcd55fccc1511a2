"""Injected faults: what a real cluster does to the backend on a bad day, on demand.

Set at start-up (``--fault-*`` flags, :class:`kube_emulator.Emulator` keyword) or at
run time through ``POST /emulator/faults`` with a JSON object of these keys; a key set to
``null`` clears that fault, ``{"reset": true}`` clears them all:

- ``pending``: glob(s) of pod names that stay Pending (Unschedulable, a FailedScheduling
  event naming an untolerated taint ``emulator.pytest-sky/fault``).
- ``image_pull``: glob(s) of pod names or images whose pull fails (ErrImagePull, then
  ImagePullBackOff, with Failed/BackOff events); the pod stays Pending.
- ``crash``: glob(s) of pod names whose container exits 1 at once instead of running its
  command (phase Failed, or CrashLoopBackOff under restartPolicy Always).
- ``delete_pod``: glob(s) of pod names deleted (as ``kubectl delete pod`` does, with the pod's
  grace period) as soon as their kubelet takes them, before their container starts: someone
  else deleting a pod while its launch waits for it.
- ``create_container_config_error``: glob(s) of pod names whose container cannot be
  configured (waiting reason CreateContainerConfigError, a Failed event naming a missing
  Secret, as for an env var from a Secret that does not exist); the pod stays Pending.
- ``run_container_error``: glob(s) of pod names whose container the runtime fails to start
  (waiting reason RunContainerError, a Failed event with the runtime's error); the pod stays
  Pending.
- ``failed_mount``: glob(s) of pod names whose first volume fails to mount as if its Secret
  or claim did not exist (FailedMount events every 2 s; the pod stays ContainerCreating,
  with no waiting reason of its own: only the events say why).
- ``expire_watches``: this many of the next watches that ask for a resourceVersion are
  answered 410 Gone ("too old resource version", as after an etcd compaction), alternately
  as an HTTP 410 and, as the watch cache does, as a 200 whose first event is an ERROR with
  code 410; counts down to 0.
- ``drop_portforward_after_bytes``: every new port-forward is reset (a TCP RST, as a load
  balancer's or a restarting API server's drop) once this many bytes have crossed it (both
  directions together).
- ``drop_portforwards``: an action, not a setting: ``true`` resets every open port-forward now.
- ``kubelet_delay``: seconds the kubelet takes to act on a pod's deletion (default 0).  A
  real kubelet learns of it through its watch and stops the container on its own schedule:
  a force-deleted pod's object is gone at once while its container runs on that long, and a
  gracefully deleted one's object stays, Terminating, until the container has stopped.
"""

from __future__ import annotations

import asyncio
import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GLOB_KEYS = (
    "pending",
    "image_pull",
    "crash",
    "delete_pod",
    "create_container_config_error",
    "run_container_error",
    "failed_mount",
)
COUNT_KEYS = ("drop_portforward_after_bytes", "expire_watches")
SECONDS_KEYS = ("kubelet_delay",)
KEYS = (*GLOB_KEYS, *COUNT_KEYS, *SECONDS_KEYS, "drop_portforwards", "reset")


def _globs(value: Any, key: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"fault {key!r} takes a glob or a list of globs, got {value!r}")


@dataclass
class Faults:
    """The faults in force.  Globs match a pod's name (or, for image pulls, its image too)."""

    pending: list[str] = field(default_factory=list)
    image_pull: list[str] = field(default_factory=list)
    crash: list[str] = field(default_factory=list)
    delete_pod: list[str] = field(default_factory=list)
    create_container_config_error: list[str] = field(default_factory=list)
    run_container_error: list[str] = field(default_factory=list)
    failed_mount: list[str] = field(default_factory=list)
    drop_portforward_after_bytes: int | None = None
    expire_watches: int | None = None
    kubelet_delay: float | None = None

    def update(self, data: Mapping[str, Any]) -> bool:
        """Apply a ``POST /emulator/faults`` body; returns whether open port-forwards must drop now."""
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise ValueError(f"unknown fault key(s) {', '.join(unknown)}; allowed: {', '.join(KEYS)}")
        if data.get("reset"):
            for key in GLOB_KEYS:
                setattr(self, key, [])
            for key in (*COUNT_KEYS, *SECONDS_KEYS):
                setattr(self, key, None)
        for key in GLOB_KEYS:
            if key in data:
                setattr(self, key, _globs(data[key], key))
        for key in COUNT_KEYS:
            if key in data:
                value = data[key]
                if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                    raise ValueError(f"{key} takes a count or null, got {value!r}")
                setattr(self, key, value)
        for key in SECONDS_KEYS:
            if key in data:
                value = data[key]
                if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
                    raise ValueError(f"{key} takes a number of seconds or null, got {value!r}")
                setattr(self, key, None if value is None else float(value))
        return bool(data.get("drop_portforwards"))

    def take_expired_watch(self) -> str | None:
        """Whether this watch is to expire, and how: "status" (HTTP 410) or "event" (an ERROR)."""
        if not self.expire_watches:
            return None
        left, self.expire_watches = self.expire_watches, self.expire_watches - 1
        return "status" if left % 2 == 0 else "event"

    def as_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in (*GLOB_KEYS, *COUNT_KEYS, *SECONDS_KEYS)}

    def matches(self, kind: str, pod: Mapping[str, Any]) -> bool:
        globs: list[str] = getattr(self, kind)
        if not globs:
            return False
        names = [pod["metadata"]["name"]]
        if kind == "image_pull":
            names += [c.get("image") or "" for c in pod["spec"].get("containers") or []]
        return any(fnmatch.fnmatchcase(n, g) for n in names for g in globs)


class DroppableSession:
    """What both port-forward forms (the Python client's websocket, kubectl's SPDY session)
    hold for the two faults that cut them: the bytes that crossed, against
    ``drop_portforward_after_bytes``, and ``dropped``, which ``drop_portforwards`` sets."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.bytes = 0
        self.dropped = asyncio.Event()

    def count(self, n: int) -> None:
        self.bytes += n
        if self.limit is not None and self.bytes >= self.limit:
            self.drop()

    def drop(self) -> None:
        self.dropped.set()
