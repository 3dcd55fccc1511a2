"""Raw netlink, the little of it our in-node programs need: messages, attributes, acks.

Standard library only, importing nothing of pytest-sky: ``nodeinit`` (a node's start) and
``nfdelay`` (the packet delayer) run as programs of their own inside a node's namespaces,
where this file is imported from their directory; in the package it is
``pytest_sky.backends.netlink`` like any other module.
"""

from __future__ import annotations

import errno
import os
import socket
import struct

NLM_F_REQUEST, NLM_F_ACK, NLM_F_REPLACE = 0x1, 0x4, 0x100
NLMSG_ERROR = 2


def attr(kind: int, payload: bytes) -> bytes:
    """One attribute (``struct rtattr`` / ``struct nlattr``), padded to 4 bytes."""
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def message(kind: int, body: bytes, flags: int = NLM_F_REQUEST, seq: int = 0) -> bytes:
    """``body`` under a ``struct nlmsghdr``."""
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


def check_ack(sock: socket.socket, what: str = "netlink request") -> None:
    """Read the kernel's answer to a request sent with NLM_F_ACK; an error becomes OSError."""
    data = sock.recv(65536)
    _, kind = struct.unpack_from("=IH", data)
    if kind == NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, 16)
        if err:
            raise OSError(-err, f"{what}: {os.strerror(-err)}")


# rtnetlink: links, addresses, routes (what ``ip`` would send)

RTM_NEWLINK, RTM_DELLINK, RTM_NEWADDR, RTM_NEWROUTE = 16, 17, 20, 24
NLM_F_EXCL, NLM_F_CREATE = 0x200, 0x400
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_MASTER, IFLA_LINKINFO = 1, 3, 4, 10, 18
IFLA_IFALIAS, IFLA_GROUP, IFLA_NET_NS_FD = 20, 27, 28
IFLA_INFO_KIND, IFLA_INFO_DATA, VETH_INFO_PEER = 1, 2, 1
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PREFSRC, RTA_METRICS, RTAX_QUICKACK = 1, 4, 5, 7, 8, 15
RT_TABLE_MAIN, RTPROT_KERNEL, RTPROT_STATIC = 254, 2, 4
RT_SCOPE_UNIVERSE, RT_SCOPE_LINK, RTN_UNICAST, RTNH_F_ONLINK = 0, 253, 1, 4
IFF_UP = 1


def ifinfo(index: int = 0, up: bool = False) -> bytes:
    """``struct ifinfomsg``: the link by index (0: by its IFLA_IFNAME), brought up or not."""
    return struct.pack("=BxHiII", socket.AF_UNSPEC, 0, index, IFF_UP if up else 0, IFF_UP if up else 0)


def u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=I", value))


def string(kind: int, text: str) -> bytes:
    return attr(kind, text.encode() + b"\0")


def request(sock: socket.socket, what: str, kind: int, flags: int, body: bytes) -> None:
    sock.send(message(kind, body, NLM_F_REQUEST | NLM_F_ACK | flags))
    check_ack(sock, what)


def add_address(sock: socket.socket, index: int, ip: str, prefixlen: int) -> None:
    """``ip addr add IP/PREFIXLEN dev <index>``."""
    address = socket.inet_aton(ip)
    body = struct.pack("=BBBBI", socket.AF_INET, prefixlen, 0, 0, index)
    body += attr(IFA_LOCAL, address) + attr(IFA_ADDRESS, address)
    request(sock, f"address {ip}/{prefixlen}", RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, body)


def subnet_route(sock: socket.socket, subnet: str, index: int, src: str) -> None:
    """The subnet's route on link ``index``, from ``src``, with quickack (no delayed ACKs
    between the cluster's machines): ``ip route replace SUBNET dev <index> src SRC quickack 1``."""
    route(sock, subnet, index, src=src)


def route(sock: socket.socket, dst: str, index: int, *, src: str = "", via: str = "") -> None:
    """``ip route replace DST dev <index> [via VIA onlink] [src SRC] quickack 1``: on the link
    (a subnet's own route), or through a gateway that is on it whatever its addresses say
    (``onlink``: a cluster's gateway, seen from the host's end of their link).  ``DST``
    ``0.0.0.0/0`` is the default route."""
    network, _, length = dst.partition("/")
    scope, proto = (RT_SCOPE_UNIVERSE, RTPROT_STATIC) if via else (RT_SCOPE_LINK, RTPROT_KERNEL)
    flags = RTNH_F_ONLINK if via else 0
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, int(length), 0, 0, RT_TABLE_MAIN, proto, scope, RTN_UNICAST, flags)
    if int(length):
        body += attr(RTA_DST, socket.inet_aton(network))
    body += u32(RTA_OIF, index)
    if via:
        body += attr(RTA_GATEWAY, socket.inet_aton(via))
    if src:
        body += attr(RTA_PREFSRC, socket.inet_aton(src))
    body += attr(RTA_METRICS, u32(RTAX_QUICKACK, 1))
    request(sock, f"route {dst}" + (f" via {via}" if via else ""), RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE, body)


def delete_link(sock: socket.socket, name: str) -> bool:
    """``ip link del NAME``; False when there is no such link."""
    try:
        request(sock, f"delete {name}", RTM_DELLINK, 0, ifinfo() + string(IFLA_IFNAME, name))
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            return False
        raise
    return True
