"""Stopping nodes: by pid (pidfds where the kernel has them), by cgroup, by command line."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pytest_sky import procs
from pytest_sky.backends.netns.cgroups import kill_cgroups, signal_cgroups
from pytest_sky.backends.netns.links import delete_cluster_links, delete_links
from pytest_sky.backends.netns.nodes import NodeProcess, NodeRecord
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
        ours = "psky-node:" in cmd or ("sshd" in cmd and "/nodes/" in cmd and "sshd_config" in cmd)
        if not ours or not procs.is_alive(pid):  # a zombie is dead for our purposes: pid 1 reaps late
            continue
        if marker_prefix and f"psky-node:{marker_prefix}" not in cmd and marker_prefix not in cmd:
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
