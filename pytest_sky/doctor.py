"""What of pytest-sky is left on this machine: links, node processes, orphaned records.

Used by ``pytest-sky doctor`` and by this repository's own leak check after every test run.
Everything we create is recognisable by name: links start with ``psky``, every node's keeper
(the process outside it that its first process dies with) carries ``psky-node:<node dir>``
in its command line, and its sshd reads a config
from a node directory; a cluster's namespace holder (and its gateway's dialer) carries ``psky-cluster:<cluster dir>``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pytest_sky.backends import netns
from pytest_sky.backends.netns import LINK_PREFIX, link_alias
from pytest_sky.bootstrap import stale_control_sockets
from pytest_sky.ssh.kube_forwarder import SUFFIX as FORWARDER_SUFFIX


def leaked_links() -> list[str]:
    try:
        names = os.listdir("/sys/class/net")
    except OSError:
        return []
    return sorted(n for n in names if n.startswith(LINK_PREFIX))


def link_owners() -> dict[str, str]:
    """Our links, each with its owner (the cluster directory in the link's alias)."""
    owners = {n: link_alias(n) for n in leaked_links()}
    return {n: owner for n, owner in owners.items() if owner is not None}


def node_processes() -> list[tuple[int, str]]:
    """(pid, command line) of node processes: their keepers, spawners and sshds."""
    return netns.node_processes()


def node_cgroups() -> list[str]:
    """Node cgroups of ours on the host (named as their veths): each dies with its node."""
    root = netns.cgroup2_root()
    if root is None:
        return []
    return sorted(str(p) for p in root.glob(f"{LINK_PREFIX}*") if p.is_dir())


def leftovers(store_root: Path | None = None) -> list[str]:
    from pytest_sky.state import StateStore

    out = [f"link {name}" + (f" (cluster dir {owner})" if owner else "") for name, owner in link_owners().items()]
    out += [f"process {pid}: {cmd}" for pid, cmd in node_processes()]
    out += [f"process {pid}: a cluster's namespace holder (or its dialer)" for pid in netns.holder_processes()]
    out += [f"cgroup {path}" for path in node_cgroups()]
    for path in stale_control_sockets():
        if path.endswith(FORWARDER_SUFFIX):
            out.append(f"Kubernetes forwarder socket {path} (its forwarder is gone)")
        else:
            out.append(f"ssh control socket {path} (its master is gone)")
    try:
        store = StateStore(store_root)
        for record in store.records():
            if record.orphaned:
                out.append(f"record {record.name} (owner pid {record.owner_pid} is gone)")
        out += [f"files {path} (the process that was deleting or using them is gone)" for path in store.stale_trash()]
    except OSError:
        pass
    return out
