"""What each node's start needs, worked out on the host: its plan, and its layers' directories."""

from __future__ import annotations

import os
import re
import shlex
import socket
from collections.abc import Sequence
from pathlib import Path

from pytest_sky import naming
from pytest_sky.backends import clusterns, privileges
from pytest_sky.backends.netns.links import link_group, node_mac
from pytest_sky.backends.netns.nodes import NODE_EXIT, NODE_HOME, NODE_LOG, NODE_PATH, NodeSpec
from pytest_sky.backends.netns.userns import Holder
from pytest_sky.backends.nodeinit_protocol import NodePlan, ViewStep
from pytest_sky.errors import ProvisionError
from pytest_sky.ssh import sshd as sshd_config


def node_plans(
    specs: Sequence[NodeSpec],
    cgroups: Sequence[Path | None],
    *,
    prefixlen: int,
    subnet: str,
    mtu: int,
    tools: dict[str, str],
    bridge: str,
    holder: Holder | None = None,
) -> list[NodePlan]:
    """What each node's start needs (:class:`~pytest_sky.backends.nodeinit.NodePlan`); a
    private root's layer directories are made here, on the host, before the node starts
    (by the node itself where it is rootless: the user could not give them their owners)."""
    submounts: dict[tuple[Path, ...], list[tuple[str, str]]] = {}
    bridge_index, group = _bridge_of(bridge, holder)
    sshd_args = list(sshd_config.daemon_args(tools["sshd"]))
    rootless = holder is not None and holder.rootless
    plans = []
    for spec, cgroup in zip(specs, cgroups, strict=True):
        plan = NodePlan(
            hostname=spec.hostname,
            ip=spec.ip,
            prefixlen=prefixlen,
            subnet=subnet,
            mtu=mtu,
            root=str(spec.root),
            log=str(spec.root / NODE_LOG),
            exit_file=str(spec.root / NODE_EXIT),
            sshd=tools["sshd"],
            sshd_args=sshd_args,
            path=NODE_PATH,
            command=shlex.join(spec.command) if spec.command else "",
            env=dict(spec.env),
            cgroup_dir=str(cgroup or ""),
            cgroup_mode=spec.cgroup_mode if cgroup else "",
            extra_mounts=list(spec.extra_mounts.items()),
            veth=spec.veth,
            mac=node_mac(spec.ip),
            bridge_index=bridge_index,
            link_group=group,
            alias=str(spec.root),
            confinement=privileges.rootless(spec.confinement) if rootless else spec.confinement,
            # In the cluster's own namespace, its gateway is every node's way out.
            gateway=clusterns.subnet_base(holder.index) + "1" if holder is not None else "",
            cluster_netns=holder is not None,
        )
        if spec.layers is not None:
            # What the node never sees of the host's needs no layer: hidden, or emptied.
            hidden = (*spec.hide, *(Path(path) for step, path in spec.view if step is ViewStep.EMPTY))
            _layered(plan, spec, submounts.setdefault(hidden, host_submounts(hidden)), rootless)
        plans.append(plan)
    return plans


def _bridge_of(bridge: str, holder: Holder | None) -> tuple[int, int]:
    """The bridge's ifindex and link group: in the holder's network namespace (rootless, no
    group), or the host's."""
    if holder is not None:
        return holder.bridge_index, 0
    try:
        return socket.if_nametoindex(bridge), link_group(bridge) or 0
    except OSError:
        raise ProvisionError(f"bridge {bridge} is gone: was the cluster torn down meanwhile?") from None


def _layered(plan: NodePlan, spec: NodeSpec, mounts: list[tuple[str, str]], rootless: bool) -> None:
    """A root of its own for the node: its layers, the host's mounts it carries, what it must
    not see; rootless, the node makes its layers' directories itself."""
    assert spec.layers is not None
    if not rootless:
        prepare_layers(spec.layers, mounts)
    else:
        (spec.layers / "merged").mkdir(parents=True, exist_ok=True, mode=0o700)
        plan.node_uid, plan.node_gid = os.getuid(), os.getgid()
    plan.layers = str(spec.layers)
    plan.submounts = [(i, mode, path) for i, (mode, path) in enumerate(mounts, 1)]
    plan.hide = [str(h) for h in spec.hide]
    plan.view = [(step.value, path) for step, path in spec.view]
    plan.node_home = NODE_HOME
    plan.shared_mounts = list(spec.shared_mounts.items())


def host_submounts(hidden: Sequence[Path] = ()) -> list[tuple[str, str]]:
    """The host's mounts below ``/`` that a node's root carries, in mount order, as
    ``("rw" | "ro", path)``: a writable one gets a copy-on-write layer of its own, a
    read-only one stays read-only.  Paths with whitespace are left out (the node's init
    reads lines), as are those under a hidden directory."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    found: dict[str, str] = {}
    for line in lines:
        fields = line.split()
        if len(fields) < 4:
            continue
        path = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[1])
        inside = [own for own in naming.NODE_OWN_MOUNTS if path == own or path.startswith(own + "/")]
        if path == "/" or inside or any(c.isspace() for c in path):
            continue
        if any(Path(path) == h or Path(path).is_relative_to(h) for h in hidden):
            continue
        found.pop(path, None)  # the later mount over the same path is the one that shows
        found[path] = "ro" if "ro" in fields[3].split(",") else "rw"
    return [(mode, path) for path, mode in found.items()]


def prepare_layers(layers: Path, submounts: Sequence[tuple[str, str]]) -> None:
    """The directories a node's layers need, made on the host before it starts: each upper
    directory takes the mode and owner of what it covers (it becomes that directory's own
    attributes on the node: ``/`` 0755, ``/tmp`` 1777)."""
    (layers / "merged").mkdir(parents=True, exist_ok=True, mode=0o700)
    for i, (mode, path) in [(0, ("rw", "/")), *enumerate(submounts, 1)]:
        if mode != "rw":
            continue
        upper, work = layers / str(i) / "upper", layers / str(i) / "work"
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(exist_ok=True)
        try:
            st = os.stat(path)
        except OSError:
            continue
        os.chown(upper, st.st_uid, st.st_gid)
        os.chmod(upper, st.st_mode & 0o7777)
