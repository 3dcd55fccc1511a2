"""Node cgroups on the host: one per node, so one write kills everything the node started."""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from pytest_sky.backends.netns.links import LINK_PREFIX, link_exists


@functools.lru_cache(maxsize=1)
def cgroup2_root() -> Path | None:
    """Where this host's cgroup v2 hierarchy is mounted, if we may create cgroups in it.

    Most hosts mount it on ``/sys/fs/cgroup``; hybrid ones (v1 controllers beside it) on
    ``/sys/fs/cgroup/unified``: ``/proc/mounts`` says which.
    """
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup2" and "ro" not in fields[3].split(","):
            root = Path(fields[1].replace("\\040", " "))
            if os.access(root / "cgroup.procs", os.W_OK) and os.access(root, os.W_OK):
                return root
    return None


def node_cgroup(name: str) -> Path | None:
    """The host-side cgroup of the node whose veth is ``name`` (unique while the link is ours)."""
    root = cgroup2_root()
    return root / name if root is not None else None


def orphaned_cgroups() -> list[Path]:
    """Node cgroups whose cluster's bridge is gone.  A node's cgroup lives inside its bridge's
    lifetime (made after it, removed before it), so one without it is a leftover, whoever's."""
    root = cgroup2_root()
    if root is None:
        return []
    out = []
    for path in sorted(root.glob(f"{LINK_PREFIX}*")):
        match = re.fullmatch(rf"({LINK_PREFIX}\d+)[np]\d+", path.name)
        if match and path.is_dir() and not link_exists(match.group(1)):
            out.append(path)
    return out


def make_cgroup(path: Path) -> bool:
    """Create a node's cgroup, empty; False where this host will not give us one."""
    try:
        path.mkdir()
    except FileExistsError:
        kill_cgroups([path])  # a leftover of a killed run under the same (leased) name
        try:
            path.mkdir()
        except OSError:
            return False
    except OSError:
        return False
    return True


def remove_empty_cgroup(path: Path) -> bool:
    """Remove a cgroup that no process is in, with the cgroups below it (those its node's
    jobs made), innermost first; False when a process is still in it (a live node's)."""
    if _populated(path):
        return False
    try:
        for sub in _cgroup_tree(path):
            sub.rmdir()
    except FileNotFoundError:
        return not path.exists()
    except OSError:
        return False
    return True


def _populated(path: Path) -> bool:
    """Whether a process (not a zombie) is in the cgroup or below: ``cgroup.events``' key."""
    try:
        lines = (path / "cgroup.events").read_text().splitlines()
    except OSError:
        return False
    fields = dict(line.split(maxsplit=1) for line in lines if " " in line)
    return fields.get("populated", "0").strip() == "1"


def kill_cgroups(paths: Sequence[Path | str | None], timeout: float = 10.0) -> list[str]:
    """Kill every process in each cgroup and its descendants (one write each), wait until
    they are empty and remove them, innermost first; returns those still there at the deadline."""
    live = signal_cgroups(paths)
    deadline = time.monotonic() + timeout
    left = []
    for path in live:
        for sub in _cgroup_tree(path):
            if not _remove_cgroup(sub, deadline):
                left.append(str(sub))
    return left


def signal_cgroups(paths: Sequence[Path | str | None]) -> list[Path]:
    """SIGKILL every process in each cgroup and below it, waiting for none of them (one
    write each: ``cgroup.kill``); returns the cgroups that exist."""
    live = [Path(p) for p in paths if p and os.path.isdir(p)]
    for path in live:
        try:
            (path / "cgroup.kill").write_text("1")
        except OSError:  # before Linux 5.14: signal each member until none is left
            for sub in _cgroup_tree(path):
                _kill_members(sub)
    return live


def _cgroup_tree(path: Path) -> list[Path]:
    """``path`` and every cgroup below it, deepest first (the order rmdir needs)."""
    tree = [Path(top) / d for top, dirs, _ in os.walk(path) for d in dirs]
    return [*sorted(tree, key=lambda p: len(p.parts), reverse=True), path]


def _remove_cgroup(path: Path, deadline: float) -> bool:
    delay = 0.001
    while True:
        try:
            path.rmdir()  # fails while a process (not a zombie) is still in it
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
        if _populated(path):
            _kill_members(path)
        time.sleep(delay)  # the kernel frees exiting tasks asynchronously
        delay = min(delay * 2, 0.02)


def _kill_members(path: Path) -> None:
    try:
        pids = (path / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
