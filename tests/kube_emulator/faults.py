"""Injected faults: what a real cluster does to the backend on a bad day, on demand.

Set at start-up (``--fault-*`` flags, :class:`tests.kube_emulator.Emulator` keyword) or at
run time through ``POST /emulator/faults`` with a JSON object of these keys; a key set to
``null`` clears that fault, ``{"reset": true}`` clears them all:

- ``pending``: glob(s) of pod names that stay Pending (Unschedulable, a FailedScheduling
  event naming an untolerated taint ``emulator.pytest-sky/fault``).
- ``image_pull``: glob(s) of pod names or images whose pull fails (ErrImagePull, then
  ImagePullBackOff, with Failed/BackOff events); the pod stays Pending.
- ``crash``: glob(s) of pod names whose container exits 1 at once instead of running its
  command (phase Failed, or CrashLoopBackOff under restartPolicy Always).
- ``drop_portforward_after_bytes``: every new port-forward is closed once this many bytes
  have crossed it (both directions together).
- ``drop_portforwards``: an action, not a setting: ``true`` closes every open port-forward now.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GLOB_KEYS = ("pending", "image_pull", "crash")
KEYS = (*GLOB_KEYS, "drop_portforward_after_bytes", "drop_portforwards", "reset")


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
    drop_portforward_after_bytes: int | None = None

    def update(self, data: Mapping[str, Any]) -> bool:
        """Apply a ``POST /emulator/faults`` body; returns whether open port-forwards must drop now."""
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise ValueError(f"unknown fault key(s) {', '.join(unknown)}; allowed: {', '.join(KEYS)}")
        if data.get("reset"):
            self.pending, self.image_pull, self.crash = [], [], []
            self.drop_portforward_after_bytes = None
        for key in GLOB_KEYS:
            if key in data:
                setattr(self, key, _globs(data[key], key))
        if "drop_portforward_after_bytes" in data:
            value = data["drop_portforward_after_bytes"]
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"drop_portforward_after_bytes takes a byte count or null, got {value!r}")
            self.drop_portforward_after_bytes = value
        return bool(data.get("drop_portforwards"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "pending": self.pending,
            "image_pull": self.image_pull,
            "crash": self.crash,
            "drop_portforward_after_bytes": self.drop_portforward_after_bytes,
        }

    def matches(self, kind: str, pod: Mapping[str, Any]) -> bool:
        globs: list[str] = getattr(self, kind)
        if not globs:
            return False
        names = [pod["metadata"]["name"]]
        if kind == "image_pull":
            names += [c.get("image") or "" for c in pod["spec"].get("containers") or []]
        return any(fnmatch.fnmatchcase(n, g) for n in names for g in globs)
