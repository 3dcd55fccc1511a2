"""A cluster's way out, as a pod has one: its gateway's rules, and the relay that carries its
nodes' connections to the world.

A pod reaches the outside world through its node's NAT and resolves names through the
cluster's DNS.  A local node gets the same from its cluster's namespace holder
(``clusterns.py``), whose network namespace holds the cluster's bridge at ``.1``: every
node's default route and nameserver.  Nothing of the host's changes for it (no forwarding,
no NAT, no rule in the host's firewall):

- In the holder's namespace, and only there, a node's TCP connection to anywhere outside the
  cluster is redirected to the relay, and its DNS queries to the relay's resolver
  (:func:`rules`, netfilter rules of that namespace: they go with it).
- The relay asks the *dialer*, a process the holder forked before it left the host's network
  namespace, for a connection to where the node was going.  The dialer connects from the
  host's namespace, as any program of the user's does, and hands the socket back
  (``SCM_RIGHTS``); the relay copies bytes between the two.  A DNS query goes to the host's
  own nameservers the same way.
- Never: an address of the host's (so no port a host process listens on, at any address),
  another cluster's subnet (198.18.0.0/15), the link-local range (where a cloud's metadata
  service keeps its credentials), loopback, multicast (:data:`FORBIDDEN`).  The host's
  addresses when the cluster starts are not redirected at all, so a node finds no route
  there, at once; the dialer refuses any address that is the host's when asked (one added
  since), before it connects.

Why a relay of our own rather than slirp4netns or pasta: DESIGN.md section 5 has the
measurements.  Standard library only: the holder runs as a program (``python -S -I``) and
imports this file from its directory.  The requests to the dialer are ``fdpass``'s.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

try:
    from pytest_sky.backends import fdpass
except ImportError:  # imported by clusterns.py run as a program: from its directory
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fdpass  # type: ignore[import-not-found,no-redef]

#: Where the relay listens, in the holder's namespace, for the connections redirected to it.
RELAY_PORT = 7302
DNS_PORT = 53
#: How long the dialer tries a connection, and the relay waits for a nameserver's answer.
CONNECT_SECONDS = 30.0
DNS_SECONDS = 5.0
#: Never reached from a node, whatever it asks: "this network", loopback, link-local (a
#: cloud's metadata service), every cluster's subnets, multicast and the reserved range.
FORBIDDEN = ("0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "198.18.0.0/15", "224.0.0.0/3")
SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h: where a redirected connection was going
_CHUNK = 1 << 16


@dataclass(frozen=True)
class GatewayPlan:
    """What the holder's namespace is, for its rules and sysctls."""

    bridge: str  # the cluster's bridge, in the holder's namespace
    address: str  # the bridge's address (.1): every node's gateway and nameserver
    subnet: str  # the cluster's /24
    #: Root's clusters: the holder's end of the link from the host, and the host's address
    #: on it (the host reaches its nodes through the holder; "" for a rootless cluster).
    uplink: str = ""
    host_end: str = ""
    #: The host's own addresses when the cluster started: never redirected (no route there).
    host_addresses: tuple[str, ...] = field(default_factory=tuple)


