"""A node's network link, as its init makes it: its veth into the cluster's bridge and its
addresses and routes, straight to the kernel over netlink (no ``ip`` per node).

Standard library only, importing nothing of pytest-sky but ``netlink``: ``nodeinit`` (a
node's start) runs as a program of its own and imports this file from its directory.
"""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING

try:
    from pytest_sky.backends import netlink
except ImportError:  # imported by nodeinit.py run as a program: from its directory
    import os

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import netlink  # type: ignore[import-not-found,no-redef]

if TYPE_CHECKING:
    from pytest_sky.backends.nodeinit_protocol import NodePlan


def make_link(plan: NodePlan, host_netns: int, host_sock: socket.socket, own: socket.socket) -> None:
    """The node's veth, made by the node itself (every node at once, none waiting for a host
    step): ``eth0`` here with its MAC fixed by its IP, the peer in the host's namespace in
    the cluster's link group, then put on the bridge and brought up from the host's side
    (``host_sock`` was opened there, before the node had a namespace of its own)."""
    peer = (
        netlink.ifinfo()
        + netlink.string(netlink.IFLA_IFNAME, plan.veth)
        + netlink.u32(netlink.IFLA_MTU, plan.mtu)
        + netlink.u32(netlink.IFLA_NET_NS_FD, host_netns)
    )
    if plan.link_group:
        peer += netlink.u32(netlink.IFLA_GROUP, plan.link_group)
    info = netlink.string(netlink.IFLA_INFO_KIND, "veth") + netlink.attr(
        netlink.IFLA_INFO_DATA, netlink.attr(netlink.VETH_INFO_PEER, peer)
    )
    eth0 = netlink.ifinfo() + netlink.string(netlink.IFLA_IFNAME, "eth0") + netlink.u32(netlink.IFLA_MTU, plan.mtu)
    eth0 += netlink.attr(netlink.IFLA_ADDRESS, bytes.fromhex(plan.mac.replace(":", "")))
    if plan.cluster_netns:  # a previous boot's, whose namespace the kernel has not ended yet
        netlink.delete_link(host_sock, plan.veth)
    netlink.request(
        own,
        f"create veth {plan.veth}",
        netlink.RTM_NEWLINK,
        netlink.NLM_F_CREATE | netlink.NLM_F_EXCL,
        eth0 + netlink.attr(netlink.IFLA_LINKINFO, info),
    )
    host_end = (
        netlink.ifinfo(up=True)
        + netlink.string(netlink.IFLA_IFNAME, plan.veth)
        + netlink.u32(netlink.IFLA_MASTER, plan.bridge_index)
    )
    netlink.request(
        host_sock,
        f"put {plan.veth} on its bridge",
        netlink.RTM_NEWLINK,
        0,
        host_end + netlink.string(netlink.IFLA_IFALIAS, plan.alias),
    )


def configure(plan: NodePlan, own: socket.socket) -> None:
    """``lo`` and ``eth0`` up, the node's address, the subnet's route with quickack (no
    delayed ACKs between nodes) and the way out through the cluster's gateway: what ``ip``
    would send, straight to the kernel."""
    lo, eth0 = socket.if_nametoindex("lo"), socket.if_nametoindex("eth0")
    netlink.request(own, "lo up", netlink.RTM_NEWLINK, 0, netlink.ifinfo(lo, up=True))
    netlink.request(own, "eth0 up", netlink.RTM_NEWLINK, 0, netlink.ifinfo(eth0, up=True))
    netlink.add_address(own, eth0, plan.ip, plan.prefixlen)
    netlink.subnet_route(own, plan.subnet, eth0, plan.ip)
    if plan.gateway:
        netlink.route(own, "0.0.0.0/0", eth0, via=plan.gateway)
