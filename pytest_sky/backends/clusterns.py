"""A cluster's network: the namespace its nodes hang off, its way out, and the door into it.

Each local cluster's bridge lives in a network namespace of its own, held by this program
for the cluster's life (DESIGN.md section 5): nothing of the nodes' network is the host's, so
no rule of the host's firewall and no setting of its forwarding is needed to keep them from
the host, and none is changed.  The bridge is at ``.1`` of the cluster's subnet, every node's
gateway and nameserver; the gateway's relay (``gateway.py``) carries the nodes' connections
to the world as a pod's NAT would, and nowhere else.

``python -S -I clusterns.py hold psky-cluster:<cluster dir> @DOOR MTU MODE IPTABLES_RESTORE [AVOID]``
    forks the gateway's dialer (it stays in the host's network namespace); leases a /24 of
    198.18.0.0/15; makes a network namespace, and for ``MODE`` ``rootless`` the user
    namespace that owns it (the user is uid 0 in it, the only uid an unprivileged user may
    map); makes the cluster's bridge with the address ``.1`` and the gateway's rules and
    relay; says ``LEASED <subnet index> <bridge ifindex> <dialer pid>`` on stdout once its
    nodes may start, ``READY`` once its gateway is, and then serves its door.
    The lease and the door are abstract unix sockets of the host's network namespace, bound
    before the holder leaves it: no file to leave behind and no path to outgrow a socket
    address, and both are free again the moment the holder dies, whatever killed it.  The
    door answers its own user only (``SO_PEERCRED``).  The host starts the nodes in its
    namespaces (``nsenter --target <holder> [--user] --net``) and stops it with a signal: the
    bridge and every veth go with its network namespace.

    ``MODE`` ``root``: the host reaches the nodes by a route of its own, over one veth pair,
    ``psky<index>`` on the host (``.254``, the cluster's lease and link group, named after
    its directory) to ``uplink`` in the namespace; ``AVOID``, comma-separated, the networks
    the host routes elsewhere (no subnet overlapping one is leased).

``python -S -I clusterns.py dial @DOOR IP PORT``
    an OpenSSH ProxyCommand with ``ProxyUseFdpass yes``: asks the holder for a TCP
    connection to a node, made inside the cluster's network, and hands ssh the socket
    itself, so nothing relays the session's bytes.  A rootless client's own connection and
    its readiness checks call :func:`dial` in-process.

The door's protocol (one request line, one reply line with the socket passed alongside,
``SCM_RIGHTS``) is ``fdpass``'s; standard library only, because the holder and the dialler
run as programs of their own, and little of it on the way to ``dial``, which runs once per
ssh connection (the holder imports ``gateway`` itself, once its nodes may start).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import os
import random
import socket
import struct
import sys
import threading
import types
from collections.abc import Callable

try:
    from pytest_sky.backends import fdpass, netlink
except ImportError:  # run as the program it is: from its directory
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fdpass  # type: ignore[import-not-found,no-redef]
    import netlink  # type: ignore[import-not-found,no-redef]

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
NUM_SUBNETS = 512  # 198.18.0.0/15 in /24s, as the root mode leases them
#: Every link we create starts with this, so leaks are easy to find (``pytest-sky doctor``).
LINK_PREFIX = "psky"
#: Link groups (``ip link ... group N``) of our clusters: the host's links of subnet ``i``
#: are in group ``LINK_GROUP_BASE + i``.  Far from 0 (every link's default) and from the
#: small numbers a host's own ``/etc/iproute2/group`` would name.
LINK_GROUP_BASE = 0x70730000
#: The host's address on a root cluster's uplink (nodes are at .2 up to .251).
HOST_END = 254
UPLINK = "uplink"  # the holder's end of a root cluster's link from the host
IFLA_BR_FORWARD_DELAY = 1
#: How long the holder waits for a node to accept a connection before it answers ETIMEDOUT.
CONNECT_SECONDS = 10.0


def subnet_base(index: int) -> str:
    """``198.x.y.`` of subnet ``index``: the one definition, which the local backend reads too."""
    return f"198.{18 + index // 256}.{index % 256}."


def subnet_of(index: int) -> tuple[str, str]:
    """(``198.x.y.0/24``, ``198.x.y.``) of subnet ``index``."""
    base = subnet_base(index)
    return base + "0/24", base


def bridge_name(index: int) -> str:
    """The bridge of subnet ``index``: root's on the host, a holder's in its namespace."""
    return f"{LINK_PREFIX}{index}"


def subnet_lease_name(index: int) -> bytes:
    """The abstract socket name that leases subnet ``index`` to one holder on this host."""
    return f"\0pytest-sky-subnet-{index}".encode()


# -- the door's protocol -----------------------------------------------------------------------


def door_address(door: str) -> str:
    """The socket address of a door written ``@name`` (an abstract socket)."""
    return "\0" + door.removeprefix("@")


def dial(door: str, ip: str, port: int, timeout: float = CONNECT_SECONDS + 5) -> socket.socket:
    """A TCP connection to ``ip:port`` inside the cluster's network, made by its holder.

    Raises OSError with the errno the holder's connect got (ECONNREFUSED while a node's sshd
    is not listening yet), or ECONNREFUSED when the holder itself is gone."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(door_address(door))
        return fdpass.take_socket(conn, f"{ip} {port}", "the cluster's holder said no more")