def rules(plan: GatewayPlan) -> str:
    """``iptables-restore`` input for the holder's namespace (its only rules, written whole).

    nat: what a node sends outside the cluster, but not to a forbidden or host address, goes
    to the relay (TCP) or its resolver (DNS).  filter: a node may reach the gateway only at
    those; on root's clusters the host reaches the nodes through the gateway, and a node
    answers the host but never opens a connection to it; bridged frames between nodes pass
    (they meet these chains only where ``br_netfilter`` is loaded after the holder started)."""
    br, up = plan.bridge, plan.uplink
    covered = [ipaddress.ip_network(n) for n in FORBIDDEN]
    own = [f"{a}/32" for a in plan.host_addresses if not any(ipaddress.ip_address(a) in n for n in covered)]
    nat = [f"-A PREROUTING -i {br} -d {net} -j RETURN" for net in (plan.subnet, *FORBIDDEN, *own)]
    nat += [
        f"-A PREROUTING -i {br} -p tcp -j REDIRECT --to-ports {RELAY_PORT}",
        f"-A PREROUTING -i {br} -p udp --dport {DNS_PORT} -j REDIRECT --to-ports {DNS_PORT}",
    ]
    established = "-m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"
    inp = [
        f"-A INPUT -i {br} {established}",
        f"-A INPUT -i {br} -d {plan.address} -p tcp -m multiport --dports {DNS_PORT},{RELAY_PORT} -j ACCEPT",
        f"-A INPUT -i {br} -d {plan.address} -p udp --dport {DNS_PORT} -j ACCEPT",
        f"-A INPUT -i {br} -p icmp -j ACCEPT",
    ]
    fwd = [f"-A FORWARD -i {br} -o {br} -j ACCEPT"]
    if up:
        inp.append(f"-A INPUT -i {up} {established}")
        fwd += [f"-A FORWARD -i {up} -o {br} -j ACCEPT", f"-A FORWARD -i {br} -o {up} {established}"]
    refuse = ["-p tcp -j REJECT --reject-with tcp-reset", "-j REJECT --reject-with icmp-port-unreachable"]
    inp += [f"-A INPUT -i {i} {r}" for i in (br, up) if i for r in refuse]
    fwd += [f"-A FORWARD {r}" for r in refuse]
    lines = ["*nat", *(f":{c} ACCEPT [0:0]" for c in ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING")), *nat]
    lines += ["COMMIT", "*filter", ":INPUT ACCEPT [0:0]", ":FORWARD DROP [0:0]", ":OUTPUT ACCEPT [0:0]"]
    return "\n".join([*lines, *inp, *fwd, "COMMIT", ""])


def sysctls(plan: GatewayPlan) -> list[tuple[str, str]]:
    """The holder's namespace's own settings (``/proc/sys`` paths, values), in order.

    Forwarding on (in this namespace only: the host's ``ip_forward`` is untouched), root's
    and rootless alike: only a namespace that forwards answers a packet it has no route for
    (the host's addresses, link-local, other clusters) with an ICMP unreachable; one that
    does not drops it, and a node's connect there hung for its whole timeout (rootless, 5 s
    an address).  The kernel still limits those answers per node (a burst of five, then one
    a second: ``net.ipv4.route.error_cost``, the host's); the rest of ICMP is answered at
    once (no rate limit).  Bridged frames kept out of netfilter (node to node traffic is not
    the gateway's to track).  Root's: the host's address answered for on the bridge (proxy
    ARP, without its random delay), since to the nodes it is on their subnet."""
    out = [("net/ipv4/icmp_ratelimit", "0"), ("net/ipv4/ip_forward", "1")]
    out += [(f"net/bridge/bridge-nf-call-{t}", "0") for t in ("iptables", "ip6tables", "arptables")]
    if plan.uplink:
        out += [
            (f"net/ipv4/conf/{plan.bridge}/proxy_arp", "1"),
            (f"net/ipv4/neigh/{plan.bridge}/proxy_delay", "0"),
        ]
    return out


def configure(plan: GatewayPlan, iptables_restore: str) -> None:
    """Apply :func:`rules` and then :func:`sysctls` (forwarding is never on without its
    rules) in this (the holder's) namespace; OSError if either is refused: a cluster whose
    nodes could reach the host never gets ready."""
    proc = subprocess.run(
        [iptables_restore], input=rules(plan), capture_output=True, text=True, timeout=60, check=False
    )
    if proc.returncode != 0:
        why = " ".join(proc.stderr.split()) or f"exit {proc.returncode}"
        raise OSError(errno.EPERM, f"{iptables_restore} in the cluster's namespace: {why}")
    for name, value in sysctls(plan):
        path = f"/proc/sys/{name}"
        if name.startswith("net/bridge/") and not os.path.exists(path):
            continue  # br_netfilter is not loaded: bridged frames never meet netfilter
        with open(path, "w") as f:
            f.write(value)


def host_addresses(fib_trie: str | None = None) -> list[str]:
    """This network namespace's own IPv4 addresses (``/proc/net/fib_trie``'s local entries)."""
    if fib_trie is None:
        with open("/proc/net/fib_trie") as f:
            fib_trie = f.read()
    found, last = [], ""
    for line in fib_trie.splitlines():
        words = line.split()
        if words[:1] == ["|--"] and len(words) == 2:
            last = words[1]
        elif "/32 host LOCAL" in line and last and last not in found:
            found.append(last)
    return found


def refusal(ip: str) -> str | None:
    """Why a node may not reach ``ip`` (None: it may).  Asked in the host's namespace, so "an
    address of this host" is the host's now: one the kernel lets a socket bind to."""
    try:
        address = ipaddress.IPv4Address(ip)
    except ValueError:
        return "not an IPv4 address"
    for net in FORBIDDEN:
        if address in ipaddress.ip_network(net):
            return f"{net} is never reached from a node"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return None
    return "an address of this host's"


def nameservers(text: str | None = None) -> list[str]:
    """The host's nameservers (``/etc/resolv.conf``; none named: 127.0.0.1, as glibc takes it)."""
    if text is None:
        try:
            with open("/etc/resolv.conf") as f:
                text = f.read()
        except OSError:
            text = ""
    found = [w[1] for w in (line.split() for line in text.splitlines()) if len(w) >= 2 and w[0] == "nameserver"]
    return found or ["127.0.0.1"]


def resolv_conf(host_text: str, gateway: str) -> str:
    """A node's ``/etc/resolv.conf``: the host's, with the cluster's gateway as its one
    nameserver (as a pod's names the cluster DNS): the host's may be a loopback address (a
    local resolver such as systemd-resolved's), which on a node is the node's own."""
    kept = [line for line in host_text.splitlines() if line.split()[:1] != ["nameserver"]]
    return "\n".join([f"nameserver {gateway}", *kept]) + "\n"


# -- the dialer: the host's side -----------------------------------------------------------


def serve_dialer(control: socket.socket) -> None:
    """The dialer's life (a process the holder forked while still in the host's network
    namespace: ``clusterns._fork_dialer``): each message on ``control`` brings one end of a
    socket pair, on which one request is asked and answered, in a thread of its own (a slow
    connect holds up no other).  It ends with the holder, whose end of ``control`` closes."""
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 1)
        except OSError:
            return
        if not fds:
            return  # the holder is gone
        conn = socket.socket(fileno=fds[0])
        answer = (conn, _dial, CONNECT_SECONDS + 5)
        threading.Thread(target=fdpass.give_socket, args=answer, daemon=True).start()


def _dial(line: bytes) -> socket.socket:
    """The socket a request asks for: ``tcp IP PORT`` (unless :func:`refusal` says no) or
    ``dns udp`` / ``dns tcp`` (to the host's first nameserver)."""
    words = line.decode(errors="replace").split()
    if words == ["dns", "udp"] or words == ["dns", "tcp"]:
        server = nameservers()[0]
        family = socket.AF_INET6 if ":" in server else socket.AF_INET
        if words[1] == "tcp":
            return socket.create_connection((server, DNS_PORT), DNS_SECONDS)
        udp = socket.socket(family, socket.SOCK_DGRAM)
        udp.connect((server, DNS_PORT))
        return udp
    if len(words) != 3 or words[0] != "tcp" or not words[2].isdigit():
        raise OSError(errno.EINVAL, "not a dial request")
    why = refusal(words[1])
    if why:
        raise OSError(errno.EACCES, why)
    target = socket.create_connection((words[1], int(words[2])), CONNECT_SECONDS)
    target.settimeout(None)
    return target


# -- the relay: the gateway's side ---------------------------------------------------------


class Relay:
    """The nodes' connections and DNS queries, carried through the dialer (threads, one per
    connection or query: a pod's traffic is a setup's downloads, not a benchmark's)."""

    def __init__(self, dialer: socket.socket, address: str) -> None:
        self.dialer, self.address = dialer, address

    def start(self) -> None:
        """Bind in this (the holder's) namespace, then serve on daemon threads."""
        relay = socket.create_server((self.address, RELAY_PORT), backlog=128)
        dns_tcp = socket.create_server((self.address, DNS_PORT), backlog=32)
        dns_udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        dns_udp.bind((self.address, DNS_PORT))
        for target, args in ((self._accept, (relay, self._connection)), (self._accept, (dns_tcp, self._dns_tcp))):
            threading.Thread(target=target, args=args, daemon=True).start()
        threading.Thread(target=self._dns_queries, args=(dns_udp,), daemon=True).start()

    def ask(self, request: str) -> socket.socket:
        """The dialer's socket for ``request``; OSError with its errno when it says no."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with mine:
            with theirs:  # the dialer's end: ours goes once it has it
                socket.send_fds(self.dialer, [b"\0"], [theirs.fileno()])
            mine.settimeout(CONNECT_SECONDS + 10)
            return fdpass.take_socket(mine, request, "the dialer is gone")

    @staticmethod
    def _accept(server: socket.socket, handle: Callable[[socket.socket], None]) -> None:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    def _connection(self, conn: socket.socket) -> None:
        """A node's connection, redirected here: to where it was going, or reset."""
        with conn:
            try:
                raw = conn.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
                port, packed = struct.unpack_from("!2xH4s", raw)
                remote = self.ask(f"tcp {socket.inet_ntoa(packed)} {port}")
            except OSError:
                _reset(conn)
                return
            with remote:
                pump(conn, remote)

    def _dns_tcp(self, conn: socket.socket) -> None:
        with conn:
            try:
                remote = self.ask("dns tcp")
            except OSError:
                _reset(conn)
                return
            with remote:
                pump(conn, remote)

    def _dns_queries(self, server: socket.socket) -> None:
        while True:
            query, peer = server.recvfrom(65535)
            threading.Thread(target=self._dns_query, args=(server, query, peer), daemon=True).start()

    def _dns_query(self, server: socket.socket, query: bytes, peer: tuple[str, int]) -> None:
        """One query to the host's nameserver; where it cannot be asked or says nothing, a
        SERVFAIL at once, as a cluster's DNS answers when its upstream fails (a resolver
        left without an answer waits out its timeouts, for every name, again and again)."""
        try:
            with self.ask("dns udp") as remote:
                remote.settimeout(DNS_SECONDS)
                remote.send(query)
                answer = remote.recv(65535)
        except OSError:
            answer = servfail(query)
        with contextlib.suppress(OSError):
            if answer:
                server.sendto(answer, peer)


def servfail(query: bytes) -> bytes:
    """The SERVFAIL answer to a DNS query of one question (its id, opcode and question, which
    a resolver matches against what it asked); b"" for anything else."""
    if len(query) < 12 or query[4:6] != b"\0\1":
        return b""
    end = 12
    while end < len(query) and query[end]:
        end += 1 + query[end]
    end += 5  # the root label, then QTYPE and QCLASS
    if end > len(query):
        return b""
    flags = bytes([0x80 | (query[2] & 0x79), 0x80 | 2])  # QR, opcode and RD kept; RA; SERVFAIL
    return query[:2] + flags + b"\0\1" + b"\0" * 6 + query[12:end]


def _reset(conn: socket.socket) -> None:
    """Close with a reset, as a refused connection ends, rather than an orderly end of data."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def pump(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both ends are done; an end of data is passed on as one."""
    other = threading.Thread(target=_copy, args=(b, a), daemon=True)
    other.start()
    _copy(a, b)
    other.join()


def _copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(_CHUNK):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
