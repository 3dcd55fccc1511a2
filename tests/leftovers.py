"""What a torn-down cluster may have left, told apart from what other clusters hold.

A link is ours by the directory its alias names, never by its name alone: subnet indexes are
free the moment a cluster is gone, so under xdist another worker's launch can make a link of
the very same name straight away (a fresh-clone CI run once failed that way).  A node process
is ours by its pid *and* start time.  A module, not a test module, so that test modules share
these without importing each other.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from pytest_sky import procs
from pytest_sky.doctor import link_owners
from pytest_sky.locks import flocked


def our_links(owner: Path | str) -> list[str]:
    """Our links whose alias is ``owner`` (a state or cluster directory) or lies under it."""
    top = str(owner).rstrip("/")
    return sorted(n for n, alias in link_owners().items() if alias == top or alias.startswith(top + "/"))


def live_nodes(journal_data: dict) -> list[int]:
    """The pids of a local cluster's node processes (from its journal) that still run."""
    return [n["pid"] for n in journal_data.get("nodes", []) if procs.is_alive(n["pid"], n.get("start_time"))]


def processes_mentioning(text: str) -> list[str]:
    """Live processes, other than this one, whose command line contains ``text`` (zombies have none)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline.strip()}")
    return found


@contextlib.contextmanager
def host_settings_lock() -> Iterator[None]:
    """Held by a test that changes the host's forwarding for a while (as a Docker host has
    it) and by one that checks nothing of ours changes it: under xdist they would see each
    other's change."""
    with flocked(Path(__file__).parent):  # a directory's own lock: no lock file is left behind
        yield
