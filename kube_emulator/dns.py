"""The emulated cluster's DNS: what CoreDNS's ``kubernetes`` plugin answers, from the live store.

A real pod finds its peers through cluster DNS, not through ``/etc/hosts`` (the kubelet
writes only the pod's own name there).  So the emulator runs a DNS server of its own on the
bridge's address (port 53, UDP and TCP), and every pod's ``/etc/resolv.conf`` points at it
with the namespace's search path and ``ndots:5``, as the kubelet writes for ``ClusterFirst``.

What it answers, as CoreDNS does (``pods insecure``, no ``fallthrough``):

- ``<hostname>.<service>.<ns>.svc.cluster.local``: the pod whose ``spec.hostname`` is
  ``hostname`` and ``spec.subdomain`` is ``service``, when the headless Service ``service``
  selects it (``<a-b-c-d>.<service>...`` for an endpoint without a hostname);
- ``<service>.<ns>.svc.cluster.local``: every endpoint of a headless Service, the clusterIP
  of any other;
- ``<a-b-c-d>.<ns>.pod.cluster.local``: ``a.b.c.d``;
- ``PTR`` for the endpoints' addresses, ``AAAA`` (and every other type) empty for a name
  that exists, ``NXDOMAIN`` for every other name: nothing is forwarded anywhere (no egress).

An endpoint is a pod with an IP that has not finished; unless the Service publishes
not-ready addresses, it must be Ready and not terminating.  Every answer is computed from
the store when the query arrives, so a deleted pod stops resolving at once.

Hand-written on asyncio with ``struct``: the few record types needed do not justify a
dependency, and the wire format is tested on its own (tests/test_kube_dns.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from kube_emulator.product import ProvisionError

if TYPE_CHECKING:
    from kube_emulator.store import Store

log = logging.getLogger(__name__)

DOMAIN = "cluster.local"
PORT = 53
TTL = 5  # CoreDNS's kubernetes plugin default
UDP_LIMIT = 512  # without EDNS(0), a longer answer is truncated and the client retries on TCP


class RType(IntEnum):
    A = 1
    NS = 2
    SOA = 6
    PTR = 12
    AAAA = 28
    OPT = 41
    ANY = 255


class RCode(IntEnum):
    NOERROR = 0
    FORMERR = 1
    SERVFAIL = 2
    NXDOMAIN = 3
    NOTIMP = 4


class WireError(ValueError):
    """A message that is not a well-formed DNS query (answered FORMERR, or dropped)."""


@dataclass(frozen=True)
class Question:
    name: str  # as sent (case kept: resolvers may randomise it), without the trailing dot
    qtype: int
    qclass: int = 1


@dataclass(frozen=True)
class Query:
    id: int
    flags: int
    question: Question
    udp_size: int = UDP_LIMIT  # what the client's EDNS(0) OPT record allows

    @property
    def opcode(self) -> int:
        return (self.flags >> 11) & 0xF


@dataclass
class Answer:
    """What the zone says about one question: the rcode and the records (type, rdata)."""

    rcode: RCode = RCode.NOERROR
    records: list[tuple[RType, bytes]] = field(default_factory=list)


# -- wire format ------------------------------------------------------------------------------


def encode_name(name: str) -> bytes:
    out = b""
    for label in name.strip(".").split("."):
        if label:
            raw = label.encode("ascii")
            if len(raw) > 63:
                raise WireError(f"label too long: {label!r}")
            out += bytes([len(raw)]) + raw
    return out + b"\x00"


def _read_name(data: bytes, offset: int) -> tuple[str, int]:
    """A (possibly compressed) name at ``offset``; the offset just after it."""
    labels: list[str] = []
    end = -1
    for _ in range(128):  # bounds pointer loops
        if offset >= len(data):
            raise WireError("name runs past the message")
        length = data[offset]
        if length & 0xC0 == 0xC0:
            if offset + 1 >= len(data):
                raise WireError("truncated pointer")
            if end < 0:
                end = offset + 2
            offset = ((length & 0x3F) << 8) | data[offset + 1]
            continue
        if length & 0xC0:
            raise WireError("unknown label type")
        offset += 1
        if length == 0:
            return ".".join(labels), (end if end >= 0 else offset)
        label = data[offset : offset + length]
        if len(label) != length:
            raise WireError("label runs past the message")
        labels.append(label.decode("ascii", errors="replace"))
        offset += length
    raise WireError("compression loop")


def parse_query(data: bytes) -> Query:
    """The header and the single question of a query; the OPT record's payload size, if any."""
    if len(data) < 12:
        raise WireError("shorter than a header")
    qid, flags, qdcount, ancount, nscount, arcount = struct.unpack("!6H", data[:12])
    if flags & 0x8000:
        raise WireError("a response, not a query")
    if qdcount != 1:
        raise WireError(f"{qdcount} questions")
    name, offset = _read_name(data, 12)
    if offset + 4 > len(data):
        raise WireError("truncated question")
    qtype, qclass = struct.unpack("!HH", data[offset : offset + 4])
    offset += 4
    udp_size = UDP_LIMIT
    for _ in range(ancount + nscount + arcount):
        _, offset = _read_name(data, offset)
        if offset + 10 > len(data):
            raise WireError("truncated record")
        rtype, rclass, _ttl, rdlength = struct.unpack("!HHIH", data[offset : offset + 10])
        if rtype == RType.OPT:
            udp_size = max(UDP_LIMIT, rclass)
        offset += 10 + rdlength
    return Query(id=qid, flags=flags, question=Question(name, qtype, qclass), udp_size=udp_size)


