"""Stopping nodes: by pid (pidfds where the kernel has them), by cgroup, by command line."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pytest_sky import procs
from pytest_sky.backends.netns.cgroups import (
    kill_cgroups,
    node_cgroup,
    orphaned_cgroups,
    remove_empty_cgroup,
    signal_cgroups,
)
from pytest_sky.backends.netns.links import (
    LINK_PREFIX,
    bridge_owned_by,
    delete_cluster_links,
    delete_links,
    link_alias,
)
from pytest_sky.backends.netns.nodes import NODE_MARKER, NodeProcess, NodeRecord, abandoned
from pytest_sky.backends.netns.owners import owner_gone
from pytest_sky.backends.netns.userns import HOLDER_MARKER, holder_processes
from pytest_sky.procs import kill_and_wait

log = logging.getLogger(__name__)


def child_pid(pid: int) -> int:
    """The first child of ``pid`` (a node's keeper has one: the node's first process), or 0."""
    children = procs.children(pid)
    return children[0] if children else 0


def node_processes(marker_prefix: str = "") -> list[tuple[int, str]]:
    """(pid, command line) of node processes on this host: the nodes' keepers and the spawner
    that forked them (their command line carries ``psky-node:<node dir>``) and the nodes' sshds.
    With ``marker_prefix``, only the nodes whose directory starts with it."""
    found = []
    for pid in procs.pids():
        args = procs.cmdline(pid)
        cmd = " ".join(args).strip() if args else ""
        ours = NODE_MARKER in cmd or ("sshd" in cmd and "/nodes/" in cmd and "sshd_config" in cmd)
        if not ours or not procs.is_alive(pid):  # a zombie is dead for our purposes: pid 1 reaps late
            continue
        if marker_prefix and f"{NODE_MARKER}{marker_prefix}" not in cmd and marker_prefix not in cmd:
            continue
        found.append((pid, cmd[:200]))
    return found


def reap_nodes(
    recorded: Iterable[NodeRecord | Mapping[str, Any]], *, cgroups: Iterable[str | None] = (), node_dirs: str = ""
) -> None:
    """Kill nodes known only from a record, whose owner died: by their recorded cgroups, by
    their recorded pids (checked against their start times, so a recycled pid is safe), and
    by ``node_dirs`` (a node directory prefix) for nodes started but not yet recorded when
    the owner was killed: their command lines name their node directories.  A record may
    still come as the JSON object a NodeRecord writes (the emulator's own record does)."""
    pids: list[int] = []
    for node in recorded:
        record = node if isinstance(node, NodeRecord) else NodeRecord.from_json(node)
        pids += record.live_pids()
    if node_dirs:
        for pid, _ in node_processes(node_dirs):
            pids += [child_pid(pid), pid]
    kill_cgroups(list(cgroups))
    kill_and_wait(pids)


def stop_nodes(ip: str, nodes: Sequence[NodeProcess], *, bridge: str | None = None, host_links: bool = True) -> None:
    """Kill every node, then remove its links.

    A node dies by its cgroup (one write kills every process it ever started) and by its
    first process (which ends every process of its PID namespace, for a node without a
    cgroup); the last process leaving frees the network namespace, which the kernel does
    asynchronously and nothing of ours waits on: the processes, cgroups and links a later
    launch or the leak check sees are gone when this returns.  With ``bridge`` the whole
    cluster goes: the bridge and every veth on it in one deletion, last, so the bridge
    (the lease on the cluster's subnet and names) is free only once nothing else named
    after it is left (:func:`delete_cluster_links`).  Rootless nodes (``host_links=False``)
    have no link on the host: theirs go with their holder's network namespace.
    """
    signal_cgroups([n.cgroup for n in nodes])
    survivors = kill_and_wait([n.init_pid for n in nodes if n.init_pid] + [n.pid for n in nodes])
    stuck = kill_cgroups([n.cgroup for n in nodes])
    if host_links and bridge:
        delete_cluster_links(ip, bridge, [n.veth for n in nodes])
    elif host_links:
        delete_links(ip, [n.veth for n in nodes])
    if survivors:
        log.warning("node processes still alive after SIGKILL: %s", survivors)
    if stuck:
        log.warning("node cgroups not removed: %s", stuck)


def reap_abandoned(ip: str, clusters_dir: Path) -> list[str]:
    """Kill the nodes that no record owns (:func:`abandoned`), then delete their links and
    cgroups; what went, for the reaper's report.  The nodes are told by the markers their
    keepers carry (``psky-node:<node dir>``), their links by their aliases."""
    pids, gone = [], []
    for pid, _ in node_processes():
        dirs = [a.removeprefix(NODE_MARKER) for a in procs.cmdline(pid) or [] if a.startswith(NODE_MARKER)]
        if dirs and all(abandoned(d, clusters_dir) for d in dirs):
            pids += [child_pid(pid), pid]
            gone.append(f"node process {pid}")
    kill_and_wait([p for p in pids if p])
    links = [n for n in sorted(os.listdir("/sys/class/net")) if re.fullmatch(rf"{LINK_PREFIX}\d+[np]?\d*", n)]
    owned = {n: link_alias(n) for n in links}
    doomed = [n for n, owner in owned.items() if owner and abandoned(owner, clusters_dir)]
    kill_cgroups([node_cgroup(n) for n in doomed])
    delete_links(ip, doomed)
    return gone + [f"link {n}" for n in doomed]


def reap_stray_bridges(ip: str) -> list[str]:
    """Delete the bridges of ours that nobody will ever tear down, whoever's they were: no
    port on them (no node of theirs left) and an owner that is provably gone
    (:func:`owner_gone`), or no owner named at all (a creator that died between making and
    naming it); then the empty node cgroups whose bridge is gone (a node's cgroup lives
    inside its bridge's lifetime); what went, for the reaper's report.  A live owner's
    bridge stays, ports or not (a stopped cluster's, a launch's before its nodes start), and
    so does a kept cluster's.  The caller holds the exclusive :func:`link_lock`: creators
    name their bridges under the shared one, so an unnamed bridge seen here is no creator's
    at work.  A process that may not delete the host's links (a rootless one) leaves them all."""
    if not procs.holds_root_caps():
        return []
    doomed = []
    for name in sorted(os.listdir("/sys/class/net")):
        if not re.fullmatch(rf"{LINK_PREFIX}\d+", name) or _has_ports(name):
            continue
        owner = link_alias(name)  # None: deleted since the listing, by its own teardown
        if owner == "" or (owner and owner_gone(owner)):
            doomed.append(name)
    delete_links(ip, doomed)
    cgroups = [p for p in orphaned_cgroups() if remove_empty_cgroup(p)]  # a populated one is a live node's
    return [f"link {n}" for n in doomed] + [f"cgroup {p.name}" for p in cgroups]


def _has_ports(bridge: str) -> bool:
    """Whether anything is attached to ``bridge`` (one gone since the listing counts as busy)."""
    try:
        return any(os.scandir(f"/sys/class/net/{bridge}/brif"))
    except OSError:
        return True


def reap_ownerless_holders(ip: str | None) -> list[str]:
    """Kill the namespace holders on this machine that nobody will ever stop, whoever's they
    were: no node of theirs left, and an owner that is provably gone (:func:`owner_gone`:
    its directory gone, or a record naming a dead owner that did not keep it).  A run
    SIGKILLed with a state directory nobody uses again (a test's temporary one) leaves its
    holder, and with it the cluster's bridge and root's link into its namespace, and no
    reaper of that directory ever runs.  Only holders this process may signal (root: all; a
    user: their own).  With ``ip`` (root's), the host's link into each such namespace is
    deleted too, at once rather than whenever the kernel frees the dead namespace; what
    went, for the reaper's report."""
    doomed: dict[int, str] = {}
    for pid in holder_processes():
        marker = next((a for a in procs.cmdline(pid) or [] if a.startswith(HOLDER_MARKER)), None)
        if marker is None or not (procs.holds_root_caps() or _uid_of(pid) == os.getuid()):
            continue
        cluster_dir = marker.removeprefix(HOLDER_MARKER)
        # Its directory as the holder sees it: a launch in a mount namespace of its own (a
        # state directory on a private overlay) has one this process may not see.
        gone = not node_processes(f"{cluster_dir}/") and owner_gone(f"/proc/{pid}/root{cluster_dir}")
        if gone and marker in (procs.cmdline(pid) or []):  # still that holder: not one gone since
            doomed[pid] = cluster_dir
    kill_and_wait(list(doomed))
    links = [link for link in map(bridge_owned_by, sorted(set(doomed.values()))) if link] if ip else []
    if ip and links:
        delete_links(ip, links)
    return [f"namespace holder {pid}" for pid in doomed] + [f"link {link}" for link in links]


def _uid_of(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
