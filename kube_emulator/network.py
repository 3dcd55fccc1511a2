"""The emulated cluster's network: one bridge and one /24 of 198.18.0.0/15 for every pod.

The subnet is leased by creating its bridge (atomic in the kernel), the way the local backend
leases its subnets (``netns.lease_subnet``, through the adapter): none a rootless cluster's
holder leased for its own namespace, so emulators and local clusters on one machine never
collide, and none the host already routes; pods get addresses as a real CNI's host-local IPAM
hands them out.
"""

from __future__ import annotations

from kube_emulator import product
from kube_emulator.product import ProvisionError


class PodNetwork:
    """The bridge, its subnet and the pods' addresses on it (empty until :meth:`lease`)."""

    def __init__(self, mtu: int = 65535) -> None:
        self.mtu = mtu
        self.tools: dict[str, str] = {}
        #: The leased subnet's index (-1: none leased yet, or given back); the rest follows.
        self.index = -1
        self.used_ips: set[int] = set()
        self.last_ip = 1  # the last octet handed out (the bridge is .1)

    def check(self) -> None:
        """Whether this machine allows pods at all (privileges, tools, forwarding), as the
        local backend checks before a cluster."""
        product.require_privileges()
        self.tools = product.require_tools()
        product.check_forward_policy()

    def lease(self, owner: str) -> None:
        """Lease a free subnet by creating its bridge, as the local backend leases its own
        (``owner``: recorded on the bridge, the instance directory whose it is)."""
        self.index = product.lease_subnet(self.tools["ip"], self.mtu, owner)

    @property
    def bridge(self) -> str:
        return product.bridge_name(self.index) if self.index >= 0 else ""

    @property
    def subnet(self) -> str:
        return product.subnet_of(self.index)[0] if self.index >= 0 else ""

    @property
    def base(self) -> str:
        return product.subnet_of(self.index)[1] if self.index >= 0 else ""

    @property
    def host_ip(self) -> str:
        return self.base + "1"

    def allocate_ip(self) -> str:
        """The next free address after the last one handed out, as the host-local IPAM of a
        real CNI allocates: a pod deleted and created again (same name) gets a new address,
        never its old one straight back, so nothing may assume a pod keeps its IP."""
        for step in range(1, 254):
            octet = 2 + (self.last_ip - 2 + step) % 253
            if octet not in self.used_ips:
                self.used_ips.add(octet)
                self.last_ip = octet
                return self.base + str(octet)
        raise ProvisionError("the emulated cluster's /24 has no free pod address (253 pods at most)")

    def release_ip(self, ip: str) -> None:
        self.used_ips.discard(int(ip.rsplit(".", 1)[1]))

    def veth_for(self, ip: str | None) -> str:
        """A pod's veth name: the bridge's index and the pod's last octet, unique on the machine."""
        octet = ip.rsplit(".", 1)[1] if ip else "0"
        return f"{product.LINK_PREFIX}{self.index}p{octet}"
