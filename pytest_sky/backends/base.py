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
from dataclasses import dataclass, field
from pathlib import Path

from pytest_sky.backends.privileges import NONE_ASKED, Privileges
from pytest_sky.cluster_info import ClusterInfo
from pytest_sky.errors import NotSupportedError
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
    #: More than a pod's privileges, asked for on purpose (``capabilities=``, ``privileged=``).
    privileges: Privileges = NONE_ASKED
    #: The cluster outlives the process that launches it (``--keep-clusters``, the CLI): what
    #: the backend keeps running for it must not be that process's.
    keep: bool = False


@dataclass(frozen=True)
class LinkDegradation:
    """What one node's link suffers: added latency (and its jitter), random loss per
    direction, and a bandwidth cap (None: uncapped)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    rate_mbit: float | None = None


@dataclass(frozen=True)
class NetworkFaults:
    """Every network fault a cluster has now: partitions (pairs of rank groups that cannot
    reach each other) and degraded links by rank.  Backends apply the whole state at once,
    so applying it twice, or again on a restarted node, gives the same network."""

    partitions: tuple[tuple[frozenset[int], frozenset[int]], ...] = ()
    degraded: dict[int, LinkDegradation] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.partitions or self.degraded)

    def cut_off(self, rank: int) -> set[int]:
        """The ranks that ``rank`` cannot reach, over every partition."""
        out: set[int] = set()
        for a, b in self.partitions:
            if rank in a:
                out |= b
            elif rank in b:
                out |= a
        return out

    def to_json(self) -> dict:
        return {
            "partitions": [[sorted(a), sorted(b)] for a, b in self.partitions],
            "degraded": {str(r): vars(d) for r, d in self.degraded.items()},
        }

    @classmethod
    def from_json(cls, data: dict | None) -> NetworkFaults:
        data = data or {}
        return cls(
            partitions=tuple((frozenset(a), frozenset(b)) for a, b in data.get("partitions", [])),
            degraded={int(r): LinkDegradation(**d) for r, d in data.get("degraded", {}).items()},
        )


@dataclass(frozen=True)
class ClusterHold:
    """A cluster as its backend's own record of ownership shows it, away from any state
    directory (a Kubernetes Lease): what ``status`` and ``doctor`` list, and what ``down
    --stale`` decides on."""

    name: str
    where: str  # e.g. "kube context C, namespace N"
    holder: str  # who holds it: host and pid
    age_s: float | None
    renewed_s: float | None  # seconds since its holder last renewed it
    lease_s: float  # how long it lasts without renewal
    kept: bool  # kept on purpose: never reaped
    expired: bool  # not renewed for a whole lease: its owner is gone


class Backend(ABC):
    name: str
    cloud_label: str  # "Local", "Kubernetes": what status shows in the resources column
    #: The client's ssh config shares one connection per cluster (ControlMaster), as the
    #: ssh config users get does: a burst of ``ssh -F <ssh_config> <cluster>`` then costs
    #: channels, not handshakes (or port-forward proxies, on Kubernetes).
    multiplex_client: bool = False
    #: Wait at launch until that shared connection is open: where a connection is expensive
    #: (Kubernetes: a proxy each), so a first burst never races to become the master.
    #: Otherwise the launch only starts opening it, and pays no handshake (a handshake costs
    #: as much as a small local cluster's bring-up); clients connect directly until it is up.
    eager_client_master: bool = False

    def effective(self, resources: Resources) -> Resources:
        """The resources each node really gets, defaults filled in (what status shows)."""
        return resources

    def has_gpus(self) -> bool:
        """Whether this backend can run a GPU task at all (the ``gpu`` marker asks)."""
        return False

    def gpus_unseen(self) -> str:
        """Why :meth:`has_gpus` said no (after it did), for the skip reason of GPU tests."""
        return f"the {self.name} backend has none on this machine"

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

    # -- faults (optional: a backend without the means says so) ---------------------------

    def kill_node(self, name: str, journal: Journal, rank: int) -> None:
        """Kill every process of node ``rank`` at once, as a machine that crashed."""
        raise NotSupportedError(f"the {self.name} backend cannot kill a node; use the local backend")

    def restart_node(self, name: str, journal: Journal, info: ClusterInfo, rank: int, wipe: bool) -> ClusterInfo:
        """Boot node ``rank`` again (killing it first if it runs) with its name and host key;
        its disk survives unless ``wipe``.  Returns, once its sshd answers, the cluster's info
        afterwards: ``info`` itself where the node kept its address, else with its new one
        (a recreated Kubernetes pod), which the caller then writes into every ssh file."""
        raise NotSupportedError(f"the {self.name} backend cannot restart a node; use the local backend")

    def network_faults(self, journal: Journal) -> NetworkFaults:
        """The network faults applied now (none on a backend that cannot apply any)."""
        return NetworkFaults()

    def set_network_faults(self, name: str, journal: Journal, info: ClusterInfo, faults: NetworkFaults) -> None:
        """Make ``faults`` the cluster's whole network state (empty: everything healed)."""
        if faults:
            raise NotSupportedError(f"the {self.name} backend cannot partition or degrade links; use the local backend")

    def link_shaping(self) -> str:
        """How ``degrade`` is carried out here: "netem", "tbf+iptables+nfqueue" or "none"."""
        return "none"

    def node_image(self, journal: Journal) -> str | None:
        """The image the nodes run, as the journal recorded it; None where nodes run no image
        (the local backend's run this machine's software)."""
        return None

    def diagnostics(self, name: str, journal: Journal) -> list[tuple[str, str]]:
        """What the backend knows of the nodes beyond their runs, as (file name, text) pairs for
        a failed test's artifacts (Kubernetes: each pod's events and container log); [] here."""
        return []

    def reap_stale(self) -> list[str]:
        """Remove this backend's clusters whose owner is gone, judged by what the backend's
        site itself holds (a Kubernetes Lease, a Slurm allocation's owner record), from any
        machine, a killed session's whose state directory may be gone too; what went, one entry
        each.  Never what another user, or no pytest-sky, made.  A backend whose clusters are
        known only to this machine's records has nothing beyond what ``lifecycle.reap``
        removes: none here."""
        return []

    def held_clusters(self) -> list[ClusterHold]:
        """Every cluster this backend's own records of ownership show, wherever it was launched
        (``status`` and ``doctor`` list them); none where there are no such records."""
        return []

    def leftovers(self, name: str, journal: Journal) -> str:
        """What of the cluster may still exist, and where, when its record is forgotten
        without ``destroy`` succeeding (``pytest-sky down --purge``); read from the journal."""
        return f"whatever the {self.name} backend made for {name} (its journal was {journal.path})"
