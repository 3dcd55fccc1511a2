"""A node before it starts (:class:`NodeSpec`), once it runs (:class:`NodeProcess`), and as a
record keeps it for a later process (:class:`NodeRecord`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_sky import naming, procs
from pytest_sky.backends import privileges
from pytest_sky.backends.confine import Confinement
from pytest_sky.backends.nodeinit_protocol import ViewStep
from pytest_sky.state import RECORD

#: In a node's directory: the output of everything it runs, and its first process's exit code.
NODE_LOG, NODE_EXIT = "node.log", "node.exit"
#: Root's home on a node with a root of its own (``NodeSpec.layers``): its ``root/home``.
NODE_HOME = naming.NODE_HOME
#: In the command line of a node's keeper (and of the spawner that forked it), before the
#: node's directory: how the reaper and the leak check tell our processes and whose they are.
NODE_MARKER = "psky-node:"
#: The PATH of a node's first process (sshd, or a pod's command).
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass
class NodeSpec:
    """What one node needs before it starts; the files under ``root`` are written by the caller."""

    hostname: str
    ip: str
    #: Holds etc/passwd, etc/hosts, sshd_config and home/ (the node's home: at NODE_HOME on a
    #: node with layers, at this path otherwise); the node's log goes here too.  An
    #: etc/resolv.conf here is the node's resolver too (only on a node with layers).
    root: Path
    veth: str  # host-side link name, at most 15 characters
    extra_mounts: dict[str, str] = field(default_factory=dict)  # host path -> node path (read-only)
    #: Instead of sshd, the node's first process (the emulator's pods run their container's
    #: command); its output goes to the node's log.  ``env`` is added to its environment.
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    #: How the node sees its own cgroup: "rw" (a machine: jobs get cgroups of their own), "ro"
    #: (a Kubernetes pod, whose cgroupfs is read-only) or "" (no cgroup namespace).  The host
    #: gives the node a cgroup of its own whenever it can, whatever the node sees.
    cgroup_mode: str = "rw"
    #: Where the node's own root filesystem lives: a copy-on-write layer over the host's
    #: ``/`` (and over each of its other mounts), so that what the node writes anywhere is
    #: seen by it alone and goes with ``layers``.  None: the node shares the host's files.
    layers: Path | None = None
    #: Host paths the node must not see (the state directory, with every cluster's keys and
    #: every node's layers; what an emulated pod's image lacks): a directory is empty on the
    #: node, a file is removed in its own layer.  The node's own ``root`` stays visible.
    hide: list[Path] = field(default_factory=list)
    #: What of the host's files differs on the node besides, step by step (``netns.view``:
    #: the homes and scratch directories emptied, the interpreter and rootdir kept); applied
    #: before ``hide``, which a kept directory never undoes.  Only with ``layers``.
    view: list[tuple[ViewStep, str]] = field(default_factory=list)
    #: Host directory -> node path, read-write: what the node shares with others on purpose
    #: (a cluster's shared directory, a pod's volume).  Only with ``layers``.
    shared_mounts: dict[str, str] = field(default_factory=dict)
    #: What the node's processes hold: a pod's privileges unless asked otherwise
    #: (``privileges``).
    confinement: Confinement = field(default_factory=privileges.for_node)

    def to_json(self) -> dict[str, Any]:
        """The spec as a journal keeps it, so that a later process can boot the node again."""
        return {
            "hostname": self.hostname,
            "ip": self.ip,
            "root": str(self.root),
            "veth": self.veth,
            "extra_mounts": dict(self.extra_mounts),
            "command": self.command,
            "env": dict(self.env),
            "cgroup_mode": self.cgroup_mode,
            "layers": str(self.layers) if self.layers is not None else None,
            "hide": [str(h) for h in self.hide],
            "view": [[step.value, path] for step, path in self.view],
            "shared_mounts": dict(self.shared_mounts),
            "confinement": dataclasses.asdict(self.confinement),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeSpec:
        return cls(
            hostname=data["hostname"],
            ip=data["ip"],
            root=Path(data["root"]),
            veth=data["veth"],
            extra_mounts=dict(data.get("extra_mounts") or {}),
            command=data.get("command"),
            env=dict(data.get("env") or {}),
            cgroup_mode=data.get("cgroup_mode", "rw"),
            layers=Path(data["layers"]) if data.get("layers") else None,
            hide=[Path(h) for h in data.get("hide", [])],
            view=[(ViewStep(step), str(path)) for step, path in data.get("view") or []],
            shared_mounts=dict(data.get("shared_mounts") or {}),
            confinement=Confinement(**data["confinement"]) if "confinement" in data else privileges.for_node(),
        )


@dataclass
class NodeProcess:
    """A started node: the pid of its keeper (in the node's network namespace, outside its
    PID namespace: what ``unshare --fork`` would be) and the pid of the node's first process
    (sshd, pid 1 inside the node)."""

    hostname: str
    ip: str
    veth: str
    pid: int
    init_pid: int
    log_path: Path
    cgroup: Path | None = None  # the node's cgroup on the host, when it has one

    @property
    def exit_path(self) -> Path:
        """Where the node's keeper writes its first process's exit code when it ends."""
        return self.log_path.with_name(NODE_EXIT)

    def exit_code(self) -> int | None:
        """The first process's exit code (-N: killed by signal N) once the node has ended;
        None while it runs, or when the keeper itself was killed before it could say."""
        try:
            return int(self.exit_path.read_text())
        except (OSError, ValueError):
            return None


@dataclass(frozen=True)
class NodeRecord:
    """A started node as a record keeps it: what a later process needs to stop it safely
    (the keeper's start time makes a recycled pid harmless)."""

    pid: int  # the keeper
    init_pid: int = 0  # the node's first process
    start_time: int | None = None  # the keeper's (``procs.start_time``)
    log: str = ""  # the node's log ("": not recorded, as in the emulator's record)

    @classmethod
    def of(cls, node: NodeProcess) -> NodeRecord:
        return cls(pid=node.pid, init_pid=node.init_pid, start_time=procs.start_time(node.pid), log=str(node.log_path))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeRecord:
        """Also a record another program wrote with more fields (the emulator's ``veth``)."""
        start = data.get("start_time")
        return cls(
            pid=int(data["pid"]),
            init_pid=int(data.get("init_pid") or 0),
            start_time=int(start) if start is not None else None,
            log=str(data.get("log") or ""),
        )

    def live_pids(self) -> list[int]:
        """The node's first process and its keeper, while the keeper is the recorded one and
        the first process still its child (pid reuse); none otherwise."""
        if not procs.is_alive(self.pid, self.start_time):
            return []
        init = [self.init_pid] if self.init_pid and procs.parent_pid(self.init_pid) == self.pid else []
        return [*init, self.pid]


def abandoned(owner: str, clusters_dir: Path) -> bool:
    """Whether ``owner`` (a cluster's directory, or one of its nodes') is a cluster of
    ``clusters_dir`` with no record left, so that nothing will ever tear it down: a launch
    claims its record before it starts anything, so what has none lost it (its launch was
    killed in between, or its state directory was deleted while it ran).  Another state
    directory's clusters, or the emulator's, are not this one's to judge."""
    path = Path(owner)
    cluster = path.parent.parent if path.parent.name == "nodes" else path
    return cluster.parent == clusters_dir and not (cluster / RECORD).exists()
