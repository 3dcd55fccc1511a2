"""Whose a bridge of ours is, and whether that owner still lives.

A bridge's alias names the directory of whoever leased it (``links.lease_subnet``): a
cluster's directory in some state directory, or an emulator's instance directory.  That
directory says who its owner is: a cluster's record (:class:`~pytest_sky.state.ClusterRecord`:
the process that launched it, and ``keep`` for a cluster kept on purpose), or an emulator's
(:data:`EMULATOR_RECORD`), whose owner is an :class:`OwnerProcess` (the emulator writes it
through its product module).  The nodes on a bridge die with its owner; the bridge, an object
of the host's network, does not, and when nobody uses its directory again (a test's temporary
state directory, an emulator's instance) nobody else would tear it down.  So the reaper judges
it by its owner's liveness (:func:`owner_gone`), never by its age.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_sky import procs
from pytest_sky.state import read_record

#: In an emulator's instance directory: its record (the emulator's ``leftovers.EmulatorRecord``),
#: whose owner part is an :class:`OwnerProcess`.
EMULATOR_RECORD = "emulator.json"


@dataclass(frozen=True)
class OwnerProcess:
    """The process a directory (and the bridge whose alias names it) belongs to, named for
    good: its pid with the kernel's start time, so that a recycled pid never passes for it."""

    pid: int
    start_time: int | None = None

    @classmethod
    def of_this_process(cls) -> OwnerProcess:
        return cls(pid=os.getpid(), start_time=procs.start_time(os.getpid()))

    def alive(self) -> bool:
        return procs.is_alive(self.pid, self.start_time)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start_time": self.start_time}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> OwnerProcess:
        """Also from a record with more fields (the emulator's: its bridge, its pods)."""
        start = data.get("start_time")
        return cls(pid=int(data.get("pid") or 0), start_time=int(start) if start is not None else None)

    @classmethod
    def read(cls, path: Path) -> OwnerProcess | None:
        """The owner a record at ``path`` names; None when there is none, or it names no process."""
        try:
            owner = cls.from_json(json.loads(path.read_text()))
        except (OSError, ValueError, TypeError, AttributeError):
            return None
        return owner if owner.pid > 0 else None


def owner_gone(directory: str) -> bool:
    """Whether whoever ``directory`` (a bridge's alias) belongs to is provably gone, and did not
    keep it on purpose: the directory itself is gone, or its record names a process that is
    no more (and, for a cluster, was not kept).  What cannot be read, or names no owner (a
    directory some test made its bridge's), is no proof: its bridge stays."""
    path = Path(directory)
    if not path.is_absolute():
        return False
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return _sees_the_hosts_files()
    except OSError:
        return False  # another user's, say: not ours to judge
    record = read_record(path, without_info=True)
    if record is not None:
        return record.orphaned
    owner = OwnerProcess.read(path / EMULATOR_RECORD)
    return owner is not None and not owner.alive()


def _sees_the_hosts_files() -> bool:
    """This process sees the files its host's processes see: a directory missing from a
    private view (a service's private ``/tmp``, in the host's network) may still be there
    for its owner.  Told by pid 1's mount namespace; where that is hidden from us (a
    sandbox's pid 1), nothing says the views differ."""
    try:
        return os.readlink("/proc/self/ns/mnt") == os.readlink("/proc/1/ns/mnt")
    except OSError:
        return True
