"""What provisioning returns: per rank, everything the client needs afterwards.

A backend's ``create`` ends with a :class:`ClusterInfo` (SkyPilot's provisioners do the same
with theirs): each node's name, hostname and internal IP, how the client reaches its sshd,
and the environment the backend gives it.  From then on nothing asks the backend again: the
run path, the CLI of another process and the reaper work from this value, saved in the
cluster's record.  Plain data, so it lives below everything that passes it around.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class PortForward:
    """A pod's port reached through the Kubernetes API server, as ``kubectl port-forward`` does.

    What the ProxyCommand of an OpenSSH config says as a command line, for a client that
    opens the forward itself (the client's own connection does, in its process: a proxy
    process costs most of a CPU second to start)."""

    namespace: str
    pod: str
    port: int = 22
    kubeconfig: str | None = None
    context: str | None = None  # None: the kubeconfig's current one, or the pod's own account


@dataclass(frozen=True)
class SshRoute:
    """How the client dials one node's sshd (the fields of its ``Host`` block)."""

    hostname: str
    port: int = 22
    proxy_command: str | None = None  # where the node is not directly reachable (a port-forward)
    proxy_jump: str | None = None  # the alias of the node to hop through (workers behind a head)
    #: The same port-forward as ``proxy_command``, for a client that opens it in-process.
    port_forward: PortForward | None = None
    #: The cluster's forwarder (``ssh.kube_forwarder``), which opens that port-forward for a
    #: client that asks it, so the client need not load the kubernetes client itself.
    dial_socket: str | None = None
    #: Who logs in: root, or on a rootless local cluster the user who launched it.
    user: str = "root"
    #: A rootless local cluster's door (``backends.clusterns``): its holder connects to
    #: ``hostname:port`` inside the cluster's network and hands back the socket.  The
    #: ProxyCommand does the same and passes the socket to ssh (``ProxyUseFdpass``).
    door: str | None = None

    @property
    def proxy_passes_socket(self) -> bool:
        """Whether the ProxyCommand hands ssh a connected socket and exits (``ProxyUseFdpass``):
        a rootless door's dialler and a Kubernetes forwarder's (``ssh.kube_dial``) do."""
        return self.proxy_command is not None and (self.door is not None or self.dial_socket is not None)

    @classmethod
    def from_dict(cls, data: Mapping) -> SshRoute:
        forward = data.get("port_forward")
        return cls(**{**data, "port_forward": PortForward(**forward) if forward else None})


@dataclass(frozen=True)
class NodeInfo:
    rank: int
    name: str  # "head", "worker1", ...
    hostname: str  # "<cluster>-head", "<cluster>-worker1", ...
    ip: str  # internal address: what SKYPILOT_NODE_IPS lists
    route: SshRoute
    #: What this node's ranks get from the backend, e.g. its GPU share (CUDA_VISIBLE_DEVICES);
    #: the task's own envs win over it.
    env: Mapping[str, str] = field(default_factory=dict)
    #: How the head starts a process on this node where each rank must be a job step of the
    #: node's allocation (Slurm: ``srun --jobid ... --nodelist <node>``), the command following
    #: these words; empty: the head reaches the node's agent server, or it over SSH.
    step: tuple[str, ...] = ()


@dataclass(frozen=True)
class ClusterInfo:
    nodes: tuple[NodeInfo, ...]
    python: str = "python3"  # the nodes' interpreter, which runs the agent
    #: What every rank gets from the backend (the local one puts the test's interpreter
    #: first on PATH); the task's envs and ``env=`` win over it.
    env: Mapping[str, str] = field(default_factory=dict)
    #: SKYPILOT_CLUSTER_INFO's fields besides the cluster's name.
    cloud: str = "local"
    region: str | None = "local"
    zone: str | None = None
    #: Where the home files lie on every node, for the files that name them by path (OpenSSH
    #: reads ``~`` as the account's home, whatever ``$HOME`` says): ``~``, or one absolute
    #: directory, the same on every node, where a node's home is not its account's (a Slurm
    #: allocation's node-local directory).
    home: str = "~"
    #: Whether nodes keep an agent server on their port (``agent.server``): not where a node
    #: is shared with other jobs, whose port is not the cluster's own, and every rank must be
    #: a job step of the allocation (Slurm).
    agent_servers: bool = True

    @property
    def head(self) -> NodeInfo:
        return self.nodes[0]

    @property
    def ips(self) -> list[str]:
        return [n.ip for n in self.nodes]

    @property
    def hostnames(self) -> list[str]:
        return [n.hostname for n in self.nodes]

    def skypilot_info(self, cluster: str) -> dict[str, str | None]:
        """SKYPILOT_CLUSTER_INFO as SkyPilot spells it."""
        return {"cluster_name": cluster, "cloud": self.cloud, "region": self.region, "zone": self.zone}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> ClusterInfo:
        nodes = tuple(
            NodeInfo(
                **{
                    **n,
                    "route": SshRoute.from_dict(n["route"]),
                    "env": dict(n.get("env") or {}),
                    "step": tuple(n.get("step") or ()),
                }
            )
            for n in data["nodes"]
        )
        return cls(**{**data, "nodes": nodes, "env": dict(data.get("env") or {})})