def build_response(query: Query, answer: Answer, limit: int | None = None) -> bytes:
    """The response: the question echoed, each record named by a pointer to it (SOA in the
    authority section), truncated (TC, no records) past ``limit`` bytes."""
    q = query.question
    question = encode_name(q.name) + struct.pack("!HH", q.qtype, q.qclass)
    answers = [r for r in answer.records if r[0] != RType.SOA]
    authority = [r for r in answer.records if r[0] == RType.SOA]
    body = b"".join(struct.pack("!HHHIH", 0xC00C, rtype, 1, TTL, len(rdata)) + rdata for rtype, rdata in answers)
    body += b"".join(
        encode_name(DOMAIN) + struct.pack("!HHIH", rtype, 1, TTL, len(rdata)) + rdata for rtype, rdata in authority
    )
    # QR, the opcode and RD copied, AA (the zone is ours), RA as CoreDNS sets it.
    flags = 0x8000 | (query.flags & 0x7900) | 0x0400 | 0x0080 | int(answer.rcode)
    header = struct.pack("!6H", query.id, flags, 1, len(answers), len(authority), 0)
    message = header + question + body
    if limit is not None and len(message) > limit:
        header = struct.pack("!6H", query.id, flags | 0x0200, 1, 0, 0, 0)
        message = header + question
    return message


def error_response(data: bytes, rcode: RCode) -> bytes | None:
    """FORMERR/NOTIMP for a message we cannot answer, when it has at least an ID; else None."""
    if len(data) < 12 or data[2] & 0x80:
        return None
    qid, flags = struct.unpack("!HH", data[:4])
    return struct.pack("!6H", qid, 0x8000 | (flags & 0x7900) | int(rcode), 0, 0, 0, 0)


# -- the zone: the store, read as CoreDNS's kubernetes plugin reads the API --------------------


def _soa() -> bytes:
    return (
        encode_name(f"ns.dns.{DOMAIN}")
        + encode_name(f"hostmaster.{DOMAIN}")
        + struct.pack("!5I", 1, 7200, 1800, 86400, TTL)
    )


def _dashed(ip: str) -> str:
    return ip.replace(".", "-")


@dataclass(frozen=True)
class Endpoint:
    ip: str
    hostname: str  # the pod's spec.hostname when its subdomain is the Service's name, else ""