def _connect(conn: socket.socket, line: bytes) -> socket.socket:
    """The connection a door's request asks for, made in this namespace; OSError why not."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.getuid():  # another user's process: the door is not theirs to use
        raise OSError(errno.EACCES, "this cluster is another user's")
    try:
        ip, port = line.decode().split()
        return socket.create_connection((ip, int(port)), timeout=CONNECT_SECONDS)
    except ValueError:
        raise OSError(errno.EINVAL, "not a dial request") from None
    except OSError as exc:
        code = exc.errno or errno.ETIMEDOUT
        raise OSError(code, os.strerror(code)) from None


# -- the holder --------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _enter_own_namespaces(rootless: bool = True) -> None:
    """A network namespace of its own; rootless, in a user namespace where this user is
    root, which owns it."""
    if not rootless:
        if _libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(net): {os.strerror(err)}")
        return
    uid, gid = os.getuid(), os.getgid()
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(user, net): {os.strerror(err)}")
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def subnet_leased(index: int) -> bool:
    """A holder on this host holds subnet ``index`` (root's clusters keep clear of it too, so
    that no address means two clusters on one host)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(subnet_lease_name(index))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def lease_order() -> list[int]:
    """Every subnet's index, from a random one on: leasers that start together rarely try the
    same one first."""
    start = random.randrange(NUM_SUBNETS)
    return [(start + step) % NUM_SUBNETS for step in range(NUM_SUBNETS)]


def _lease(claim: Callable[[int], bool] = lambda _: True) -> tuple[int, socket.socket]:
    """A subnet no other holder on this host has, and no bridge of root's (the emulator's, or
    a cluster's of an earlier version: named after it), held by a socket bound in the host's
    namespace (so bound before this process leaves it), and that ``claim`` takes.

    Bound first, then the bridge looked for: a root leaser creates its bridge first and then
    looks for this lease (``netns.lease_subnet``), so of two racing for one subnet at least
    one sees the other."""
    for index in lease_order():
        lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lease.bind(subnet_lease_name(index))
        except OSError as exc:
            lease.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            continue
        if _root_bridge(index) or not claim(index):
            lease.close()
            continue
        return index, lease
    raise OSError(errno.EADDRINUSE, f"all {NUM_SUBNETS} subnets are leased on this host")


def _root_bridge(index: int) -> bool:
    """A link of root's (an emulator's bridge, a root cluster's uplink) is named after subnet ``index``."""
    return os.path.exists(f"/sys/class/net/{bridge_name(index)}")


