"""The host's side of the nodes' network: the cluster's bridge, link names, groups and aliases.

Why shell ``ip`` for addresses, routes and teardown (one ``ip -batch`` each) rather than
pyroute2: measured faster here (DESIGN.md section 5).  The bridge itself is one raw netlink
request (``netlink``), whose answer says in an errno whether the name was taken."""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from pytest_sky.backends import clusterns, netlink
from pytest_sky.backends.clusterns import LINK_GROUP_BASE, LINK_PREFIX
from pytest_sky.errors import ProvisionError
from pytest_sky.locks import flocked


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


def lease_subnet(ip: str, mtu: int, owner: str) -> int:
    """A /24 of 198.18.0.0/15 leased for a new cluster by creating its bridge, configured at
    ``.1``; its index (ProvisionError when every one is taken or routed elsewhere).  Never one
    that a route of the host's overlaps (a VPN's, a fake-IP DNS tool's: :func:`routed_networks`),
    which the bridge would shadow.  Root's clusters and the emulator's pods lease here; a rootless
    cluster's holder leases in ``clusterns``, for a namespace of its own.

    Taken first, then checked: the bridge (its creation is atomic in the kernel), then the
    holders' leases (``clusterns.subnet_leased``), while a holder binds its lease first and
    then looks for the bridge.  Of a leaser here and a holder racing for one subnet, at least
    one sees the other and moves on, so no /24 is ever two clusters' (looked at first and
    taken after, both could win).
    """
    import ipaddress

    routed = [ipaddress.ip_network(dst, strict=False) for dst in routed_networks(ip)]
    for index in clusterns.lease_order():
        subnet, base = clusterns.subnet_of(index)
        name = clusterns.bridge_name(index)
        network = ipaddress.ip_network(subnet)
        if any(network.overlaps(r) for r in routed if r.version == 4) or not _claim_bridge(ip, name, mtu, owner):
            continue
        if clusterns.subnet_leased(index):
            delete_links(ip, [name])
            continue
        _configure_bridge(ip, name, base + "1", 24, subnet)
        return index
    raise ProvisionError(
        f"all {clusterns.NUM_SUBNETS} subnets of 198.18.0.0/15 are in use or routed elsewhere on this host: tear "
        f"clusters down with `pytest-sky down --all` (or look for {LINK_PREFIX}* bridges and for routes into "
        "198.18.0.0/15 with `ip link` and `ip route show table all`)"
    )


def create_bridge(ip: str, name: str, address: str, prefixlen: int, subnet: str, mtu: int, owner: str = "") -> bool:
    """Create a bridge named ``name`` at ``address``; False when the name is taken (another
    process holds it).  A cluster's bridge is leased with :func:`lease_subnet`, which also
    keeps clear of the holders' subnets."""
    if not _claim_bridge(ip, name, mtu, owner):
        return False
    _configure_bridge(ip, name, address, prefixlen, subnet)
    return True


def _claim_bridge(ip: str, name: str, mtu: int, owner: str) -> bool:
    """The bridge itself, unconfigured; False when the name is taken.

    Creating the link is atomic in the kernel, which makes the bridge name a race-free lease
    across processes, xdist workers and state directories alike.  ``owner`` (the cluster's
    directory) goes into the link's alias, so a leftover link says whose it is; until it is
    there the creator holds :func:`link_lock` (shared), so a reaper (exclusive) never takes a
    bridge being created for a stray.
    """
    with link_lock(exclusive=False):
        if not _add_bridge(name, mtu):
            return False
        try:
            set_alias(name, owner)
        except BaseException:
            delete_links(ip, [name])
            raise
    return True


def _configure_bridge(ip: str, name: str, address: str, prefixlen: int, subnet: str) -> None:
    """Its address, up, its route; deleted again if any of that fails."""
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


