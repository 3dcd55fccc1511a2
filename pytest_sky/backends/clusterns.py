"""A rootless cluster's network: the namespaces its nodes hang off, and the door into them.

Run as root, the local backend puts each cluster's bridge in the host's network namespace.
An ordinary user may not (DESIGN.md section 5, "Rootless"), but may make a user namespace
of their own, in which they are root, and network namespaces owned by it.  This program is
that namespace's holder, one per cluster, for the cluster's life:

``python -S -I clusterns.py hold psky-cluster:<cluster dir> @DOOR MTU``
    makes a user namespace (the user is uid 0 in it, the only uid an unprivileged user may
    map) and a network namespace owned by it; leases a /24 of 198.18.0.0/15; makes the
    cluster's bridge with the address ``.1``; says ``READY <subnet index> <bridge ifindex>``
    on stdout and then serves its door.  The lease and the door are abstract unix sockets of
    the host's network namespace, bound before the holder leaves it: no file to leave behind
    and no path to outgrow a socket address, and both are free again the moment the holder
    dies, whatever killed it.  The door answers its own user only (``SO_PEERCRED``).  The
    host starts the nodes in its namespaces (``nsenter --target <holder> --user --net``) and
    stops it with a signal: the bridge and every veth go with its network namespace.

``python -S -I clusterns.py dial @DOOR IP PORT``
    an OpenSSH ProxyCommand with ``ProxyUseFdpass yes``: asks the holder for a TCP
    connection to a node, made inside the cluster's network, and hands ssh the socket
    itself, so nothing relays the session's bytes.  The client's own connection and its
    readiness checks call :func:`dial` in-process.

The door's protocol (one request line, one reply line with the socket passed alongside,
``SCM_RIGHTS``) is the two functions below; standard library only, because the holder and
the dialler run as programs of their own and the dialler runs once per ssh connection.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import socket
import struct
import sys
import threading

try:
    from pytest_sky.backends import netlink
except ImportError:  # run as the program it is: from its directory
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import netlink  # type: ignore[import-not-found,no-redef]

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
NUM_SUBNETS = 512  # 198.18.0.0/15 in /24s, as the root mode leases them
#: Every link we create starts with this, so leaks are easy to find (``pytest-sky doctor``).
LINK_PREFIX = "psky"
IFLA_BR_FORWARD_DELAY = 1
#: How long the holder waits for a node to accept a connection before it answers ETIMEDOUT.
CONNECT_SECONDS = 10.0
_MAX_LINE = 256


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
        conn.sendall(f"{ip} {port}\n".encode())
        data, fds, _, _ = socket.recv_fds(conn, _MAX_LINE, 1)
    status, _, rest = data.decode(errors="replace").strip().partition(" ")
    if status == "OK" and fds:
        return socket.socket(fileno=fds[0])
    for fd in fds:
        os.close(fd)
    code, _, message = rest.partition(" ")
    raise OSError(int(code) if code.isdigit() else errno.EIO, message or "the cluster's holder said no more")


def _answer(conn: socket.socket) -> None:
    """One request: connect where it asks, inside this namespace, and pass the socket back.
    The whole request is read before any answer: an answer sent sooner, and the connection
    closed, would meet a client still sending (EPIPE) instead of reading why."""
    with conn, contextlib.suppress(OSError):  # a client gone meanwhile: nothing to tell it
        conn.settimeout(CONNECT_SECONDS)
        with conn.makefile("rb") as lines:
            line = lines.readline(_MAX_LINE)
        target, error = _connect(conn, line)
        if target is None:
            conn.sendall(f"ERR {error}\n".encode())
            return
        with target:
            target.settimeout(None)
            socket.send_fds(conn, [b"OK\n"], [target.fileno()])


def _connect(conn: socket.socket, line: bytes) -> tuple[socket.socket | None, str]:
    """The connection ``line`` asks for, or ``<errno> <why>`` there is none."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if uid != os.getuid():  # another user's process: the door is not theirs to use
        return None, f"{errno.EACCES} this cluster is another user's"
    try:
        ip, port = line.decode().split()
        return socket.create_connection((ip, int(port)), timeout=CONNECT_SECONDS), ""
    except ValueError:
        return None, f"{errno.EINVAL} not a dial request"
    except OSError as exc:
        code = exc.errno or errno.ETIMEDOUT
        return None, f"{code} {os.strerror(code)}"


# -- the holder --------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)


def _enter_own_namespaces() -> None:
    """A user namespace where this user is root, and a network namespace it owns."""
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


def _lease() -> tuple[int, socket.socket]:
    """A subnet no other holder on this host has, and no cluster of root's (its bridge is
    named after it), held by a socket bound in the host's namespace (so bound before this
    process leaves it).

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
        if _root_bridge(index):
            lease.close()
            continue
        return index, lease
    raise OSError(errno.EADDRINUSE, f"all {NUM_SUBNETS} subnets are leased on this host")


def _root_bridge(index: int) -> bool:
    """A bridge of root's (a local cluster's, an emulator's) is on subnet ``index``."""
    return os.path.exists(f"/sys/class/net/{bridge_name(index)}")


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
    if len(argv) == 5 and argv[1] == "hold":
        return _hold(argv[3], int(argv[4]))
    print("usage: clusterns.py hold psky-cluster:<dir> @DOOR MTU | dial @DOOR IP PORT | probe", file=sys.stderr)
    return 2


def _hold(name: str, mtu: int) -> int:
    """The holder's life: lease and door (in the host's namespace), namespaces, bridge, then
    the door's requests."""
    try:
        index, lease = _lease()
        door = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        door.bind(door_address(name))
        door.listen(128)
        _enter_own_namespaces()
        bridge = _bridge(index, mtu)
    except OSError as exc:
        print(f"FAILED {' '.join(str(exc).split())}", flush=True)
        return 1
    print(f"READY {index} {bridge}", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # the host reads until EOF: this was the last word
    os.close(devnull)
    lease.listen(1)  # held, never accepted: the lease is the name
    while True:
        conn, _ = door.accept()
        threading.Thread(target=_answer, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
