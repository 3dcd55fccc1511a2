"""What every node and the client need to reach each other with host keys checked.

The same for every backend: the backend decides where the files land (the local backend
writes them into each node's home, which is on this machine's disk).  Every node gets the
cluster key, the same ``~/.ssh/config`` and ``known_hosts`` (so head -> worker works, and so
does worker -> worker, which mpirun's tree spawn uses), and a copy of the agent.
"""

from __future__ import annotations

from pathlib import Path

from pytest_sky.backends.base import NodeAddress
from pytest_sky.ssh import config as ssh_config
from pytest_sky.ssh.keys import ClusterKeys, known_hosts_lines, write_private

AGENT_PATH = "~/.sky/agent.py"
AGENT_SOURCE = Path(__file__).with_name("agent.py")


def node_names(cluster: str, node: NodeAddress) -> list[str]:
    names = [node.hostname, node.name]
    if node.rank == 0:
        names.insert(0, cluster)
    return names


def known_hosts(cluster: str, nodes: list[NodeAddress], keys: ClusterKeys) -> str:
    return known_hosts_lines([([*node_names(cluster, n), n.ip], keys.hosts[n.rank]) for n in nodes])


def node_files(cluster: str, nodes: list[NodeAddress], keys: ClusterKeys) -> dict[str, tuple[bytes, int]]:
    entries = [ssh_config.HostEntry(alias=" ".join(node_names(cluster, n)), hostname=n.ip) for n in nodes]
    cfg = ssh_config.render(
        entries,
        identity_file="~/.ssh/id_ed25519",
        known_hosts="~/.ssh/known_hosts",
        extra_patterns=["*"],
    )
    return {
        ".ssh/authorized_keys": (keys.cluster.public_line.encode() + b"\n", 0o600),
        ".ssh/id_ed25519": (keys.cluster.private_openssh, 0o600),
        ".ssh/id_ed25519.pub": (keys.cluster.public_line.encode() + b"\n", 0o644),
        ".ssh/config": (cfg.encode(), 0o600),
        ".ssh/known_hosts": (known_hosts(cluster, nodes, keys).encode(), 0o644),
        ".sky/agent.py": (AGENT_SOURCE.read_bytes(), 0o644),
    }


def write_client_files(
    cluster_dir: Path,
    cluster: str,
    nodes: list[NodeAddress],
    keys: ClusterKeys,
    dial: dict[int, tuple[str, int]],
    proxy_command: str | None = None,
) -> Path:
    """The client's key, known_hosts and ``ssh_config``; returns the config's path.

    ``dial`` maps rank -> (host, port) the client connects to.
    """
    key = cluster_dir / "id_ed25519"
    write_private(key, keys.cluster.private_openssh)
    kh = cluster_dir / "known_hosts"
    kh.write_text(known_hosts(cluster, nodes, keys))
    entries = []
    for n in nodes:
        host, port = dial[n.rank]
        alias = cluster if n.rank == 0 else n.hostname
        entries.append(ssh_config.HostEntry(alias=alias, hostname=host, port=port, proxy_command=proxy_command))
    cfg = cluster_dir / "ssh_config"
    cfg.write_text(ssh_config.render(entries, identity_file=str(key), known_hosts=str(kh)))
    return cfg