def _add_bridge(name: str, mtu: int) -> bool:
    """Ask the kernel for the bridge with the one request ``ip link add`` would send; False
    when a link of that name exists (the kernel's EEXIST: the lease is someone else's)."""
    body = netlink.ifinfo() + netlink.string(netlink.IFLA_IFNAME, name) + netlink.u32(netlink.IFLA_MTU, mtu)
    # A fixed address: a bridge otherwise takes the lowest address among its ports, and when
    # that port leaves (a node dies) every node's ARP entry for the bridge goes stale for
    # seconds, stalling the client's connection to the head.
    body += netlink.attr(netlink.IFLA_ADDRESS, bytes.fromhex(_local_mac().replace(":", "")))
    group = link_group(name)
    if group is not None:
        body += netlink.u32(netlink.IFLA_GROUP, group)
    body += netlink.attr(netlink.IFLA_LINKINFO, netlink.string(netlink.IFLA_INFO_KIND, "bridge"))
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        try:
            flags = netlink.NLM_F_CREATE | netlink.NLM_F_EXCL
            netlink.request(sock, f"create bridge {name}", netlink.RTM_NEWLINK, flags, body)
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise ProvisionError(f"could not create bridge {name}: {exc.strerror}") from None
    return True


@contextmanager
def link_lock(*, exclusive: bool) -> Iterator[None]:
    """The one ownership signal between creators of bridges (shared: they never wait on each
    other) and reapers (exclusive): a bridge without an owner seen under the exclusive lock
    is not being created, so its creator died between creating and naming it."""
    with flocked(clusterns.link_lock_path(), exclusive=exclusive):
        yield


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


def link_alias(link: str) -> str | None:
    """The link's alias ("" when it has none); None when there is no such link, which another
    process's teardown may have deleted a moment ago: gone is not the same as unowned."""
    try:
        return Path(f"/sys/class/net/{link}/ifalias").read_text().strip()
    except OSError:
        return None


def bridge_owned_by(owner: str) -> str | None:
    """The bridge of ours whose alias is ``owner`` (a cluster's directory), if there is one."""
    for name in os.listdir("/sys/class/net"):
        if re.fullmatch(rf"{LINK_PREFIX}\d+", name) and link_alias(name) == owner:
            return name
    return None


def delete_links(ip: str, names: Sequence[str]) -> None:
    """Delete links that exist; a link already gone is fine (teardown is idempotent)."""
    _delete_owned(ip, _owners(names))


def _owners(names: Sequence[str]) -> dict[str, str]:
    """The links of ``names`` that exist, each with its alias (read once: gone reads None)."""
    aliases = {n: link_alias(n) for n in names}
    return {n: alias for n, alias in aliases.items() if alias is not None}


def _still_owned(name: str, owner: str) -> bool:
    """``name`` is still the link whose alias was ``owner`` (a link that is gone has none):
    the moment a bridge is gone its name is free, and another cluster's launch may make a
    link of that name at once."""
    return link_alias(name) == owner


def _delete_owned(ip: str, owners: dict[str, str]) -> None:
    """Delete these links (name: the owner they had when seen).  One still there afterwards
    is an error that names it: a teardown never reports success over a leak."""
    if not owners:
        return
    err = ip_batch(ip, [f"link del {n}" for n in owners], force=True)
    left = [n for n, owner in owners.items() if _still_owned(n, owner)]
    if left:
        why = err.strip().splitlines()[0] if err.strip() else "ip gave no reason"
        raise ProvisionError(
            f"could not delete link {', '.join(left)} ({why}): run `pytest-sky down --all` again, "
            "or delete it with `ip link del <name>`"
        )


def link_group(bridge: str) -> int | None:
    """The link group of bridge ``psky<i>`` and its nodes' veths; None for any other name."""
    match = re.fullmatch(rf"{LINK_PREFIX}(\d+)", bridge)
    return LINK_GROUP_BASE + int(match.group(1)) if match and int(match.group(1)) < 0x10000 else None


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
    # Who owns each link, read before the group goes: once it has, the bridge's name is free,
    # and another launch may make links of the very same names at once, which are not ours.
    owners = _owners([*names, bridge])
    group = link_group(bridge)
    if group is not None and bridge in owners and _group_is_ours(bridge, group):
        ip_batch(ip, [f"link del group {group}"], force=True)
    _delete_owned(ip, {n: owner for n, owner in owners.items() if _still_owned(n, owner)})


def node_mac(ip: str) -> str:
    """The node's MAC address, fixed by its IP as a machine's NIC is: a restarted node answers
    at the address its peers' ARP caches (and the bridge's) already hold, as a rebooted
    machine does, instead of going silent until every cache has expired."""
    octets = [int(o) for o in ip.split(".")]
    return ":".join(f"{b:02x}" for b in [0x02, 0x70, *octets])  # locally administered, unicast
