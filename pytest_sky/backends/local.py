"""The local backend: a cluster of namespace nodes on this machine (DESIGN.md section 5).

Each cluster owns one /24 of 198.18.0.0/15 and a network namespace of its own, held by its
holder (``netns.userns``, ``clusterns.py``), with the cluster's bridge and gateway at ``.1``;
its nodes are ``<cluster>-head`` at ``.2`` and ``<cluster>-worker<i>`` at ``.2+i``, each a
``netns`` node running sshd.  The host reaches them over its one link into that namespace
(``psky<index>``); they reach the world through the gateway, as a pod through its NAT, and
never the host.  Each node's root filesystem is a copy-on-write layer over this
machine's (``layers/<rank>`` in the cluster's directory), so the nodes run the same Python and
tools as the test that launched them, while what one writes (``/tmp``, a ``pip install``)
is its own, as on a real machine: never another node's, never the host's, and gone with
the cluster.  Each has its own home, and none sees pytest-sky's state directory.

Run by an ordinary user, the same clusters are rootless: the holder's namespace is a user
namespace's, the nodes run as the user and are reached through the holder's door (DESIGN.md
section 5, "Rootless").
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from pytest_sky import console, gpus, naming, procs
from pytest_sky.backends import clusterns, confine, gateway, netns, privileges
from pytest_sky.backends.base import Backend, HomeFiles, LinkDegradation, NetworkFaults, ProvisionConfig
from pytest_sky.backends.local_journal import LocalJournal
from pytest_sky.cluster_info import ClusterInfo, NodeInfo, SshRoute
from pytest_sky.errors import NotSupportedError, ProvisionError, ResourcesError
from pytest_sky.resources import Resources
from pytest_sky.settings import DEFAULT_MTU
from pytest_sky.ssh import sshd
from pytest_sky.ssh.banner import NO_BANNER, wait_for_banners
from pytest_sky.ssh.keys import write_private
from pytest_sky.state import Journal

log = logging.getLogger(__name__)

MAX_NODES = 250
READY_TIMEOUT = 60.0


def veth_name(index: int, rank: int) -> str:
    return f"{netns.LINK_PREFIX}{index}n{rank}"


def hosts_file(nodes: list[NodeInfo]) -> str:
    """Every node by name, also in ``::ffff:`` form: gloo binds to what the hostname resolves
    to, and torch's c10d store reverse-resolves IPv4-mapped peers (else a 1 s DNS wait)."""
    lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
    for n in nodes:
        lines.append(f"{n.ip} {n.hostname} {n.name}" if n.rank else f"{n.ip} {n.hostname}")
    for n in nodes:
        lines.append(f"::ffff:{n.ip} {n.hostname}")
    return "\n".join(lines) + "\n"


def passwd_with_home(home: str | Path = netns.NODE_HOME, user: str = "root") -> str:
    """The host's /etc/passwd with ``user``'s home moved (root's, or a rootless node's
    user's): sshd takes home from getpwnam."""
    out = []
    for line in Path("/etc/passwd").read_text().splitlines():
        fields = line.split(":")
        if len(fields) >= 7 and fields[0] == user:
            fields[5] = str(home)
            fields[6] = "/bin/bash"
            line = ":".join(fields)
        out.append(line)
    return "\n".join(out) + "\n"


def shadow_entry(user: str) -> str:
    """A rootless node's ``/etc/shadow``: its user's entry, with no password (logins are by
    key only) rather than the host's, which the user may not read.  An sshd that cannot read
    the host's takes whatever the host's account database tells it, and calls an account
    such as ``nobody`` locked."""
    return f"{user}::{int(time.time() // 86400)}:0:99999:7:::\n"