def link_lock_path() -> str:
    """The lock creators of our links hold (shared) until each is named after its owner, and
    a reaper (exclusive) while it looks for links no one named: one without a name, seen
    under it, is a creator's that died in between (``netns.link_lock``)."""
    if os.path.isdir("/run/lock"):
        return "/run/lock/pytest-sky-links.lock"
    import tempfile  # 20 ms and more: only where it is needed (``dial`` never is)

    return os.path.join(tempfile.gettempdir(), "pytest-sky-links.lock")


class Uplink:
    """A root cluster's link from the host: a veth pair whose host end, made in the host's
    namespace, is the subnet's lease among root's links (``psky<index>``, named after the
    cluster, the host's end of the route to the nodes), and whose other end, ``uplink``, is
    made in the holder's own namespace at once (a link moved there afterwards costs a
    network synchronisation, about 30 ms here).  Root may come and go between namespaces:
    the holder's is made first and left, and entered once the host's side is in place.  The
    host's end answers nothing of the nodes': the gateway forwards only what the host
    started (``gateway.rules``)."""

    def __init__(self, owner: str, mtu: int, avoid: list[str]) -> None:
        self.owner, self.mtu = owner, mtu
        self.avoid = [_network(n) for n in avoid]
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE)
        self.host_ns = os.open("/proc/self/ns/net", os.O_RDONLY)
        _enter_own_namespaces(rootless=False)
        self.own_ns = os.open("/proc/self/ns/net", os.O_RDONLY)
        _setns(self.host_ns)
        self.index = -1

    def claim(self, index: int) -> bool:
        """Make the pair for subnet ``index``; False when the host routes the subnet
        elsewhere (a VPN's) or the name is taken (an emulator's bridge, made meanwhile)."""
        net, length = _network(subnet_of(index)[0])
        if any(_overlap((net, length), other) for other in self.avoid):
            return False
        name = bridge_name(index)
        peer = netlink.ifinfo() + netlink.string(netlink.IFLA_IFNAME, UPLINK) + netlink.u32(netlink.IFLA_MTU, self.mtu)
        peer += netlink.u32(netlink.IFLA_NET_NS_FD, self.own_ns)
        info = netlink.string(netlink.IFLA_INFO_KIND, "veth")
        info += netlink.attr(netlink.IFLA_INFO_DATA, netlink.attr(netlink.VETH_INFO_PEER, peer))
        body = netlink.ifinfo() + netlink.string(netlink.IFLA_IFNAME, name) + netlink.u32(netlink.IFLA_MTU, self.mtu)
        body += netlink.u32(netlink.IFLA_GROUP, LINK_GROUP_BASE + index) + netlink.attr(netlink.IFLA_LINKINFO, info)
        named = netlink.ifinfo() + netlink.string(netlink.IFLA_IFNAME, name)
        named += netlink.string(netlink.IFLA_IFALIAS, self.owner)
        with open(link_lock_path(), "a") as lock:  # named before a reaper may judge it
            fcntl.flock(lock, fcntl.LOCK_SH)
            try:
                netlink.request(
                    self.sock, f"create {name}", netlink.RTM_NEWLINK, netlink.NLM_F_CREATE | netlink.NLM_F_EXCL, body
                )
            except OSError as exc:
                if exc.errno == errno.EEXIST:
                    return False
                raise
            self.index = index
            netlink.request(self.sock, f"name {name}", netlink.RTM_NEWLINK, 0, named)
        return True

    def host_end(self) -> None:
        """In the host's namespace: the host's end forwards nothing and has no IPv6 (nothing
        of the host's answers there but what the host asked for), its address, the route."""
        name, (subnet, base) = bridge_name(self.index), subnet_of(self.index)
        for path, value in (("ipv4/conf/{}/forwarding", "0"), ("ipv6/conf/{}/disable_ipv6", "1")):
            with open("/proc/sys/net/" + path.format(name), "w") as f:
                f.write(value)
        link = socket.if_nametoindex(name)
        netlink.add_address(self.sock, link, f"{base}{HOST_END}", 32)
        netlink.request(self.sock, f"{name} up", netlink.RTM_NEWLINK, 0, netlink.ifinfo(link, up=True))
        netlink.route(self.sock, subnet, link, src=f"{base}{HOST_END}", via=base + "1")

    def enter(self) -> None:
        """Into the holder's own namespace, for good."""
        _setns(self.own_ns)

    def up(self) -> None:
        """``uplink`` up, routing to the host's end (once the bridge has the gateway's address)."""
        _, base = subnet_of(self.index)
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
            up = socket.if_nametoindex(UPLINK)
            netlink.request(sock, f"{UPLINK} up", netlink.RTM_NEWLINK, 0, netlink.ifinfo(up, up=True))
            netlink.route(sock, f"{base}{HOST_END}/32", up, src=base + "1")

    def abandon(self) -> None:
        """The holder failed before the nodes' network was whole: the pair goes."""
        if self.index >= 0:
            with contextlib.suppress(OSError):
                netlink.delete_link(self.sock, bridge_name(self.index))


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(net): {os.strerror(err)}")


