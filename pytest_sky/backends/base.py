"""The small interface every backend implements: bring nodes up, take them down.

A backend knows how to make N machines that run sshd with the host keys it is given, and
how to remove them again from nothing but the cluster's record (so a later process can
reap a cluster whose owner died).  Keys, SSH configs, the agent and the runner are shared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_sky.resources import Resources
from pytest_sky.ssh.keys import ClusterKeys
from pytest_sky.state import ClusterRecord


@dataclass(frozen=True)
class NodeAddress:
    rank: int
    name: str  # "head", "worker1", ...
    hostname: str  # "<cluster>-head", "<cluster>-worker1", ...
    ip: str  # internal address: what SKYPILOT_NODE_IPS lists


@dataclass(frozen=True)
class ProvisionRequest:
    name: str
    num_nodes: int
    resources: Resources
    keys: ClusterKeys
    cluster_dir: Path  # private to this cluster; the backend may keep files here
    #: Given every node's address, the files each node's home needs (path relative to the
    #: home -> (content, mode)).  Backends call it once the addresses are known.
    node_files: Callable[[list[NodeAddress]], dict[str, tuple[bytes, int]]]
    #: Persist the record now: called as soon as something exists that must be reaped.
    checkpoint: Callable[[ClusterRecord], None]


class Backend(ABC):
    name: str
    cloud_label: str  # "Local", "Kubernetes": what status shows in the resources column
    #: The client's ssh config shares one connection per cluster (ControlMaster): where a
    #: new connection is expensive (a port-forward proxy per connection on Kubernetes).
    multiplex_client: bool = False

    def effective(self, resources: Resources) -> Resources:
        """The resources each node really gets, defaults filled in (what status shows)."""
        return resources

    def has_gpus(self) -> bool:
        """Whether this backend can run a GPU task at all (the ``gpu`` marker asks)."""
        return False

    @abstractmethod
    def plan(self, name: str, num_nodes: int, resources: Resources) -> None:
        """Refuse a request this backend can never satisfy, before anything is created."""

    @abstractmethod
    def create(self, request: ProvisionRequest, record: ClusterRecord) -> list[NodeAddress]:
        """Start every node with its host key and files; return once every sshd answers.

        Fills ``record`` (backend_data, head_host, python) with what ``destroy`` and the
        runner need, saving it through ``record``'s owner as it goes; on failure it removes
        what it made before raising.
        """

    @abstractmethod
    def destroy(self, record: ClusterRecord) -> None:
        """Remove everything of the cluster; tolerate parts that are already gone."""

    def ssh_route(self, record: ClusterRecord, node: NodeAddress) -> dict[str, Any]:
        """How the client dials a node's sshd: ``HostEntry`` fields (hostname, port,
        proxy_command, proxy_jump).  Default: straight to its address."""
        return {"hostname": node.ip}

    def rank_env(self, record: ClusterRecord) -> dict[str, dict[str, str]]:
        """Per-rank environment (rank as a string -> variables), e.g. each node's GPU share."""
        return {}

    def forward_env(self) -> dict[str, str]:
        """Environment every rank gets from this backend (the local one forwards PATH)."""
        return {}

    def sync_to_nodes(self, record: ClusterRecord, workdir: str | None, file_mounts: dict[str, str]) -> bool:
        """Copy ``workdir`` to every node's ``~/sky_workdir`` and each file mount to its path,
        if this backend has a faster way than SSH; False means "use SSH" (the default)."""
        return False