class Zone:
    """``cluster.local`` and the reverse zone, computed from the emulator's store per query."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def endpoints(self, service: dict[str, Any]) -> list[Endpoint]:
        """The pods a headless Service publishes (the endpoints controller's rules)."""
        meta, spec = service["metadata"], service.get("spec") or {}
        selector = spec.get("selector") or {}
        if not selector:
            return []
        not_ready_too = bool(spec.get("publishNotReadyAddresses"))
        out = []
        for pod in self.store.items("pods", meta["namespace"]):
            labels = pod["metadata"].get("labels") or {}
            status = pod.get("status") or {}
            ip = status.get("podIP")
            if not ip or status.get("phase") in ("Succeeded", "Failed"):
                continue
            if any(labels.get(k) != v for k, v in selector.items()):
                continue
            if not not_ready_too and (pod["metadata"].get("deletionTimestamp") or not _ready(status)):
                continue
            pspec = pod.get("spec") or {}
            own = pspec.get("hostname") and pspec.get("subdomain") == meta["name"]
            out.append(Endpoint(ip=ip, hostname=pspec["hostname"] if own else ""))
        out.sort(key=lambda e: ipaddress.IPv4Address(e.ip))
        return out

    def _service_addresses(self, namespace: str, name: str) -> list[str] | None:
        svc = self.store.get("services", namespace, name)
        if svc is None:
            return None
        cluster_ip = (svc.get("spec") or {}).get("clusterIP")
        if cluster_ip and cluster_ip != "None":
            return [cluster_ip]
        return [e.ip for e in self.endpoints(svc)]

    def addresses(self, name: str) -> list[str] | None:
        """The A records of ``name`` (lower case, no trailing dot); None when it does not exist."""
        if name == DOMAIN or name in (f"svc.{DOMAIN}", f"pod.{DOMAIN}"):
            return []
        if not name.endswith("." + DOMAIN):
            return None
        labels = name[: -len(DOMAIN) - 1].split(".")
        if labels[-1] == "svc" and len(labels) >= 2:
            namespace, rest = labels[-2], labels[:-2]
            if not rest:
                return [] if self.store.get("namespaces", "", namespace) is not None else None
            if len(rest) == 1:
                return self._service_addresses(namespace, rest[0])
            if len(rest) == 2:
                svc = self.store.get("services", namespace, rest[1])
                if svc is None or (svc.get("spec") or {}).get("clusterIP") != "None":
                    return None
                hits = [e.ip for e in self.endpoints(svc) if rest[0] in (e.hostname, _dashed(e.ip))]
                return hits or None
            return None
        if labels[-1] == "pod" and len(labels) == 3:
            try:
                return [str(ipaddress.IPv4Address(labels[0].replace("-", ".")))]
            except ValueError:
                return None
        return None

    def pointers(self, name: str) -> list[str] | None:
        """The PTR records of ``d.c.b.a.in-addr.arpa``: an endpoint's (or a Service's) name."""
        labels = name.split(".")
        if len(labels) != 6 or labels[-2:] != ["in-addr", "arpa"]:
            return None
        ip = ".".join(reversed(labels[:4]))
        out = []
        for svc in self.store.items("services"):
            ns, svc_name = svc["metadata"]["namespace"], svc["metadata"]["name"]
            base = f"{svc_name}.{ns}.svc.{DOMAIN}"
            if (svc.get("spec") or {}).get("clusterIP") == ip:
                out.append(base)
            elif (svc.get("spec") or {}).get("clusterIP") == "None":
                out += [f"{e.hostname or _dashed(e.ip)}.{base}" for e in self.endpoints(svc) if e.ip == ip]
        return out or None

    def answer(self, question: Question) -> Answer:
        name = question.name.lower().rstrip(".")
        if question.qclass not in (1, 255):
            return Answer(RCode.NXDOMAIN)
        if name.endswith(".in-addr.arpa"):
            targets = self.pointers(name)
            if targets is None:
                return Answer(RCode.NXDOMAIN)
            if question.qtype in (RType.PTR, RType.ANY):
                return Answer(records=[(RType.PTR, encode_name(t)) for t in targets])
            return Answer()
        found = self.addresses(name)
        if found is None:
            in_zone = name == DOMAIN or name.endswith("." + DOMAIN)
            return Answer(RCode.NXDOMAIN, [(RType.SOA, _soa())] if in_zone else [])
        if question.qtype in (RType.A, RType.ANY):
            return Answer(records=[(RType.A, ipaddress.IPv4Address(ip).packed) for ip in found])
        return Answer(records=[(RType.SOA, _soa())])  # NODATA: AAAA and the rest, for a name that exists


def _ready(status: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def respond(zone: Zone, data: bytes, limit: int | None) -> bytes | None:
    """The response to one message (None: drop it, as for a response or garbage)."""
    try:
        query = parse_query(data)
    except WireError:
        return error_response(data, RCode.FORMERR)
    if query.opcode != 0:
        return build_response(query, Answer(RCode.NOTIMP))
    try:
        answer = zone.answer(query.question)
    except Exception:  # a bug must not kill the server: the client sees SERVFAIL
        log.exception("DNS: answering %s failed", query.question)
        answer = Answer(RCode.SERVFAIL)
    return build_response(query, answer, None if limit is None else max(limit, query.udp_size))


# -- the server -------------------------------------------------------------------------------


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, zone: Zone) -> None:
        self.zone = zone
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = respond(self.zone, data, UDP_LIMIT)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


def _frames(buffer: bytearray) -> Iterator[bytes]:
    while len(buffer) >= 2:
        size = struct.unpack("!H", buffer[:2])[0]
        if len(buffer) < 2 + size:
            return
        frame = bytes(buffer[2 : 2 + size])
        del buffer[: 2 + size]
        yield frame


class DnsServer:
    """UDP and TCP on ``host:port`` (the bridge's address: only the pods reach it)."""

    def __init__(self, store: Store) -> None:
        self.zone = Zone(store)
        self.address = ""
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    async def start(self, host: str, port: int = PORT) -> None:
        loop = asyncio.get_running_loop()
        try:
            self._udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(self.zone), local_addr=(host, port))
            self._tcp = await asyncio.start_server(self._serve_tcp, host, port)
        except OSError as exc:
            await self.stop()
            raise ProvisionError(
                f"the kube emulator's cluster DNS cannot listen on {host}:{port} ({exc.strerror or exc}): "
                "stop whatever binds port 53 on every address (e.g. a dnsmasq without bind-interfaces)"
            ) from None
        self.address = host

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buffer = bytearray()
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), 30):
                buffer += chunk
                for frame in _frames(buffer):
                    reply = respond(self.zone, frame, None)
                    if reply is not None:
                        writer.write(struct.pack("!H", len(reply)) + reply)
                await writer.drain()
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._tcp.wait_closed(), 2)
            self._tcp = None


def resolv_conf(nameserver: str, namespace: str) -> str:
    """A pod's ``/etc/resolv.conf`` for dnsPolicy ClusterFirst, as the kubelet writes it."""
    return f"search {namespace}.svc.{DOMAIN} svc.{DOMAIN} {DOMAIN}\nnameserver {nameserver}\noptions ndots:5\n"
