"""The small interface every backend implements: bring nodes up, take them down.

``create`` takes a :class:`ProvisionConfig` and returns a
:class:`~pytest_sky.cluster_info.ClusterInfo`; it changes nothing of its caller's and is
never asked anything on the run path.  What it made, it writes to the config's journal
before making it, so that ``destroy`` can remove a cluster from the journal alone, in a
later process whose owner died (the reaper).  Keys, SSH configs, the agent and the runner
are shared by every backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from pytest_sky.cluster_info import ClusterInfo
from pytest_sky.resources import Resources
from pytest_sky.ssh.keys import ClusterKeys
from pytest_sky.state import Journal

#: A node's home files: path relative to the home -> (content, mode).
HomeFiles = dict[str, tuple[bytes, int]]


@dataclass(frozen=True)
class ProvisionConfig:
    name: str
    num_nodes: int
    resources: Resources
    keys: ClusterKeys
    cluster_dir: Path  # private to this cluster; the backend may keep files here
    journal: Journal
    #: What every node's home gets before its sshd starts (keys, the agent).
    home_files: HomeFiles
    #: Where one directory shared by every node appears on each (opt-in, as NFS would);
    #: None: nodes share nothing.
    shared_dir: str | None = None


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
    def plan(self, name: str, num_nodes: int, resources: Resources, shared_dir: str | None = None) -> None:
        """Refuse a request this backend can never satisfy, before anything is created."""

    @abstractmethod
    def create(self, config: ProvisionConfig) -> ClusterInfo:
        """Start every node with its host key and home files; return once every sshd answers.

        On failure it removes what it made before raising.
        """

    @abstractmethod
    def put_files(self, name: str, journal: Journal, info: ClusterInfo, files: HomeFiles) -> None:
        """Write files into every node's home that could only be written once every
        address was known (``~/.ssh/config`` and ``known_hosts`` name the peers' IPs)."""

    @abstractmethod
    def destroy(self, name: str, journal: Journal) -> None:
        """Remove everything the journal says the cluster has; tolerate parts already gone."""