def _network(cidr: str) -> tuple[int, int]:
    """``a.b.c.d/len`` as (its address as a number, len): the holder's, without ``ipaddress``."""
    address, _, length = cidr.partition("/")
    return struct.unpack("!I", socket.inet_aton(address))[0], int(length or 32)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    shorter = min(a[1], b[1])
    mask = (0xFFFFFFFF << (32 - shorter)) & 0xFFFFFFFF
    return a[0] & mask == b[0] & mask


def _bridge(index: int, mtu: int) -> int:
    """The cluster's bridge at ``.1`` of its subnet, up, with its route; returns its ifindex."""
    name, (subnet, base) = bridge_name(index), subnet_of(index)
    mac = bytearray(os.urandom(6))
    mac[0] = (mac[0] & 0xFC) | 0x02  # locally administered, unicast; fixed for the bridge's life
    body = netlink.ifinfo() + netlink.string(netlink.IFLA_IFNAME, name) + netlink.u32(netlink.IFLA_MTU, mtu)
    body += netlink.attr(netlink.IFLA_ADDRESS, bytes(mac))
    data = netlink.u32(IFLA_BR_FORWARD_DELAY, 0)
    body += netlink.attr(
        netlink.IFLA_LINKINFO,
        netlink.string(netlink.IFLA_INFO_KIND, "bridge") + netlink.attr(netlink.IFLA_INFO_DATA, data),
    )
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        create = netlink.NLM_F_CREATE | netlink.NLM_F_EXCL
        netlink.request(sock, f"create bridge {name}", netlink.RTM_NEWLINK, create, body)
        lo, bridge = socket.if_nametoindex("lo"), socket.if_nametoindex(name)
        netlink.request(sock, "lo up", netlink.RTM_NEWLINK, 0, netlink.ifinfo(lo, up=True))
        netlink.add_address(sock, bridge, base + "1", 24)
        netlink.request(sock, f"{name} up", netlink.RTM_NEWLINK, 0, netlink.ifinfo(bridge, up=True))
        netlink.subnet_route(sock, subnet, bridge, base + "1")
    return bridge


USAGE = (
    "usage: clusterns.py hold psky-cluster:<dir> @DOOR MTU rootless|root IPTABLES_RESTORE [AVOID] "
    "| dial @DOOR IP PORT | probe"
)


