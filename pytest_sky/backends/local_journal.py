"""The local backend's journal: what a cluster's launch made, typed, and its JSON form.

Written before each step that creates something (intent before action), so that a later
process, from this alone, stops the nodes of a launch that was killed half-way, boots a
node again (``restart_node``, the CLI's ``fault``) or swaps a node's packet delayer.  One
class reads and writes it, so no two places spell its keys.  The keys are those the
journal had as a plain dict, so a journal an earlier version wrote reads the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_sky.backends import netns
from pytest_sky.backends.base import NetworkFaults
from pytest_sky.errors import ProvisionError
from pytest_sky.state import Journal


@dataclass
class LocalJournal:
    """One local cluster's journal (``backend.json`` in the cluster's directory)."""

    index: int | None = None  # the cluster's /24 of 198.18.0.0/15 (and its bridge's number)
    #: Root's: the host's link into the cluster's namespace (an earlier version's: its bridge);
    #: "": not leased yet (or the launch died before it said which), or rootless.
    bridge: str = ""
    veths: list[str] = field(default_factory=list)  # each node's link's other end, by rank
    #: Each node's cgroup on the host ("" for none) and the prefix of the node directories:
    #: written before the nodes start, so the nodes of a launch killed while they started
    #: are found by their cgroups and command lines.
    cgroups: list[str] = field(default_factory=list)
    node_dirs: str = ""
    specs: list[netns.NodeSpec] = field(default_factory=list)  # what booting each node again takes
    mtu: int | None = None
    home_files: list[str] = field(default_factory=list)  # what a wiped node's home gets back
    nodes: list[netns.NodeRecord] = field(default_factory=list)  # by rank, once started
    faults: NetworkFaults = field(default_factory=NetworkFaults)  # what the network is told to be now
    delayers: dict[int, netns.Delayer] = field(default_factory=dict)  # by rank: nodes with a packet delayer
    #: The cluster's namespace holder (None: a cluster of an earlier version, whose bridge and
    #: links were the host's, or a launch killed before its holder spoke).
    holder: netns.Holder | None = None

    @classmethod
    def load(cls, journal: Journal) -> LocalJournal:
        """The journal as written (empty when there is none); a ProvisionError when it is not
        one this version reads, so that a caller can fall back to what the disk still says."""
        data = journal.load()
        try:
            return cls.from_json(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProvisionError(f"{journal.path} is not a local journal this version reads ({exc!r})") from None

    def save(self, journal: Journal) -> None:
        """Durable before this returns (``Journal.update``): the next step may be killed."""
        journal.update(**self.to_json())

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "bridge": self.bridge,
            "veths": list(self.veths),
            "cgroups": list(self.cgroups),
            "node_dirs": self.node_dirs,
            "specs": [s.to_json() for s in self.specs],
            "mtu": self.mtu,
            "home_files": sorted(self.home_files),
            "nodes": [n.to_json() for n in self.nodes],
            "faults": self.faults.to_json(),
            "delayers": {str(rank): d.to_json() for rank, d in sorted(self.delayers.items())},
            "holder": self.holder.to_json() if self.holder is not None else None,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LocalJournal:
        index, mtu = data.get("index"), data.get("mtu")
        return cls(
            index=int(index) if index is not None else None,
            bridge=str(data.get("bridge") or ""),
            veths=[str(v) for v in data.get("veths") or []],
            cgroups=[str(c or "") for c in data.get("cgroups") or []],
            node_dirs=str(data.get("node_dirs") or ""),
            specs=[netns.NodeSpec.from_json(s) for s in data.get("specs") or []],
            mtu=int(mtu) if mtu is not None else None,
            home_files=[str(f) for f in data.get("home_files") or []],
            nodes=[netns.NodeRecord.from_json(n) for n in data.get("nodes") or []],
            faults=NetworkFaults.from_json(data.get("faults")),
            delayers={int(rank): netns.Delayer.from_json(d) for rank, d in (data.get("delayers") or {}).items()},
            holder=netns.Holder.from_json(data["holder"]) if data.get("holder") else None,
        )

    def cgroup(self, rank: int) -> str:
        """Node ``rank``'s cgroup on the host, "" when it has none (or none was recorded)."""
        return self.cgroups[rank] if rank < len(self.cgroups) else ""
