"""What every node and the client need to reach each other with host keys checked.

The same for every backend: the backend decides how the files land (the local backend
writes them into each node's home on disk, the Kubernetes one through a Secret and an exec).
Every node gets the cluster key and a copy of the agent before its sshd starts
(:func:`home_files`), then, once every address is known, the same ``~/.ssh/config`` and
``known_hosts`` (:func:`peer_files`: head -> worker works, and so does worker -> worker,
which mpirun's tree spawn uses).
"""

from __future__ import annotations

from pathlib import Path

from pytest_sky.backends.base import HomeFiles
from pytest_sky.cluster_info import NodeInfo
from pytest_sky.ssh import config as ssh_config
from pytest_sky.ssh.keys import ClusterKeys, known_hosts_lines, write_private

AGENT_PATH = "~/.sky/agent.py"
AGENT_SOURCE = Path(__file__).with_name("agent.py")


def node_names(cluster: str, node: NodeInfo) -> list[str]:
    names = [node.hostname, node.name]
    if node.rank == 0:
        names.insert(0, cluster)
    return names


def known_hosts(cluster: str, nodes: list[NodeInfo], keys: ClusterKeys) -> str:
    return known_hosts_lines([([*node_names(cluster, n), n.ip], keys.hosts[n.rank]) for n in nodes])


def home_files(keys: ClusterKeys) -> HomeFiles:
    """What a node's home needs before its sshd starts: the cluster key, and the agent."""
    return {
        ".ssh/authorized_keys": (keys.cluster.public_line.encode() + b"\n", 0o600),
        ".ssh/id_ed25519": (keys.cluster.private_openssh, 0o600),
        ".ssh/id_ed25519.pub": (keys.cluster.public_line.encode() + b"\n", 0o644),
        ".sky/agent.py": (AGENT_SOURCE.read_bytes(), 0o644),
    }


def peer_files(cluster: str, nodes: list[NodeInfo], keys: ClusterKeys) -> HomeFiles:
    """Every peer by name and IP, with its host key: written once every address is known."""
    entries = [ssh_config.HostEntry(alias=" ".join(node_names(cluster, n)), hostname=n.ip) for n in nodes]
    cfg = ssh_config.render(
        entries,
        identity_file="~/.ssh/id_ed25519",
        known_hosts="~/.ssh/known_hosts",
        extra_patterns=["*"],
    )
    return {
        ".ssh/config": (cfg.encode(), 0o600),
        ".ssh/known_hosts": (known_hosts(cluster, nodes, keys).encode(), 0o644),
    }


def control_dir() -> str:
    """Where multiplexed client connections keep their sockets: short, whatever the state
    directory (a socket path must fit in 108 bytes); %C makes each connection's name unique."""
    return "/tmp"


def start_master(ssh_config_path: Path, cluster: str) -> None:
    """Open the shared connection now, so a burst of clients never races to become master."""
    import subprocess

    subprocess.run(
        ["ssh", "-F", str(ssh_config_path), cluster, "true"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        check=False,
    )


def stop_master(ssh_config_path: Path, cluster: str) -> None:
    """Close the shared client connection (if any) before its cluster goes away."""
    import subprocess

    if not ssh_config_path.exists() or "ControlMaster" not in ssh_config_path.read_text():
        return
    subprocess.run(
        ["ssh", "-F", str(ssh_config_path), "-O", "exit", cluster],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=30,
        check=False,
    )


def write_client_files(
    cluster_dir: Path,
    cluster: str,
    nodes: list[NodeInfo],
    keys: ClusterKeys,
    *,
    multiplex: bool = False,
) -> Path:
    """The client's key, known_hosts and ``ssh_config``; returns the config's path.

    Each node is dialled by its route; host keys are checked under the node's name
    (``HostKeyAlias``), whatever the route.
    """
    key = cluster_dir / "id_ed25519"
    write_private(key, keys.cluster.private_openssh)
    kh = cluster_dir / "known_hosts"
    kh.write_text(known_hosts(cluster, nodes, keys))
    entries = []
    for n in nodes:
        alias = cluster if n.rank == 0 else n.hostname
        r = n.route
        entries.append(
            ssh_config.HostEntry(
                alias=alias,
                hostname=r.hostname,
                port=r.port,
                proxy_command=r.proxy_command,
                proxy_jump=r.proxy_jump,
                host_key_alias=n.hostname,
            )
        )
    cfg = cluster_dir / "ssh_config"
    cfg.write_text(
        ssh_config.render(
            entries, identity_file=str(key), known_hosts=str(kh), control_dir=control_dir() if multiplex else None
        )
    )
    return cfg
