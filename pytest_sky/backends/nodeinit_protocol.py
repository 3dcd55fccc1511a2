"""What the host (``netns.spawn``) and ``nodeinit.py`` say to each other, one JSON object a line.

Both sides import this module, so neither parses the other's text by position: the host
sends one :class:`Launch` line, the starter answers with :class:`Report` lines::

    in:  Launch        every node's NodePlan
    out: Report READY       index, keeper_pid, init_pid   namespaces made (the keeper says it)
    out: Report CONFIGURED  index                         link, address and root in place (the init)
    out: Report FAILED      index, message                a step failed; the message names it
    out: Report EXITED      index                         the node's pipe closed before it said both
                                                          (its log says why)
    in:  end of input before every node is configured: the host gave up, kill them all

READY and CONFIGURED come in either order.  Standard library only, importing nothing of
pytest-sky but ``confine``: ``nodeinit`` runs as a program of its own (``python -S -I``) and
imports this file from its directory.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from dataclasses import asdict, dataclass, field

try:
    from pytest_sky.backends import confine
except ImportError:  # imported by nodeinit.py run as a program: from its directory
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import confine  # type: ignore[import-not-found,no-redef]


class ProtocolError(Exception):
    """A line that is not a message of this protocol (a crash's output, a version mismatch)."""


@dataclass
class NodePlan:
    """Everything one node's start needs (``netns.plans`` builds it from a NodeSpec)."""

    hostname: str
    ip: str
    prefixlen: int
    subnet: str
    mtu: int
    root: str  # the node's directory: etc/passwd, etc/hosts, sshd_config, home/
    log: str  # the node's log: the output of everything it runs
    exit_file: str  # where the keeper writes the init's exit code (-N: killed by signal N)
    sshd: str
    sshd_args: list[str]  # before -f: sshd.daemon_args
    path: str  # PATH of the node's first process
    command: str = ""  # instead of sshd (a pod's container command), a shell command line
    env: dict[str, str] = field(default_factory=dict)  # added to the first process's environment
    cgroup_dir: str = ""  # the node's cgroup on the host ("": none)
    cgroup_mode: str = ""  # cgroup2 at /sys/fs/cgroup: "rw", "ro" or "" (not mounted)
    layers: str = ""  # the node's layers directory ("": it shares the host's files)
    submounts: list[tuple[int, str, str]] = field(default_factory=list)  # (layer, "rw"|"ro", path)
    hide: list[str] = field(default_factory=list)  # absent on the node: directories covered, files removed
    node_home: str = ""
    #: Rootless (the host's user is root only in the cluster's user namespace): the host's
    #: uid and gid, which the node's processes take in a user namespace of the node's own
    #: (-1: the host is root, and so is the node).
    node_uid: int = -1
    node_gid: int = -1
    #: What of the host's files differs on the node, step by step (``netns.view``): a
    #: ``ViewStep`` value and a host path.
    view: list[tuple[str, str]] = field(default_factory=list)
    extra_mounts: list[tuple[str, str]] = field(default_factory=list)  # host path, node path: read-only
    shared_mounts: list[tuple[str, str]] = field(default_factory=list)  # host path, node path
    veth: str = ""  # the host's end of the node's link (the node's own end is eth0)
    mac: str = ""  # eth0's
    bridge_index: int = 0  # the bridge the host's end goes on
    link_group: int = 0  # the cluster's link group (0: none): one deletion removes them all
    #: The node's default route ("": none, as an emulated pod on a network that blocks egress).
    gateway: str = ""
    #: The host's end of its link is in the cluster's own network namespace (its holder's),
    #: where every link's name is the cluster's: one left by the node's previous boot (its
    #: namespace's end is asynchronous) is deleted rather than taken for another's.
    cluster_netns: bool = False
    alias: str = ""  # the host's end's ifalias: the node's directory, for `pytest-sky doctor`
    #: What its processes hold (a pod's, by default: ``privileges`` decides it).
    confinement: confine.Confinement = field(default_factory=confine.Confinement)

    @classmethod
    def from_json(cls, data: dict) -> NodePlan:
        plan = cls(**{**data, "confinement": confine.Confinement(**data["confinement"])})
        # JSON has no tuples: the pairs come back as lists.
        plan.submounts = [(int(i), str(mode), str(path)) for i, mode, path in plan.submounts]
        plan.view = [(str(step), str(path)) for step, path in plan.view]
        plan.extra_mounts = [(str(s), str(t)) for s, t in plan.extra_mounts]
        plan.shared_mounts = [(str(s), str(t)) for s, t in plan.shared_mounts]
        return plan


@dataclass
class Launch:
    """The host's one line: every node of this launch."""

    nodes: list[NodePlan]

    def encode(self) -> bytes:
        return (json.dumps({"nodes": [asdict(p) for p in self.nodes]}) + "\n").encode()

    @classmethod
    def decode(cls, line: bytes) -> Launch:
        try:
            return cls([NodePlan.from_json(p) for p in json.loads(line)["nodes"]])
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"not a launch: {exc}") from None


class ViewStep(enum.Enum):
    """One step of a node's view of the host's files (``netns.view`` says why each)."""

    EMPTY = "empty"  # a directory of the node's own, empty, in its place; a file removed
    KEEP = "keep"  # the host's directory again, copy-on-write, inside an emptied one


class Stage(enum.Enum):
    READY = "ready"  # the keeper: namespaces made, the init forked
    CONFIGURED = "configured"  # the init: link, address, mounts and root in place; execs next
    FAILED = "failed"  # a step of the keeper or the init raised (``message`` names it)
    EXITED = "exited"  # the node's pipe closed before it said both (the relay says it)


@dataclass(frozen=True)
class Report:
    """One thing the starter says about node ``index`` (its place in the Launch)."""

    stage: Stage
    index: int
    keeper_pid: int = 0  # READY only
    init_pid: int = 0  # READY only
    message: str = ""  # FAILED only

    def encode(self) -> bytes:
        return (json.dumps({**asdict(self), "stage": self.stage.value}) + "\n").encode()

    @classmethod
    def decode(cls, line: bytes | str) -> Report:
        try:
            data = json.loads(line)
            return cls(
                stage=Stage(data["stage"]),
                index=int(data["index"]),
                keeper_pid=int(data.get("keeper_pid", 0)),
                init_pid=int(data.get("init_pid", 0)),
                message=str(data.get("message", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            text = line.decode(errors="replace") if isinstance(line, bytes) else line
            raise ProtocolError(f"not a node report ({exc}): {text[:200]}") from None