class LocalBackend(Backend):
    name = "local"
    cloud_label = "Local"
    multiplex_client = True

    def __init__(
        self,
        mtu: int | None = None,
        ready_timeout: float = READY_TIMEOUT,
        devices: list[str] | None = None,
        node_cgroups: str = "rw",
        private_root: bool = True,
        node_refused_syscalls: list[str] | None = None,
        rootdir: str | None = None,
    ) -> None:
        self.mtu = int(mtu or DEFAULT_MTU)
        if not 1280 <= self.mtu <= 65535:
            raise ProvisionError(f"MTU must be between 1280 and 65535, got {self.mtu} (PYTEST_SKY_MTU)")
        self.ready_timeout = ready_timeout
        #: Each node a root filesystem of its own (the default, as a machine has).  False only
        #: for the benchmark's baseline of what the extra mounts cost: nodes then share the
        #: host's files, which no real cluster does.
        self.private_root = private_root
        self._devices = devices
        #: How nodes see their cgroup: "rw" as a machine does; "ro" as a Kubernetes pod does
        #: (tests of the agent's fallback for pods use it).
        self.node_cgroups = node_cgroups
        #: System calls the nodes' seccomp profile refuses, as an older runtime's refuses
        #: pidfd_open (tests of the agent's fallback for such pods use it).
        self.node_refused_syscalls = _refusable(node_refused_syscalls or [])
        #: A directory the nodes see wherever it lives, as they see the interpreter pytest runs
        #: and its virtualenv (the plugin gives pytest's rootdir: ``--sky-rootdir``).
        self.rootdir = rootdir
        self._nodes: dict[str, list[netns.NodeProcess]] = {}

    # -- interface -------------------------------------------------------------------------

    def plan(self, name: str, num_nodes: int, resources: Resources, shared_dir: str | None = None) -> None:
        if num_nodes > MAX_NODES:
            raise ResourcesError(
                f"num_nodes={num_nodes} is more than the local backend's {MAX_NODES} nodes per cluster"
            )
        gpus.allocate(self.devices(), num_nodes, resources.accelerators)  # refuses what cannot fit
        netns.local_mode()  # says in one line why neither mode can run here
        netns.require_tools()
        netns.holder_tools()

    def has_gpus(self) -> bool:
        return bool(self.devices())

    def devices(self) -> list[str]:
        """GPUs the nodes may share: injected (tests), else CUDA_VISIBLE_DEVICES, else all."""
        if self._devices is None:
            visible = gpus.visible_from_env()
            self._devices = visible if visible is not None else gpus.detect_devices()
        return self._devices

    def _forward_env(self) -> dict[str, str]:
        """The interpreter pytest runs under comes first on every node's PATH, activated or not,
        so ``python`` and ``torchrun`` in a run section are the test's own."""
        bindir = os.path.dirname(sys.executable)
        path = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != bindir]
        env = {"PATH": os.pathsep.join([bindir, *path])}
        # What GPU software stacks need to find their libraries (NGC-style containers).
        for key, value in os.environ.items():
            if key in ("LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "PYTHONPATH") or key.startswith("NCCL_"):
                env[key] = value
        if sys.prefix != sys.base_prefix:
            env["VIRTUAL_ENV"] = sys.prefix
        elif os.environ.get("VIRTUAL_ENV"):
            env["VIRTUAL_ENV"] = os.environ["VIRTUAL_ENV"]
        return env

    def _seen(self) -> list[str]:
        """What every node sees wherever it lives (``netns.view``): the interpreter pytest runs
        (``sys.prefix``, and ``sys.base_prefix``, a pyenv build under ``~/.pyenv`` say), its
        virtualenv, its import path (what a ``.pth`` file adds: an editable install's source
        tree, another environment's site-packages; the node's interpreter reads the same
        ``.pth`` files and must find what they name), the ``PYTHONPATH`` every node is given
        (:meth:`_forward_env`) and the rootdir.  Not the working directory that ``python -m``
        puts first on the import path: a node runs in its own home, and where pytest was
        started from a home that home would show whole."""
        path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        cwd = os.path.realpath(os.getcwd())
        imports = [p for p in sys.path if p and os.path.realpath(p) != cwd]
        seen = (sys.prefix, sys.base_prefix, os.environ.get("VIRTUAL_ENV"), *imports, *path, self.rootdir)
        return [p for p in seen if p]

    @property
    def rootless(self) -> bool:
        """This process makes rootless clusters (it is not root: ``netns.local_mode``)."""
        return netns.local_mode() is netns.LocalMode.ROOTLESS

    def create(self, config: ProvisionConfig) -> ClusterInfo:
        tools = netns.require_tools()
        journal = config.journal
        if self.rootless:
            _check_rootless(config, self.private_root)
        # Its subnet is leased by the holder, its links in its namespace, but for root's link
        # from the host (named after the subnet: the bridge the journal names).
        holder = netns.start_holder(config.cluster_dir, self.mtu, rootless=self.rootless)
        index = holder.index
        bridge = "" if holder.rootless else clusterns.bridge_name(index)
        subnet, base = clusterns.subnet_of(index)
        veths = [veth_name(index, r) for r in range(config.num_nodes)]
        state = LocalJournal(index=index, bridge=bridge, veths=veths, holder=holder)
        state.save(journal)
        try:
            shares = gpus.allocate(self.devices(), config.num_nodes, config.resources.accelerators)
            info = ClusterInfo(
                nodes=tuple(
                    self._node_info(config.name, r, f"{base}{2 + r}", shares, holder) for r in range(config.num_nodes)
                ),
                python=sys.executable,
                env=self._forward_env(),
                cloud=self.name,
                region=self.name,
            )
            specs = self._write_node_dirs(config, info, index, shares)
            if config.shared_dir:  # one directory of the cluster's, the same on every node
                shared = config.cluster_dir / "shared"
                shared.mkdir(mode=0o755, exist_ok=True)
                for spec in specs:
                    spec.shared_mounts[str(shared)] = config.shared_dir
            # Intent before action: a run killed while its nodes start leaves a journal from
            # which the next run's reaper finds them (their cgroups, their command lines).
            state.cgroups = [str(netns.node_cgroup(s.veth) or "") for s in specs]
            state.node_dirs = str(config.cluster_dir / "nodes") + "/"
            state.specs = specs  # what restart_node needs to boot a node again, from any process
            state.mtu = self.mtu
            state.home_files = sorted(config.home_files)
            state.save(journal)
            started = netns.start_nodes(
                specs, bridge=bridge, prefixlen=24, subnet=subnet, mtu=self.mtu, tools=tools, holder=holder
            )
            self._nodes[config.name] = started
            state.nodes = [netns.NodeRecord.of(n) for n in started]
            state.save(journal)
            _wait_ready(started, self.ready_timeout, holder)
            netns.await_gateway(holder, config.cluster_dir)  # made while the nodes started
            return info
        except BaseException:
            self.destroy(config.name, journal)
            raise

    @staticmethod
    def _node_info(cluster: str, rank: int, ip: str, shares: list[str], holder: netns.Holder | None) -> NodeInfo:
        route = SshRoute(hostname=ip)
        if holder is not None and holder.rootless:  # through its holder's door, as the user who launched it
            proxy = netns.dial_command(holder.door, ip)
            route = SshRoute(hostname=ip, proxy_command=proxy, user=netns.node_user()[0], door=holder.door)
        return NodeInfo(
            rank=rank,
            name=naming.node_name(rank),
            hostname=naming.node_hostname(cluster, rank),
            ip=ip,
            route=route,
            env={"CUDA_VISIBLE_DEVICES": gpus.node_view(shares[rank])} if shares else {},
        )

    def put_files(self, name: str, journal: Journal, info: ClusterInfo, files: HomeFiles) -> None:
        root = journal.cluster_dir / "nodes"  # where create wrote each node's directory
        for node in info.nodes:
            _write_home(root / str(node.rank) / "home", files)
        # What a wiped node's home gets back (its provisioned files, as a fresh machine would).
        state = LocalJournal.load(journal)
        state.home_files = sorted({*state.home_files, *files})
        state.save(journal)

    def destroy(self, name: str, journal: Journal) -> None:
        try:
            state = LocalJournal.load(journal)
        except ProvisionError as exc:  # best effort: the nodes by their directories, the bridge by its alias
            log.warning("%s: removing the cluster by what its directory names", exc)
            state = LocalJournal(node_dirs=str(journal.cluster_dir / "nodes") + "/")
        tools = netns.require_tools()
        if state.specs and len(state.nodes) == len(self._nodes.get(name, [])):
            for rank in range(len(state.nodes)):  # a node another process restarted is stopped too
                self._node(name, state, rank)
        started = self._nodes.pop(name, None)
        holder = state.holder
        if holder.rootless if holder is not None else not netns.holds_root_caps():  # no link on the host
            if started is not None:
                netns.stop_nodes(tools["ip"], started, host_links=False)
            else:
                netns.reap_nodes(state.nodes, node_dirs=state.node_dirs)
            netns.stop_holder(holder, journal.cluster_dir)
            return
        # Root's: the host's link into the cluster's namespace (or an earlier version's bridge)
        # first, then the holder.  A launch interrupted between leasing and writing that down
        # left no journal entry for it; the link's alias still names this cluster's directory.
        bridge = state.bridge or netns.bridge_owned_by(str(journal.cluster_dir))
        if started is not None:
            netns.stop_nodes(tools["ip"], started, host_links=False)
        else:
            netns.reap_nodes(state.nodes, cgroups=state.cgroups, node_dirs=state.node_dirs)
        if bridge:
            netns.delete_cluster_links(tools["ip"], bridge, state.veths)
        else:
            netns.delete_links(tools["ip"], state.veths)
        netns.stop_holder(holder, journal.cluster_dir)

    def reap_stray_links(self, clusters_dir: Path) -> list[str]:
        """Nodes and links of clusters of ``clusters_dir`` that lost their record
        (``netns.reap_abandoned``: a launch killed before it recorded them, a state
        directory deleted while they ran), their namespaces' holders and, machine-wide, every
        holder whose owner is provably gone (``netns.reap_ownerless_holders``; their
        namespaces take root's links into them along: such a link has no ports, so is no
        stray bridge), and bridges of ours that nobody will tear down
        (``netns.reap_stray_bridges``: no node on them and an owner provably gone, whatever
        state directory or emulator it was) with the empty node cgroups whose bridge is
        gone; each as the reaper's report names it.

        Under the exclusive :func:`netns.link_lock`: creators name their bridges while
        holding it shared, so one without a name is a creator's that died in between (no
        timing guesses).  A bridge whose owner lives stays, whichever state directory it is in."""
        if self.rootless:  # nothing of a rootless cluster is on the host but its holder
            return netns.reap_stray_holders(clusters_dir) + netns.reap_ownerless_holders(None)
        ip = netns.require_tools()["ip"]
        with netns.link_lock(exclusive=True):
            # Root's holders too (their namespaces take their host links), before the bridges.
            gone = netns.reap_abandoned(ip, clusters_dir) + netns.reap_stray_holders(clusters_dir)
            return gone + netns.reap_ownerless_holders(ip) + netns.reap_stray_bridges(ip)

    # -- faults ----------------------------------------------------------------------------

    def kill_node(self, name: str, journal: Journal, rank: int) -> None:
        """Every process of the node dies at once: its PID namespace's first process (the
        kernel kills the rest with it) and its cgroup; its veth goes with its namespace."""
        state = LocalJournal.load(journal)
        node = self._node(name, state, rank)
        netns.stop_nodes(netns.require_tools()["ip"], [node], host_links=state.holder is None)
        node.pid = node.init_pid = 0  # reaped: never signal these numbers again

    def restart_node(self, name: str, journal: Journal, info: ClusterInfo, rank: int, wipe: bool) -> ClusterInfo:
        """Boot the node from its spec in the journal: same directory (host key, sshd config,
        home, layers), same veth name and address; its network faults are applied again."""
        self.kill_node(name, journal, rank)  # a running node is rebooted
        state = LocalJournal.load(journal)
        if state.index is None or rank >= len(state.specs) or rank >= len(state.nodes):
            raise ProvisionError(f"cluster {name}'s journal does not say how to boot node {rank} again")
        spec = state.specs[rank]
        if wipe:
            _wipe(spec, state.home_files)
        tools = netns.require_tools()
        started = netns.start_nodes(
            [spec],
            bridge=state.bridge,
            prefixlen=24,
            subnet=clusterns.subnet_of(state.index)[0],
            mtu=state.mtu or self.mtu,
            tools=tools,
            holder=state.holder,
        )
        if name in self._nodes:
            self._nodes[name][rank] = started[0]
        state.nodes[rank] = netns.NodeRecord.of(started[0])
        state.save(journal)
        _wait_ready(started, self.ready_timeout, state.holder)
        faults = self.network_faults(journal)
        if faults:
            self.set_network_faults(name, journal, info, faults)
        return info  # same address, same MAC: nothing names it differently

    def network_faults(self, journal: Journal) -> NetworkFaults:
        return LocalJournal.load(journal).faults

    def set_network_faults(self, name: str, journal: Journal, info: ClusterInfo, faults: NetworkFaults) -> None:
        """Each node's share applied inside its own namespace (a killed node gets its share
        when it restarts).  Recorded first, so a half-applied state is still healed."""
        netem = netns.netem_available()
        state = LocalJournal.load(journal)
        state.faults = faults
        state.save(journal)
        ips = [n.ip for n in info.nodes]
        for rank in range(len(ips)):
            node = self._node(name, state, rank)
            old = state.delayers.pop(rank, None)
            if not node.init_pid:
                continue
            d = faults.degraded.get(rank, LinkDegradation())
            share = netns.LinkFaults(
                head_ip=ips[0],
                is_head=rank == 0,
                blocked=tuple(ips[r] for r in sorted(faults.cut_off(rank))),
                loss_pct=d.loss_pct,
                rate_mbit=d.rate_mbit,
                delay_ms=d.delay_ms,
                jitter_ms=d.jitter_ms,
            )
            if old is not None:  # a queue has one owner: the old delayer goes first
                netns.stop_delayer(old)
            if (d.delay_ms or d.jitter_ms) and not netem:
                state.delayers[rank] = netns.start_delayer(
                    node.init_pid, d.delay_ms, d.jitter_ms, node.log_path, state.holder
                )
                state.save(journal)  # on record before its rules send it packets
            mtu = state.mtu or self.mtu
            netns.apply_link_faults(
                node.init_pid, share, netem=netem, mtu=mtu, ip=netns.require_tools()["ip"], holder=state.holder
            )
        state.save(journal)

    def link_shaping(self) -> str:
        return "netem" if netns.netem_available() else "tbf+iptables+nfqueue"

    def _node(self, name: str, state: LocalJournal, rank: int) -> netns.NodeProcess:
        """Node ``rank`` as this process started it, or as the journal says (another process
        started it, or restarted it since: the CLI's ``fault``): its pids only while they are
        still the ones recorded (pid reuse)."""
        started = self._nodes.get(name)
        record, spec = state.nodes[rank], state.specs[rank]
        if started is not None and started[rank].pid == record.pid:
            return started[rank]
        alive = procs.is_alive(record.pid, record.start_time)
        init = record.init_pid
        cgroup = state.cgroup(rank)
        node = netns.NodeProcess(
            hostname=spec.hostname,
            ip=spec.ip,
            veth=spec.veth,
            pid=record.pid if alive else 0,
            init_pid=init if alive and init and procs.parent_pid(init) == record.pid else 0,
            log_path=Path(record.log) if record.log else spec.root / netns.NODE_LOG,
            cgroup=Path(cgroup) if cgroup else None,
        )
        if started is not None:
            started[rank] = node  # what teardown stops, too
        return node

    # -- helpers ---------------------------------------------------------------------------

    def _write_node_dirs(
        self, config: ProvisionConfig, info: ClusterInfo, index: int, shares: list[str]
    ) -> list[netns.NodeSpec]:
        hosts = hosts_file(list(info.nodes))
        view = netns.node_view(self._seen()) if self.private_root else []
        # Names resolved through the cluster's gateway, as a pod's through the cluster's DNS.
        resolver = gateway.resolv_conf(_read("/etc/resolv.conf"), clusterns.subnet_base(index) + "1")
        path_env = info.env["PATH"]
        user = info.head.route.user  # root, or on a rootless cluster the user who launched it
        specs = []
        for node in info.nodes:
            root = config.cluster_dir / "nodes" / str(node.rank)
            if root.exists():
                shutil.rmtree(root)
            (root / "etc").mkdir(parents=True, mode=0o700)
            home = root / "home"
            home.mkdir(mode=0o700)
            node_home = str(netns.NODE_HOME if self.private_root else home)
            (root / "etc" / "passwd").write_text(passwd_with_home(node_home, user))
            (root / "etc" / "hosts").write_text(hosts)
            (root / "etc" / "resolv.conf").write_text(resolver)
            for written in ("passwd", "resolv.conf"):
                os.chmod(root / "etc" / written, 0o644)
            if info.head.route.door:
                (root / "etc" / "shadow").write_text(shadow_entry(user))
                os.chmod(root / "etc" / "shadow", 0o600)
            os.chmod(root / "etc" / "hosts", 0o644)
            host_key = root / "ssh_host_ed25519_key"
            write_private(host_key, config.keys.hosts[node.rank].private_openssh)
            (root / "sshd_config").write_text(
                sshd.render(
                    listen=f"{node.ip}:22",
                    host_key=str(host_key),
                    pid_file="/run/sshd.pid",
                    path_env=path_env,
                    home=node_home,
                )
            )
            _write_home(home, config.home_files)
            specs.append(
                netns.NodeSpec(
                    hostname=node.hostname,
                    ip=node.ip,
                    root=root,
                    veth=veth_name(index, node.rank),
                    # A user's cgroups are not theirs to give: a rootless node has none.
                    cgroup_mode="" if info.head.route.door else self.node_cgroups,
                    # A machine of its own: its writes stay on it, and it sees no state of ours.
                    layers=config.cluster_dir / "layers" / str(node.rank) if self.private_root else None,
                    hide=[config.cluster_dir.parent.parent] if self.private_root else [],
                    view=view,  # the host's software, not its users' homes or scratch files
                    # What its pod would hold on Kubernetes, and exactly its GPUs.
                    confinement=dataclasses.replace(
                        privileges.for_node(config.privileges, gpus.device_files(shares[node.rank])),
                        refused_syscalls=self.node_refused_syscalls,
                    ),
                )
            )
        return specs


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _refusable(names: list[str]) -> list[str]:
    unknown = sorted(set(names) - set(confine.REFUSABLE_SYSCALLS))
    if unknown:
        known = ", ".join(confine.REFUSABLE_SYSCALLS)
        raise ProvisionError(f"node_refused_syscalls: {', '.join(unknown)} cannot be refused here (known: {known})")
    return list(names)


def _wait_ready(started: list[netns.NodeProcess], timeout: float, holder: netns.Holder | None = None) -> None:
    """Every sshd has sent its banner: the real signal, no sleeps standing in for it
    (through the holder's door, for a rootless cluster's nodes)."""
    ready = [0]

    def gone(i: int) -> str | None:
        node = started[i]
        return None if procs.is_alive(node.pid) else f"node exited: {netns.tail(node.log_path) or 'no output'}"

    def counted(i: int) -> None:
        ready[0] += 1
        console.counter("nodes ready", ready[0], len(started))

    opener = functools.partial(clusterns.dial, holder.door) if holder is not None and holder.rootless else None
    failed = wait_for_banners(
        [(n.ip, 22) for n in started],
        deadline=time.monotonic() + timeout,
        gone=gone,
        on_ready=counted,
        opener=opener,
    )
    if failed:
        i, why = min(failed.items())
        node = started[i]
        if why == NO_BANNER:
            why = f"sshd sent no banner within {timeout:.0f} s: {netns.tail(node.log_path)}"
        raise ProvisionError(f"node {node.hostname} did not come up: {why}")


def _check_rootless(config: ProvisionConfig, private_root: bool) -> None:
    """What a rootless node cannot be, said before anything starts: its processes are the
    user's own, so it holds no capability to give, and its root is built of layers."""
    if config.privileges:
        raise NotSupportedError(
            f"{config.privileges.describe()} asked for, and this user's local nodes run as the user, "
            "not root: run pytest as root for the local backend, or use --kubernetes"
        )
    if not private_root:
        raise NotSupportedError("rootless local nodes always have a root filesystem of their own (private_root)")


def _wipe(spec: netns.NodeSpec, home_files: list[str]) -> None:
    """A node's disk as provisioning left it: its root's layers gone, its home holding only
    the files provisioning wrote (keys, the agent, the ssh config)."""
    home = spec.root / "home"
    keep: HomeFiles = {}
    for rel in home_files:
        path = home / rel
        if path.is_file():
            keep[rel] = (path.read_bytes(), path.stat().st_mode & 0o777)
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(mode=0o700)
    _write_home(home, keep)
    if spec.layers is not None:
        shutil.rmtree(spec.layers, ignore_errors=True)


def _write_home(home: Path, files: HomeFiles) -> None:
    for rel, (content, mode) in files.items():
        dest = home / rel
        dest.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if mode & 0o077 == 0:
            write_private(dest, content)
        else:
            dest.write_bytes(content)
            os.chmod(dest, mode)
