"""A path as a node sees it, inside its own root: where its mounts go.

Standard library only, importing nothing of pytest-sky: ``nodeinit`` (a node's start) runs as
a program of its own and imports this file from its directory.
"""

from __future__ import annotations

import errno
import os


def within(root: str, path: str) -> str:
    """``path`` as the node sees it, resolved inside ``root``: each symlink on the way is
    followed there (an absolute one from ``root``), never out onto the host's tree, as a
    runtime resolves a mount's destination in a container's root (runc's securejoin).  An
    image's ``/var/run -> /run`` would otherwise lead a mount, and the directories made for
    it, onto the host's ``/run``."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    resolved, hops = "", 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            resolved = resolved.rsplit("/", 1)[0]
            continue
        candidate = f"{resolved}/{part}"
        if not os.path.islink(root + candidate):
            resolved = candidate
            continue
        hops += 1
        if hops > 40:
            raise OSError(errno.ELOOP, f"{path}: too many symbolic links in the node's root")
        link = os.readlink(root + candidate)
        parts = [p for p in link.split("/") if p not in ("", ".")] + parts
        if link.startswith("/"):
            resolved = ""
    return root + (resolved or "/")