def main(argv: list[str]) -> int:
    if len(argv) == 5 and argv[1] == "dial":
        try:
            conn = dial(argv[2], argv[3], int(argv[4]))
        except OSError as exc:
            print(f"pytest-sky: cannot reach {argv[3]}:{argv[4]}: {exc.strerror or exc}", file=sys.stderr)
            return 255
        socket.send_fds(socket.socket(fileno=1), [b"\0"], [conn.fileno()])  # ssh's ProxyUseFdpass
        return 0
    if argv[1:] == ["probe"]:  # may this user make the namespaces a holder makes?
        try:
            _enter_own_namespaces()
        except OSError as exc:
            print(exc.strerror or exc, file=sys.stderr)
            return 1
        return 0
    if len(argv) in (7, 8) and argv[1] == "hold" and argv[5] in ("rootless", "root"):
        avoid = [n for n in (argv[7] if len(argv) == 8 else "").split(",") if n]
        return _hold(argv[2], argv[3], int(argv[4]), argv[5] == "rootless", argv[6], avoid)
    print(USAGE, file=sys.stderr)
    return 2


def _hold(marker: str, door_name: str, mtu: int, rootless: bool, iptables_restore: str, avoid: list[str]) -> int:
    """The holder's life: the dialer, the lease and the door (in the host's namespace; a root
    cluster's uplink too), namespaces and bridge (``LEASED``: the nodes may start), the
    gateway (``READY``: a node may reach out, and only as it may), then the door's requests."""
    uplink = None
    try:
        dialer, dialer_pid = _fork_dialer()
        with open("/proc/net/fib_trie") as f:
            fib_trie = f.read()  # the host's own addresses, read in its namespace
        if not rootless:
            uplink = Uplink(marker.split(":", 1)[1], mtu, avoid)
        index, lease = _lease(uplink.claim) if uplink else _lease()
        door = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        door.bind(door_address(door_name))
        door.listen(128)
        if uplink:
            uplink.host_end()
            uplink.enter()
        else:
            _enter_own_namespaces(rootless)
        bridge = _bridge(index, mtu)
        if uplink:
            uplink.up()
        print(f"LEASED {index} {bridge} {dialer_pid}", flush=True)
        gateway = _gateway()
        subnet, base = subnet_of(index)
        plan = gateway.GatewayPlan(
            bridge=bridge_name(index),
            address=base + "1",
            subnet=subnet,
            uplink=UPLINK if uplink else "",
            host_end=f"{base}{HOST_END}" if uplink else "",
            host_addresses=tuple(gateway.host_addresses(fib_trie)),
        )
        gateway.configure(plan, iptables_restore)
        gateway.Relay(dialer, plan.address).start()
    except OSError as exc:
        if uplink:
            uplink.abandon()
        print(f"FAILED {' '.join(str(exc).split())}", flush=True)
        return 1
    print("READY", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # the host reads until EOF: this was the last word
    os.close(devnull)
    lease.listen(1)  # held, never accepted: the lease is the name
    while True:
        conn, _ = door.accept()
        answer = (conn, functools.partial(_connect, conn), CONNECT_SECONDS)
        threading.Thread(target=fdpass.give_socket, args=answer, daemon=True).start()


def _gateway() -> types.ModuleType:
    """``gateway``, imported by the holder alone, once its nodes may start: ``dial`` runs once
    per ssh connection and needs none of it, and a node's start need not wait for it."""
    try:
        from pytest_sky.backends import gateway
    except ImportError:  # run as the program it is: from its directory
        import gateway  # type: ignore[import-not-found,no-redef]
    return gateway


def _fork_dialer() -> tuple[socket.socket, int]:
    """The gateway's dialer (``gateway.serve_dialer``), forked first, so that it holds nothing
    of the holder's (not the subnet's lease, not the door) and stays in the host's network
    namespace; the socket the relay asks it through, and its pid.  It dies with the holder
    (its parent-death signal, and the end of that socket)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid:
        theirs.close()
        return ours, pid
    try:
        ours.close()
        _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
        if os.getppid() == parent:
            _gateway().serve_dialer(theirs)
    finally:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
