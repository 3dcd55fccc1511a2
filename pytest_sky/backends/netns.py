"""Namespace nodes: the primitive under the local backend (and the emulator's kubelet).

A node is one process tree in fresh network, UTS, IPC, mount, PID and cgroup namespaces, with
OpenSSH ``sshd -D`` as its first process, one veth into a per-cluster bridge, a private
``/run`` and bind-mounted ``/etc/passwd`` and ``/etc/hosts``.  ``nodeinit.py`` starts a
launch's nodes (one process forks them all and each makes its namespaces, mounts and link
with system calls); this module plans them, waits for them and stops them.

Why a cgroup per node: the kernel's own accounting of every process the node ever started,
whatever sessions they made or whoever their parent was.  The host kills a whole node with
one write (``cgroup.kill``), and inside the node (a cgroup namespace with cgroup2 mounted on
``/sys/fs/cgroup``, as a container has) the agent gives each job's rank a child cgroup of
its own, so a failed or cancelled job leaves nothing running.  Where the host's cgroup2
hierarchy is missing or read-only, nodes start without one and the agent falls back to
walking processes (``agent.RANK_SUPERVISOR``).

Why not ``ip netns add``: a named namespace is a bind mount under ``/run/netns`` that every
later node's mount namespace copies, which keeps deleted namespaces (and their veths)
alive until those nodes die.  An anonymous namespace lives exactly as long as the node's
processes, so killing the node's first process releases everything but the bridge.

Why shell ``ip`` (for bridges and teardown) rather than pyroute2: measured faster here
(DESIGN.md section 5).  A node's own link is made from inside it over raw netlink
(``netlink.py``): no program to start, 64 times.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import json
import logging
import os
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pytest_sky import naming, procs
from pytest_sky.backends import privileges
from pytest_sky.backends.confine import Confinement
from pytest_sky.backends.nodeinit import NodePlan
from pytest_sky.errors import BackendUnavailableError, ProvisionError, SkyError
from pytest_sky.ssh import sshd as sshd_config

log = logging.getLogger(__name__)

#: Every link we create starts with this, so leaks are easy to find (``pytest-sky doctor``).
LINK_PREFIX = "psky"

#: In a node's directory: the output of everything it runs, and its first process's exit code.
NODE_LOG, NODE_EXIT = "node.log", "node.exit"

#: The program that starts a launch's nodes (one process forks them all; its docstring says why).
NODE_INIT = Path(__file__).with_name("nodeinit.py")


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
    #: Host directory -> node path, read-write: what the node shares with others on purpose
    #: (a cluster's shared directory, a pod's volume).  Only with ``layers``.
    shared_mounts: dict[str, str] = field(default_factory=dict)
    #: What the node's processes hold: a pod's privileges unless asked otherwise
    #: (``privileges``).
    confinement: Confinement = field(default_factory=privileges.for_node)


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


def require_tools() -> dict[str, str]:
    """Absolute paths of the programs a node needs, or a one-line error naming the package."""
    needed = {"ip": "iproute2", "sshd": "openssh-server"}
    found: dict[str, str] = {}
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
    missing = []
    for tool, package in needed.items():
        path = shutil.which(tool, path=search)
        if path is None:
            missing.append(package)
        else:
            found[tool] = path
    if missing:
        raise BackendUnavailableError(
            f"the local backend needs {', '.join(sorted(set(missing)))}: "
            f"run `apt-get install -y {' '.join(sorted(set(missing)))}` (or `bash scripts/setup.sh`)"
        )
    return found


def require_privileges() -> None:
    """Namespaces and links need CAP_NET_ADMIN and CAP_SYS_ADMIN; say so before touching anything."""
    cap_eff = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                cap_eff = int(line.split()[1], 16)
    except OSError:
        pass
    net_admin, sys_admin = 1 << 12, 1 << 21
    if cap_eff & net_admin and cap_eff & sys_admin:
        return
    if os.geteuid() == 0:
        raise BackendUnavailableError(
            "the local backend needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network "
            "namespaces, and this root has had them dropped (a restricted container?): run it "
            "privileged (e.g. `docker run --privileged`) or use --kubernetes"
        )
    raise BackendUnavailableError(
        "the local backend needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network "
        "namespaces: run pytest as root (e.g. `sudo -E env PATH=$PATH pytest ...`) "
        "or use --kubernetes"
    )


def forward_policy_problem(bridge_nf_call_iptables: str | None, iptables_rules: str | None) -> str | None:
    """Why bridged traffic between nodes would be dropped on this host, or None.

    With ``br_netfilter`` loaded and ``bridge-nf-call-iptables`` on, frames crossing a bridge
    go through the iptables FORWARD chain; Docker hosts set its policy to DROP, which silently
    cuts head-to-worker traffic.  Kept pure so it is testable without such a host.
    """
    if (bridge_nf_call_iptables or "").strip() != "1" or not iptables_rules:
        return None
    lines = iptables_rules.splitlines()
    if "-P FORWARD DROP" not in lines and "-P FORWARD REJECT" not in lines:
        return None
    if any(line.startswith("-A FORWARD") and f"-i {LINK_PREFIX}" in line and "ACCEPT" in line for line in lines):
        return None
    return (
        "this host's iptables FORWARD policy drops bridged traffic (br_netfilter is loaded), so "
        "cluster nodes could not reach each other: run `iptables -I FORWARD -i psky+ -o psky+ -j ACCEPT` "
        "or `sysctl -w net.bridge.bridge-nf-call-iptables=0`"
    )


def check_forward_policy() -> None:
    try:
        nf = Path("/proc/sys/net/bridge/bridge-nf-call-iptables").read_text()
    except OSError:
        return  # br_netfilter not loaded: bridged frames never see iptables
    iptables = shutil.which("iptables", path=os.pathsep.join(["/usr/sbin", "/sbin", os.environ.get("PATH", "")]))
    if iptables is None:
        return
    try:
        rules = subprocess.run(
            [iptables, "-S", "FORWARD"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return
    problem = forward_policy_problem(nf, rules)
    if problem:
        raise BackendUnavailableError(problem)


def ip_batch(ip: str, commands: Iterable[str], *, force: bool = False) -> str:
    """Run many ``ip`` commands in one process; returns stderr (non-empty only on errors)."""
    script = "\n".join(commands) + "\n"
    argv = [ip, "-force", "-batch", "-"] if force else [ip, "-batch", "-"]
    proc = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0 and not force:
        raise ProvisionError(
            f"ip failed: {proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else proc.returncode}"
        )
    return proc.stderr


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def create_bridge(ip: str, name: str, address: str, prefixlen: int, subnet: str, mtu: int, owner: str = "") -> bool:
    """Create the cluster's bridge; False when the name is taken (another process holds it).

    Creating the link is atomic in the kernel, which makes the bridge name a race-free lease
    on its subnet across processes, xdist workers and state directories alike.  ``owner``
    (the cluster's directory) goes into the link's alias, so a leftover link says whose it is;
    until it is there the creator holds :func:`link_lock` (shared), so a reaper (exclusive)
    never takes a bridge being created for a stray.
    """
    with link_lock(exclusive=False):
        proc = subprocess.run(
            # A fixed address: a bridge otherwise takes the lowest address among its ports, and
            # when that port leaves (a node dies) every node's ARP entry for the bridge goes stale
            # for seconds, stalling the client's connection to the head.
            [ip, "link", "add", name, "address", _local_mac(), "mtu", str(mtu), *_group_args(name), "type", "bridge"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if proc.returncode != 0:
            if "exists" in proc.stderr:
                return False
            raise ProvisionError(f"could not create bridge {name}: {proc.stderr.strip()}")
        try:
            set_alias(name, owner)
        except BaseException:
            delete_links(ip, [name])
            raise
    try:
        # Bridged frames between nodes of one cluster; no STP delay, no forwarding delay.
        Path(f"/sys/class/net/{name}/bridge/forward_delay").write_text("0")
        disable_forwarding(name)
        ip_batch(
            ip,
            [
                f"addr add {address}/{prefixlen} dev {name}",
                f"link set {name} up",
                f"route change {subnet} dev {name} proto kernel scope link src {address} quickack 1",
            ],
        )
    except BaseException:
        delete_links(ip, [name])
        raise
    return True


@contextmanager
def link_lock(*, exclusive: bool) -> Iterator[None]:
    """The one ownership signal between creators of bridges (shared: they never wait on each
    other) and reapers (exclusive): a bridge without an owner seen under the exclusive lock
    is not being created, so its creator died between creating and naming it."""
    base = Path("/run/lock") if os.path.isdir("/run/lock") else Path(tempfile.gettempdir())
    fd = os.open(base / "pytest-sky-links.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def disable_forwarding(link: str) -> None:
    """No routing for what arrives on our bridge, whatever the host's ``ip_forward`` says.

    A task is root in its node: with ``ip route add default via <bridge ip>`` it would
    otherwise reach the host's other networks and other clusters through a host that
    forwards.  Frames between one cluster's nodes are bridged, not routed, and still flow.
    (Setting ``net.ipv4.ip_forward`` later resets every interface's value: the kernel's rule.)
    """
    for family in ("ipv4", "ipv6"):
        path = Path(f"/proc/sys/net/{family}/conf/{link}/forwarding")
        try:
            path.write_text("0")
        except OSError:
            if family == "ipv4":
                raise


def routed_networks(ip: str) -> list[str]:
    """Destinations (``a.b.c.d/len``) the host already routes, over links that are not ours.

    A VPN or a fake-IP DNS tool may own part of 198.18.0.0/15; a cluster there would shadow
    it, or be shadowed.  Every routing table counts; a default route does not (every subnet
    is more specific than it).
    """
    import json

    proc = subprocess.run(
        [ip, "-j", "-4", "route", "show", "table", "all"], capture_output=True, text=True, timeout=30, check=False
    )
    try:
        routes = json.loads(proc.stdout or "[]")
    except ValueError:
        return []
    out = []
    for route in routes:
        dst = route.get("dst", "")
        if not dst or dst == "default" or str(route.get("dev", "")).startswith(LINK_PREFIX):
            continue
        out.append(dst if "/" in dst else dst + "/32")
    return out


def _local_mac() -> str:
    """A random locally administered unicast MAC address."""
    octets = bytearray(os.urandom(6))
    octets[0] = (octets[0] & 0xFC) | 0x02
    return ":".join(f"{b:02x}" for b in octets)


def set_alias(link: str, alias: str) -> None:
    if alias:
        Path(f"/sys/class/net/{link}/ifalias").write_text(alias[:255])


def link_alias(link: str) -> str:
    try:
        return Path(f"/sys/class/net/{link}/ifalias").read_text().strip()
    except OSError:
        return ""


def bridge_owned_by(owner: str) -> str | None:
    """The bridge of ours whose alias is ``owner`` (a cluster's directory), if there is one."""
    for name in os.listdir("/sys/class/net"):
        if re.fullmatch(rf"{LINK_PREFIX}\d+", name) and link_alias(name) == owner:
            return name
    return None


def delete_links(ip: str, names: Sequence[str]) -> None:
    """Delete links that exist; a link already gone is fine (teardown is idempotent)."""
    present = [n for n in names if link_exists(n)]
    if present:
        ip_batch(ip, [f"link del {n}" for n in present], force=True)


#: Link groups (``ip link ... group N``) of our clusters: bridge ``psky<i>`` and its veths
#: are in group ``LINK_GROUP_BASE + i``.  Far from 0 (every link's default) and from the small
#: numbers a host's own ``/etc/iproute2/group`` would name.
LINK_GROUP_BASE = 0x70730000


def link_group(bridge: str) -> int | None:
    """The link group of bridge ``psky<i>`` and its nodes' veths; None for any other name."""
    match = re.fullmatch(rf"{LINK_PREFIX}(\d+)", bridge)
    return LINK_GROUP_BASE + int(match.group(1)) if match and int(match.group(1)) < 0x10000 else None


def _group_args(bridge: str) -> list[str]:
    group = link_group(bridge)
    return ["group", str(group)] if group is not None else []


def _group_is_ours(bridge: str, group: int) -> bool:
    """Every link in ``group`` is ``bridge`` or one of its veths (``<bridge>n<rank>``/``p``):
    a host that happened to use the same group number for its own links keeps them."""
    try:
        names = os.listdir("/sys/class/net")
    except OSError:
        return False
    for name in names:
        if name.startswith(LINK_PREFIX) and not name.startswith(bridge):
            continue  # another cluster's: in a group of its own (read only what could clash)
        try:
            value = int(Path(f"/sys/class/net/{name}/netdev_group").read_text())
        except (OSError, ValueError):
            continue
        if value == group and not re.fullmatch(rf"{re.escape(bridge)}(?:[np]\d+)?", name):
            return False
    return True


def delete_cluster_links(ip: str, bridge: str, names: Sequence[str] = ()) -> None:
    """Delete a cluster's bridge and every veth on it in one kernel operation.

    Deleting links one by one costs the kernel one network synchronisation each (about
    20 ms apiece here: 0.3 s for 16 veths, 1.4 s for 64); deleting a link group is one
    for all of them (0.07 s for 16 or 64).  ``names`` (links made before groups, or by a
    caller that set none) are deleted by name afterwards, if any is still there.
    """
    group = link_group(bridge)
    if group is not None and link_exists(bridge) and _group_is_ours(bridge, group):
        ip_batch(ip, [f"link del group {group}"], force=True)
    delete_links(ip, [*names, bridge])


# ---------------------------------------------------------------------------- node cgroups


@functools.lru_cache(maxsize=1)
def cgroup2_root() -> Path | None:
    """Where this host's cgroup v2 hierarchy is mounted, if we may create cgroups in it.

    Most hosts mount it on ``/sys/fs/cgroup``; hybrid ones (v1 controllers beside it) on
    ``/sys/fs/cgroup/unified``: ``/proc/mounts`` says which.
    """
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup2" and "ro" not in fields[3].split(","):
            root = Path(fields[1].replace("\\040", " "))
            if os.access(root / "cgroup.procs", os.W_OK) and os.access(root, os.W_OK):
                return root
    return None


def node_cgroup(name: str) -> Path | None:
    """The host-side cgroup of the node whose veth is ``name`` (unique while the link is ours)."""
    root = cgroup2_root()
    return root / name if root is not None else None


def orphaned_cgroups() -> list[Path]:
    """Node cgroups whose cluster's bridge is gone.  A node's cgroup lives inside its bridge's
    lifetime (made after it, removed before it), so one without it is a leftover, whoever's."""
    root = cgroup2_root()
    if root is None:
        return []
    out = []
    for path in sorted(root.glob(f"{LINK_PREFIX}*")):
        match = re.fullmatch(rf"({LINK_PREFIX}\d+)[np]\d+", path.name)
        if match and path.is_dir() and not link_exists(match.group(1)):
            out.append(path)
    return out


def _make_cgroup(path: Path) -> bool:
    """Create a node's cgroup, empty; False where this host will not give us one."""
    try:
        path.mkdir()
    except FileExistsError:
        kill_cgroups([path])  # a leftover of a killed run under the same (leased) name
        try:
            path.mkdir()
        except OSError:
            return False
    except OSError:
        return False
    return True


def _populated(path: Path) -> bool:
    try:
        return "populated 1" in (path / "cgroup.events").read_text()
    except OSError:
        return False


def kill_cgroups(paths: Sequence[Path | str | None], timeout: float = 10.0) -> list[str]:
    """Kill every process in each cgroup and its descendants (one write each), wait until
    they are empty and remove them, innermost first; returns those still there at the deadline."""
    live = signal_cgroups(paths)
    deadline = time.monotonic() + timeout
    left = []
    for path in live:
        for sub in _cgroup_tree(path):
            if not _remove_cgroup(sub, deadline):
                left.append(str(sub))
    return left


def signal_cgroups(paths: Sequence[Path | str | None]) -> list[Path]:
    """SIGKILL every process in each cgroup and below it, waiting for none of them (one
    write each: ``cgroup.kill``); returns the cgroups that exist."""
    live = [Path(p) for p in paths if p and os.path.isdir(p)]
    for path in live:
        try:
            (path / "cgroup.kill").write_text("1")
        except OSError:  # before Linux 5.14: signal each member until none is left
            for sub in _cgroup_tree(path):
                _kill_members(sub)
    return live


def _cgroup_tree(path: Path) -> list[Path]:
    """``path`` and every cgroup below it, deepest first (the order rmdir needs)."""
    tree = [Path(top) / d for top, dirs, _ in os.walk(path) for d in dirs]
    return [*sorted(tree, key=lambda p: len(p.parts), reverse=True), path]


def _remove_cgroup(path: Path, deadline: float) -> bool:
    delay = 0.001
    while True:
        try:
            path.rmdir()  # fails while a process (not a zombie) is still in it
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
        if _populated(path):
            _kill_members(path)
        time.sleep(delay)  # the kernel frees exiting tasks asynchronously
        delay = min(delay * 2, 0.02)


def _kill_members(path: Path) -> None:
    try:
        pids = (path / "cgroup.procs").read_text().split()
    except OSError:
        return
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def start_nodes(
    specs: Sequence[NodeSpec],
    *,
    bridge: str,
    prefixlen: int,
    subnet: str,
    mtu: int,
    tools: dict[str, str],
) -> list[NodeProcess]:
    """Start every node, wire it to the bridge and let it exec sshd.

    Returns once every node has its address and mounts and is exec'ing sshd; the caller
    waits for the SSH banners.  (Dialling a node before its address exists costs a 1 s ARP
    retry, hence the handshake.)  On any failure every node of the call is stopped.
    """
    cgroups = [_new_node_cgroup(spec) for spec in specs]
    try:
        plans = _node_plans(specs, cgroups, prefixlen=prefixlen, subnet=subnet, mtu=mtu, tools=tools, bridge=bridge)
        spawner = _Spawner(specs, plans, cgroups)
    except BaseException:
        kill_cgroups(cgroups)
        raise
    try:
        started = spawner.wait_configured()
        spawner.close()
        return started
    except BaseException:
        spawner.close()
        stop_nodes(tools["ip"], list(spawner.started.values()))
        kill_cgroups(cgroups)  # and any node that never said it was there (waited until empty)
        # A node killed before the host heard of it may have made its veth already; the
        # kernel removes it with the node's namespace, but later: remove it now, by name.
        delete_links(tools["ip"], [s.veth for s in specs])
        raise


def _new_node_cgroup(spec: NodeSpec) -> Path | None:
    cgroup = node_cgroup(spec.veth)
    return cgroup if cgroup is not None and _make_cgroup(cgroup) else None


#: The PATH of a node's first process (sshd, or a pod's command).
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _node_plans(
    specs: Sequence[NodeSpec],
    cgroups: Sequence[Path | None],
    *,
    prefixlen: int,
    subnet: str,
    mtu: int,
    tools: dict[str, str],
    bridge: str,
) -> list[NodePlan]:
    """What each node's start needs (:class:`~pytest_sky.backends.nodeinit.NodePlan`); a
    private root's layer directories are made here, on the host, before the node starts."""
    submounts: dict[tuple[Path, ...], list[tuple[str, str]]] = {}
    try:
        bridge_index = socket.if_nametoindex(bridge)
    except OSError:
        raise ProvisionError(f"bridge {bridge} is gone: was the cluster torn down meanwhile?") from None
    group, sshd_args = link_group(bridge) or 0, list(sshd_config.daemon_args(tools["sshd"]))
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
            confinement=spec.confinement,
        )
        if spec.layers is not None:
            hidden = tuple(spec.hide)
            mounts = submounts.setdefault(hidden, host_submounts(hidden))
            prepare_layers(spec.layers, mounts)
            plan.layers = str(spec.layers)
            plan.submounts = [(i, mode, path) for i, (mode, path) in enumerate(mounts, 1)]
            plan.hide = [str(h) for h in spec.hide]
            plan.node_home = NODE_HOME
            plan.shared_mounts = list(spec.shared_mounts.items())
        plans.append(plan)
    return plans


class _Spawner:
    """The one process that forks a call's nodes (``nodeinit.py``), and what it reports.

    Its command line names every node's directory (``psky-node:<dir>``), and so does each
    node's keeper, a fork of it: how :func:`node_processes` finds the nodes of a dead run."""

    def __init__(self, specs: Sequence[NodeSpec], plans: Sequence[NodePlan], cgroups: Sequence[Path | None]) -> None:
        self.specs, self.plans, self.cgroups = specs, plans, cgroups
        self.started: dict[int, NodeProcess] = {}  # every node that said it exists, by index
        argv = [sys.executable, "-S", "-I", str(NODE_INIT), *(f"psky-node:{s.root}" for s in specs)]
        # A session of its own, as each node's keeper: Ctrl-C in the terminal reaches pytest,
        # which tears nodes down in order, instead of killing them under it.  What the
        # spawner itself might print (a crash) goes to the first node's log.
        with open(plans[0].log, "ab") as log_file:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env={"PATH": NODE_PATH},
                start_new_session=True,
                close_fds=True,
            )
        self.lines = _Lines(self.popen)
        assert self.popen.stdin is not None
        try:
            self.popen.stdin.write((json.dumps({"nodes": [dataclasses.asdict(p) for p in plans]}) + "\n").encode())
            self.popen.stdin.flush()
        except BrokenPipeError:
            pass  # it ended: wait_configured() says how

    def wait_configured(self, timeout: float = 30.0) -> list[NodeProcess]:
        """Every node, once each has said it is configured (and exec's sshd); the first node
        that failed (or said nothing within ``timeout``) ends it with a ProvisionError."""
        configured: set[int] = set()  # its init said so; its keeper's "ready" may come later
        deadline = time.monotonic() + timeout
        while len(configured) < len(self.specs) or len(self.started) < len(self.specs):
            line = self.lines.next(deadline)
            if line is None:
                index = min(set(range(len(self.specs))) - (configured & set(self.started)))
                late = f"no answer within {timeout:.0f} s" if time.monotonic() >= deadline else "no output"
                raise self._failure(index, tail(Path(self.plans[index].log)) or late)
            kind, index, *rest = line.split(" ", 2)
            if kind == "failed":
                detail = " ".join(rest) or "failed"
                log_tail = tail(Path(self.plans[int(index)].log), 1)
                raise self._failure(int(index), detail + (f" | {log_tail}" if detail not in log_tail else ""))
            if kind == "ready":
                spec, (pid, init) = self.specs[int(index)], rest[0].split()
                log_path, cgroup = Path(self.plans[int(index)].log), self.cgroups[int(index)]
                self.started[int(index)] = NodeProcess(
                    spec.hostname, spec.ip, spec.veth, int(pid), int(init), log_path, cgroup
                )
            elif kind == "configured":
                configured.add(int(index))
        return [self.started[i] for i in range(len(self.specs))]

    def _failure(self, index: int, detail: str) -> ProvisionError:
        return ProvisionError(f"node {self.specs[index].hostname} did not start: {detail}")

    def close(self) -> None:
        """Let it go: once it has relayed the last report it ends by itself; before that, the
        end of its input makes it kill every node it started."""
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None and not stream.closed:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def node_mac(ip: str) -> str:
    """The node's MAC address, fixed by its IP as a machine's NIC is: a restarted node answers
    at the address its peers' ARP caches (and the bridge's) already hold, as a rebooted
    machine does, instead of going silent until every cache has expired."""
    octets = [int(o) for o in ip.split(".")]
    return ":".join(f"{b:02x}" for b in [0x02, 0x70, *octets])  # locally administered, unicast


