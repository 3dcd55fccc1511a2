"""Node names, written once: the head is rank 0, workers are ``worker<rank>``.

SkyPilot's names, which users type (``pytest-sky ssh c worker2``), grep their logs for and
find in hostnames; every backend, the CLI and the agent take them from here so that they
cannot drift apart.  Shipped inside the node agent (``python -I -S``): stdlib only, and no
imports at all.
"""

from __future__ import annotations

HEAD = "head"
WORKER = "worker"

#: Root's home on every node, the same path on each as on a cluster (SkyPilot's own pods use
#: it); not ``/root``, which on many hosts holds the very Python (pyenv, a venv) nodes run.
NODE_HOME = "/home/sky"
#: What every node mounts afresh for itself, whatever the host has there.
NODE_OWN_MOUNTS = ("/proc", "/sys", "/dev", "/run")


def role(rank: int) -> str:
    """``head`` for rank 0, ``worker`` for every other rank (the Kubernetes role label)."""
    return HEAD if rank == 0 else WORKER


def node_name(rank: int) -> str:
    """The node's short name: ``head``, ``worker1``, ``worker2``, ..."""
    return HEAD if rank == 0 else f"{WORKER}{rank}"


def node_hostname(cluster: str, rank: int) -> str:
    """The node's hostname (and pod name): ``<cluster>-head``, ``<cluster>-worker1``, ..."""
    return f"{cluster}-{node_name(rank)}"


def parse_node(text: str | None, num_nodes: int) -> int | None:
    """The rank a user means by ``text`` in a cluster of ``num_nodes``, or None for no such node.

    Nothing, ``head`` or ``0`` is the head; ``3`` or ``worker3`` is rank 3 when the cluster
    has it.  ``worker0`` is not a name (the head is not a worker).
    """
    if not text or text in (HEAD, "0"):
        return 0
    digits = text[len(WORKER) :] if text.startswith(WORKER) else text
    if not (digits.isascii() and digits.isdigit()):
        return None
    rank = int(digits)
    return rank if 0 < rank < num_nodes else None


def line_prefix(rank: int, name: str, pid: int, ip: str, num_nodes: int, task_name: str, setup: bool = False) -> str:
    """SkyPilot's prefixes of a rank's output lines, exactly: users grep their logs for them.
    Setup's lines say so, and a worker's its address, as sky's do."""
    if setup:
        return f"(setup pid={pid}) " if rank == 0 else f"(setup pid={pid}, ip={ip}) "
    if num_nodes == 1:
        return f"({task_name}, pid={pid}) "
    if rank == 0:
        return f"(head, rank=0, pid={pid}) "
    return f"({name}, rank={rank}, pid={pid}, ip={ip}) "