#: Root's home on a node with a root of its own (``NodeSpec.layers``): its ``root/home``.
NODE_HOME = naming.NODE_HOME


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


class _Lines:
    """The lines a helper prints on its stdout (the real signals), each read by a deadline."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        assert popen.stdout is not None
        self.fd = popen.stdout.fileno()
        self.buffer = b""

    def next(self, deadline: float) -> str | None:
        """The next line; None at the end of the output or at ``deadline`` (``time.monotonic``)."""
        while b"\n" not in self.buffer:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.fd, 65536) if ready else b""
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode(errors="replace")


def _await_line(popen: subprocess.Popen[bytes], expected: str, failure: str, log_path: Path, timeout: float) -> None:
    """Read the one line a helper prints when it is in place."""
    if _Lines(popen).next(time.monotonic() + timeout) != expected:
        raise ProvisionError(f"{failure}: {tail(log_path) or 'no output'}")


def _child_pid(pid: int) -> int:
    """The first child of ``pid`` (a node's keeper has one: the node's first process), or 0."""
    children = procs.children(pid)
    return children[0] if children else 0


def tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def kill_and_wait(pids: Sequence[int], timeout: float = 10.0) -> list[int]:
    """SIGKILL each pid and wait until it is gone; returns the survivors.

    With pidfds (Linux 5.3+) the wait is a poll on them and a recycled pid is never hit;
    without them (an older kernel, or a seccomp filter that refuses the call), each pid is
    signalled directly and ``/proc`` is polled.
    """
    fds: dict[int, int] = {}
    polled: list[int] = []
    pidfd_open = getattr(os, "pidfd_open", None)
    for pid in pids:
        if pid <= 0:
            continue
        try:
            if pidfd_open is None:
                raise OSError(errno.ENOSYS, "no pidfd_open")
            fds[pid] = pidfd_open(pid)
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                continue  # already gone
            polled.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                polled.pop()
            continue
        try:
            signal.pidfd_send_signal(fds[pid], signal.SIGKILL)
        except OSError as exc:
            if exc.errno != errno.ESRCH:
                raise
    deadline = time.monotonic() + timeout
    poller = select.poll()
    for fd in fds.values():
        poller.register(fd, select.POLLIN)
    pending = dict(fds)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for fd, _ in poller.poll(left * 1000):
            poller.unregister(fd)
            pending = {p: f for p, f in pending.items() if f != fd}
    for fd in fds.values():
        os.close(fd)
    delay = 0.001
    while polled and time.monotonic() < deadline:
        polled = [pid for pid in polled if procs.is_alive(pid)]
        if polled:
            time.sleep(delay)  # no pidfd to wait on: /proc is the only signal there is
            delay = min(delay * 2, 0.05)
    return [pid for pid in pending if procs.is_alive(pid)] + [pid for pid in polled if procs.is_alive(pid)]


def node_processes(marker_prefix: str = "") -> list[tuple[int, str]]:
    """(pid, command line) of node processes on this host: the nodes' keepers and the spawner
    that forked them (their command line carries ``psky-node:<node dir>``) and the nodes' sshds.
    With ``marker_prefix``, only the nodes whose directory starts with it."""
    found = []
    for pid in procs.pids():
        args = procs.cmdline(pid)
        cmd = " ".join(args).strip() if args else ""
        ours = "psky-node:" in cmd or ("sshd" in cmd and "/nodes/" in cmd and "sshd_config" in cmd)
        if not ours or not procs.is_alive(pid):  # a zombie is dead for our purposes: pid 1 reaps late
            continue
        if marker_prefix and f"psky-node:{marker_prefix}" not in cmd and marker_prefix not in cmd:
            continue
        found.append((pid, cmd[:200]))
    return found


def reap_nodes(recorded: Iterable[dict], *, cgroups: Iterable[str | None] = (), node_dirs: str = "") -> None:
    """Kill nodes known only from a record, whose owner died: by their recorded cgroups, by
    their recorded pids (checked against their start times, so a recycled pid is safe), and
    by ``node_dirs`` (a node directory prefix) for nodes started but not yet recorded when
    the owner was killed: their command lines name their node directories."""
    pids: list[int] = []
    for node in recorded:
        if procs.is_alive(node["pid"], node.get("start_time")):
            init = node.get("init_pid") or 0
            if init and procs.parent_pid(init) == node["pid"]:
                pids.append(init)
            pids.append(node["pid"])
    if node_dirs:
        for pid, _ in node_processes(node_dirs):
            pids += [_child_pid(pid), pid]
    kill_cgroups(list(cgroups))
    kill_and_wait(pids)


def stop_nodes(ip: str, nodes: Sequence[NodeProcess], *, bridge: str | None = None) -> None:
    """Kill every node, then remove its links.

    A node dies by its cgroup (one write kills every process it ever started) and by its
    first process (which ends every process of its PID namespace, for a node without a
    cgroup); the last process leaving frees the network namespace, which the kernel does
    asynchronously and nothing of ours waits on: the processes, cgroups and links a later
    launch or the leak check sees are gone when this returns.  With ``bridge`` the whole
    cluster goes: the bridge and every veth on it in one deletion, last, so the bridge
    (the lease on the cluster's subnet and names) is free only once nothing else named
    after it is left (:func:`delete_cluster_links`).
    """
    signal_cgroups([n.cgroup for n in nodes])
    survivors = kill_and_wait([n.init_pid for n in nodes if n.init_pid] + [n.pid for n in nodes])
    stuck = kill_cgroups([n.cgroup for n in nodes])
    if bridge:
        delete_cluster_links(ip, bridge, [n.veth for n in nodes])
    else:
        delete_links(ip, [n.veth for n in nodes])
    if survivors:
        log.warning("node processes still alive after SIGKILL: %s", survivors)
    if stuck:
        log.warning("node cgroups not removed: %s", stuck)


# ---------------------------------------------------------------------------- faults


def spec_to_json(spec: NodeSpec) -> dict:
    """A node's spec as the journal keeps it, so that a later process can boot it again."""
    return {
        "hostname": spec.hostname,
        "ip": spec.ip,
        "root": str(spec.root),
        "veth": spec.veth,
        "extra_mounts": dict(spec.extra_mounts),
        "command": spec.command,
        "env": dict(spec.env),
        "cgroup_mode": spec.cgroup_mode,
        "layers": str(spec.layers) if spec.layers is not None else None,
        "hide": [str(h) for h in spec.hide],
        "shared_mounts": dict(spec.shared_mounts),
        "confinement": dataclasses.asdict(spec.confinement),
    }


def spec_from_json(data: dict) -> NodeSpec:
    return NodeSpec(
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
        shared_mounts=dict(data.get("shared_mounts") or {}),
        confinement=Confinement(**data["confinement"]) if "confinement" in data else privileges.for_node(),
    )


def fault_tools() -> dict[str, str]:
    """What injecting network faults takes on the host (not needed to run a cluster)."""
    needed = {
        "tc": "iproute2",
        "iptables": "iptables",
        "iptables-restore": "iptables",
        "nsenter": "util-linux",
        "unshare": "util-linux",
    }
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
    found = {tool: shutil.which(tool, path=search) for tool in needed}
    missing = sorted({needed[t] for t, path in found.items() if path is None})
    if missing:
        raise BackendUnavailableError(
            f"network faults need {', '.join(missing)}: run `apt-get install -y {' '.join(missing)}`"
        )
    return {t: p for t, p in found.items() if p is not None}


@functools.lru_cache(maxsize=1)
def netem_available() -> bool:
    """Whether this kernel has ``sch_netem``, tried where it harms nothing: a throwaway
    network namespace's loopback (many kernels, this one's too, are built without it)."""
    tools = fault_tools()
    tc = tools["tc"]
    proc = subprocess.run(
        [tools["unshare"], "--net", tc, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return proc.returncode == 0


#: The chains a node's network faults live in: its own, so a task's iptables rules stay.
FAULT_CHAINS = ("PSKY-IN", "PSKY-OUT")
DELAY_CHAIN = "PSKY-DELAY"  # mangle INPUT and OUTPUT: to the delayer
DELAY_QUEUE = 7301  # the node's NFQUEUE number (queues are per network namespace)
_IFB = "psky-ifb"


@dataclass(frozen=True)
class LinkFaults:
    """One node's share of a cluster's network faults, as its namespace applies them."""

    head_ip: str  # SSH between the head and each worker stays up: the harness's control path
    is_head: bool
    blocked: tuple[str, ...] = ()  # peers whose traffic is dropped both ways
    loss_pct: float = 0.0
    rate_mbit: float | None = None
    delay_ms: float = 0.0
    jitter_ms: float = 0.0


def iptables_rules(faults: LinkFaults, *, netem: bool) -> str:
    """``iptables-restore --noflush`` input that makes the node's fault chains ``faults``
    (declaring a chain flushes it: the previous state goes).  Delay without netem sends every
    packet through the node's delayer (mangle, before filter's drops: a packet is delayed,
    then maybe dropped, as on a real path); ``--queue-bypass``: no delayer, no delay."""
    delayed = (faults.delay_ms or faults.jitter_ms) and not netem
    lines = ["*mangle", f":{DELAY_CHAIN} - [0:0]"]
    if delayed:
        lines.append(f"-A {DELAY_CHAIN} -j NFQUEUE --queue-num {DELAY_QUEUE} --queue-bypass")
    lines += ["COMMIT", "*filter", *(f":{chain} - [0:0]" for chain in FAULT_CHAINS)]
    if faults.loss_pct and not netem:  # netem drops in its own queue
        p = f"{faults.loss_pct / 100:.6f}"
        lines += [f"-A {chain} -m statistic --mode random --probability {p} -j DROP" for chain in FAULT_CHAINS]
    for peer in faults.blocked:
        if faults.is_head:  # the head's SSH to its workers
            lines.append(f"-A PSKY-OUT -d {peer} -p tcp --dport 22 -j RETURN")
            lines.append(f"-A PSKY-IN -s {peer} -p tcp --sport 22 -j RETURN")
        elif peer == faults.head_ip:  # the head's SSH to this worker
            lines.append(f"-A PSKY-IN -s {peer} -p tcp --dport 22 -j RETURN")
            lines.append(f"-A PSKY-OUT -d {peer} -p tcp --sport 22 -j RETURN")
        lines.append(f"-A PSKY-IN -s {peer} -j DROP")
        lines.append(f"-A PSKY-OUT -d {peer} -j DROP")
    return "\n".join([*lines, "COMMIT", ""])


def shaping_commands(faults: LinkFaults, *, netem: bool, mtu: int) -> list[str]:
    """``tc`` commands (after the old shaping is removed) giving eth0 the degraded link, both
    ways: egress on eth0, ingress redirected through an ifb device and shaped there."""
    if netem:
        args = []
        if faults.delay_ms or faults.jitter_ms:
            args += ["delay", f"{faults.delay_ms:g}ms", f"{faults.jitter_ms:g}ms"]
        if faults.loss_pct:
            args += ["loss", f"{faults.loss_pct:g}%"]
        if faults.rate_mbit:
            args += ["rate", f"{faults.rate_mbit:g}mbit"]
        qdisc = ["netem", "limit", "100000", *args] if args else []
    elif faults.rate_mbit:
        # A burst of 10 ms at the rate, and never less than two packets of the link's MTU.
        burst = max(int(faults.rate_mbit * 1e6 / 8 / 100), 2 * mtu)
        qdisc = ["tbf", "rate", f"{faults.rate_mbit:g}mbit", "burst", str(burst), "latency", "200ms"]
    else:
        qdisc = []
    if not qdisc:
        return []
    q = " ".join(qdisc)
    return [
        f"qdisc add dev eth0 root {q}",
        f"link add {_IFB} type ifb",
        f"link set {_IFB} up",
        f"qdisc add dev {_IFB} root {q}",
        "qdisc add dev eth0 handle ffff: ingress",
        f"filter add dev eth0 parent ffff: protocol all u32 match u32 0 0 action mirred egress redirect dev {_IFB}",
    ]


def apply_link_faults(init_pid: int, faults: LinkFaults, *, netem: bool, mtu: int, ip: str) -> None:
    """Make ``faults`` the network state of the node whose first process is ``init_pid``,
    inside its network namespace (one shell there: iptables, tc and ip as the host has them)."""
    tools = fault_tools()
    tc, ipt = tools["tc"], tools["iptables"]
    script = "\n".join(
        [
            "set -e",
            f"{tools['iptables-restore']} -w --noflush <<'EOF'\n{iptables_rules(faults, netem=netem)}EOF",
            *(
                f"{ipt} -w -t {table} -C {base} -j {chain} 2>/dev/null || {ipt} -w -t {table} -I {base} 1 -j {chain}"
                for table, base, chain in (
                    ("filter", "INPUT", "PSKY-IN"),
                    ("filter", "OUTPUT", "PSKY-OUT"),
                    ("mangle", "INPUT", DELAY_CHAIN),
                    ("mangle", "OUTPUT", DELAY_CHAIN),
                )
            ),
            f"{tc} qdisc del dev eth0 root 2>/dev/null || true",
            f"{tc} qdisc del dev eth0 ingress 2>/dev/null || true",
            f"{ip} link del {_IFB} 2>/dev/null || true",
            *(
                f"{ip} {c}" if c.startswith("link ") else f"{tc} {c}"
                for c in shaping_commands(faults, netem=netem, mtu=mtu)
            ),
        ]
    )
    proc = subprocess.run(
        [tools["nsenter"], "-t", str(init_pid), "-n", "/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        err = proc.stderr.strip().splitlines()
        raise SkyError(f"could not change the network of node pid {init_pid}: {err[-1] if err else proc.returncode}")


@dataclass(frozen=True)
class Delayer:
    """A node's packet delayer (``nfdelay.py``): its pid and that of the ``nsenter`` that
    started it, each with its start time, so a recycled pid is never signalled."""

    pid: int
    start_time: int | None
    parent: int
    parent_start: int | None


def start_delayer(init_pid: int, delay_ms: float, jitter_ms: float, log_path: Path) -> Delayer:
    """Start the delayer in the node's network and PID namespaces (it dies with the node)
    and return once it owns the node's queue (it says ``bound``)."""
    script = Path(__file__).with_name("nfdelay.py")
    argv = [fault_tools()["nsenter"], "-t", str(init_pid), "-n", "-p", sys.executable, "-I", str(script)]
    with open(log_path, "ab") as log_file:
        popen = subprocess.Popen(
            [*argv, str(DELAY_QUEUE), f"{delay_ms:g}", f"{jitter_ms:g}"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            start_new_session=True,
            close_fds=True,
        )
    try:
        _await_line(popen, "bound", "the node's packet delayer did not start", log_path, timeout=30.0)
    except BaseException:
        kill_and_wait([*procs.children(popen.pid), popen.pid])
        popen.wait(5)
        raise
    child = _child_pid(popen.pid)
    return Delayer(child, procs.start_time(child), popen.pid, procs.start_time(popen.pid))


def stop_delayer(delayer: Delayer) -> None:
    """Kill a delayer (and its ``nsenter``) if they are still the processes recorded."""
    pids = [
        pid
        for pid, start in ((delayer.pid, delayer.start_time), (delayer.parent, delayer.parent_start))
        if pid and procs.is_alive(pid, start)
    ]
    kill_and_wait(pids)
