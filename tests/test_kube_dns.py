"""The emulated cluster's DNS, as a pod sees it: peers resolve through a nameserver, not /etc/hosts.

A real kubelet writes only the pod's own name into ``/etc/hosts``; every peer is found by
cluster DNS with the namespace's search path.  These tests look from inside pods (exec, as a
user's ``kubectl exec`` would) and at the wire format on its own.
"""

from __future__ import annotations

import socket
import struct

import pytest

kubernetes = pytest.importorskip("kubernetes")
pytest.importorskip("aiohttp")

from kubernetes import client  # noqa: E402

from kube_emulator import Emulator  # noqa: E402
from kube_emulator.dns import (  # noqa: E402
    Answer,
    Query,
    Question,
    RCode,
    RType,
    Zone,
    build_response,
    encode_name,
    parse_query,
    resolv_conf,
    respond,
)
from kube_emulator.store import Store  # noqa: E402
from tests.kube_helpers import (  # noqa: E402
    api,
    delete_and_wait,
    needs_root,
    pod_manifest,
    run,
    running,
    wait_for,
)

LABELS = {"app": "dnsgrp"}
PODS = ("dnsgrp-head", "dnsgrp-worker1", "dnsgrp-worker2")


@pytest.fixture(scope="module")
def v1(emu: Emulator) -> client.CoreV1Api:
    return api(emu.kubeconfig_path)


@pytest.fixture(scope="module")
def group(v1: client.CoreV1Api) -> dict[str, str]:
    """Three pods behind the headless Service ``dnsgrp`` (as the backend makes them): name -> IP."""
    v1.create_namespaced_service(
        "default",
        {
            "metadata": {"name": "dnsgrp", "labels": LABELS},
            "spec": {"clusterIP": "None", "selector": LABELS, "publishNotReadyAddresses": True},
        },
    )
    for name in PODS:
        v1.create_namespaced_pod("default", pod_manifest(name, LABELS, subdomain="dnsgrp"))
    pods = wait_for(v1, "app=dnsgrp", running, len(PODS))
    return {name: pods[name]["status"]["podIP"] for name in PODS}


def getent(v1: client.CoreV1Api, pod: str, *args: str) -> tuple[int, list[str]]:
    """``getent ahostsv4 NAME`` in ``pod``: exit code and the distinct addresses."""
    rc, out = run(v1, pod, ["getent", *args])
    return rc, sorted({line.split()[0] for line in out.splitlines() if line.strip()})


@needs_root
def test_peers_resolve_through_dns_with_the_search_path(v1: client.CoreV1Api, group: dict[str, str]) -> None:
    worker = group["dnsgrp-worker1"]
    for name in ("dnsgrp-worker1.dnsgrp", "dnsgrp-worker1.dnsgrp.default.svc.cluster.local"):
        assert getent(v1, "dnsgrp-head", "ahostsv4", name) == (0, [worker]), name
    # The pod IP's own name in the pod subdomain, and the reverse lookup of a peer.
    dashed = worker.replace(".", "-")
    assert getent(v1, "dnsgrp-head", "ahostsv4", f"{dashed}.default.pod.cluster.local") == (0, [worker])
    rc, out = run(v1, "dnsgrp-head", ["getent", "hosts", worker])
    assert rc == 0 and "dnsgrp-worker1.dnsgrp.default.svc.cluster.local" in out, out
    # The service name: every pod behind it.
    assert getent(v1, "dnsgrp-worker2", "ahostsv4", "dnsgrp") == (0, sorted(group.values()))
    rc, out = run(v1, "dnsgrp-head", ["cat", "/etc/resolv.conf"])
    assert rc == 0
    assert "search default.svc.cluster.local svc.cluster.local cluster.local" in out
    assert "options ndots:5" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("nameserver")] == [
        v1.read_namespaced_pod("dnsgrp-head", "default").status.host_ip
    ]


@needs_root
def test_hosts_file_names_only_the_pod_itself(v1: client.CoreV1Api, group: dict[str, str]) -> None:
    rc, out = run(v1, "dnsgrp-head", ["cat", "/etc/hosts"])
    assert rc == 0
    assert out.startswith("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"), out
    assert f"{group['dnsgrp-head']}\tdnsgrp-head.dnsgrp.default.svc.cluster.local\tdnsgrp-head\n" in out
    for peer in ("dnsgrp-worker1", "dnsgrp-worker2"):
        assert peer not in out and group[peer] not in out, out
    # A bare peer hostname is not a name on a real cluster either (not in the search path).
    assert getent(v1, "dnsgrp-head", "ahostsv4", "dnsgrp-worker1")[0] == 2


GAIERROR = """
import socket, sys, time
start = time.monotonic()
try:
    socket.getaddrinfo(sys.argv[1], 22)
    print("resolved", 0)
except socket.gaierror as exc:
    print(exc.errno, time.monotonic() - start)
"""


@needs_root
def test_unknown_names_fail_fast(v1: client.CoreV1Api, group: dict[str, str]) -> None:
    """NXDOMAIN (EAI_NONAME: no such name), at once: not a timeout, and not EAI_AGAIN ("temporary
    failure", what a resolver without a reachable nameserver says, which callers retry)."""
    for name in ("nosuchpod.dnsgrp", "example.com", "nosuchsvc.default.svc.cluster.local", "dnsgrp-head.other"):
        rc, out = run(v1, "dnsgrp-worker1", ["python3", "-c", GAIERROR, name])
        code, took = out.split()
        assert (rc, int(code)) == (0, socket.EAI_NONAME), (name, out)
        assert float(took) < 3, f"{name}: {took} s (a resolver timeout, not an answer)"


@needs_root
def test_a_deleted_pod_stops_resolving(v1: client.CoreV1Api, group: dict[str, str]) -> None:
    v1.create_namespaced_pod("default", pod_manifest("dnsgone", {**LABELS, "gone": "1"}, subdomain="dnsgrp"))
    ip = wait_for(v1, "gone=1", running, 1)["dnsgone"]["status"]["podIP"]
    assert getent(v1, "dnsgrp-head", "ahostsv4", "dnsgone.dnsgrp") == (0, [ip])
    assert ip in getent(v1, "dnsgrp-head", "ahostsv4", "dnsgrp")[1]
    delete_and_wait(v1, "gone=1")
    assert getent(v1, "dnsgrp-head", "ahostsv4", "dnsgone.dnsgrp") == (2, [])
    assert getent(v1, "dnsgrp-head", "ahostsv4", "dnsgrp")[1] == sorted(group.values())


@needs_root
def test_the_server_answers_over_udp_and_tcp(emu: Emulator, group: dict[str, str]) -> None:
    """From this machine too (the bridge's address): UDP, and TCP for a truncated answer's retry."""
    address = emu.server.cluster.dns.address
    query = query_bytes("dnsgrp.default.svc.cluster.local", RType.A, qid=77)
    want = sorted(bytes(int(o) for o in ip.split(".")) for ip in group.values())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.settimeout(5)
        udp.sendto(query, (address, 53))
        qid, _, _, records = parse_response(udp.recv(4096))
    assert qid == 77 and sorted(r for _, r in records) == want
    with socket.create_connection((address, 53), timeout=5) as tcp:
        tcp.sendall(struct.pack("!H", len(query)) + query + struct.pack("!H", len(query)) + query)
        stream = tcp.makefile("rb")
        for _ in range(2):  # two queries on one connection, each answered in its frame
            size = struct.unpack("!H", stream.read(2))[0]
            qid, _, _, records = parse_response(stream.read(size))
            assert qid == 77 and sorted(r for _, r in records) == want


# -- the wire format, without a cluster --------------------------------------------------------


def query_bytes(name: str, qtype: int, qid: int = 0x1234, edns: int | None = None) -> bytes:
    header = struct.pack("!6H", qid, 0x0100, 1, 0, 0, 1 if edns else 0)
    body = encode_name(name) + struct.pack("!HH", qtype, 1)
    if edns:
        body += b"\x00" + struct.pack("!HHIH", RType.OPT, edns, 0, 0)
    return header + body


def parse_response(data: bytes) -> tuple[int, int, int, list[tuple[int, bytes]]]:
    """id, flags, the question's end, and each answer record (type, rdata)."""
    qid, flags, _qd, an, _ns, _ar = struct.unpack("!6H", data[:12])
    offset = data.index(b"\x00", 12) + 5
    end, records = offset, []
    for _ in range(an):
        assert data[offset : offset + 2] == b"\xc0\x0c", "each answer points at the question's name"
        rtype, _cls, _ttl, length = struct.unpack("!HHIH", data[offset + 2 : offset + 12])
        records.append((rtype, data[offset + 12 : offset + 12 + length]))
        offset += 12 + length
    return qid, flags, end, records


def small_store() -> Store:
    store = Store()
    store.create("namespaces", {"metadata": {"name": "default", "namespace": ""}})
    store.create(
        "services",
        {
            "metadata": {"name": "grp", "namespace": "default"},
            "spec": {"clusterIP": "None", "selector": {"app": "grp"}},
        },
    )
    for i, ready in ((2, "True"), (3, "False")):
        store.create(
            "pods",
            {
                "metadata": {"name": f"grp-{i}", "namespace": "default", "labels": {"app": "grp"}},
                "spec": {"hostname": f"grp-{i}", "subdomain": "grp"},
                "status": {
                    "phase": "Running",
                    "podIP": f"198.18.7.{i}",
                    "conditions": [{"type": "Ready", "status": ready}],
                },
            },
        )
    return store


def test_wire_format_query_answer_and_nxdomain() -> None:
    zone = Zone(small_store())
    query = query_bytes("Grp-2.GRP.default.svc.cluster.local", RType.A)
    parsed = parse_query(query)
    assert parsed == Query(0x1234, 0x0100, Question("Grp-2.GRP.default.svc.cluster.local", RType.A))
    reply = respond(zone, query, 512)
    assert reply is not None
    qid, flags, end, records = parse_response(reply)
    assert qid == 0x1234 and flags & 0x8000 and flags & 0x0400 and flags & 0x0100 and flags & 0xF == 0
    assert reply[12:end] == query[12:], "the question is echoed as asked (case kept)"
    assert records == [(RType.A, bytes([198, 18, 7, 2]))]
    # A not-ready pod is no endpoint of a Service that does not publish not-ready addresses.
    _, flags, _, records = parse_response(respond(zone, query_bytes("grp-3.grp.default.svc.cluster.local", 1), 512))
    assert (flags & 0xF, records) == (RCode.NXDOMAIN, [])
    _, flags, _, records = parse_response(respond(zone, query_bytes("grp.default.svc.cluster.local", 1), 512))
    assert (flags & 0xF, records) == (0, [(RType.A, bytes([198, 18, 7, 2]))])
    # AAAA for a name that exists: NOERROR and nothing; a name that does not: NXDOMAIN.
    _, flags, _, records = parse_response(respond(zone, query_bytes("grp.default.svc.cluster.local", 28), 512))
    assert (flags & 0xF, records) == (0, [])
    for name in ("nope.default.svc.cluster.local", "example.com", "grp.other.svc.cluster.local"):
        _, flags, _, records = parse_response(respond(zone, query_bytes(name, RType.A), 512))
        assert (flags & 0xF, records) == (RCode.NXDOMAIN, []), name
    _, _, _, records = parse_response(respond(zone, query_bytes("2.7.18.198.in-addr.arpa", RType.PTR), 512))
    assert records == [(RType.PTR, encode_name("grp-2.grp.default.svc.cluster.local"))]
    # Garbage gets FORMERR (when it has an ID at all); a response is never answered.
    assert respond(zone, b"\x12\x34\x01\x00\x00\x02" + b"\x00" * 6, 512)[3] & 0xF == RCode.FORMERR
    assert respond(zone, b"\x12\x34\x81\x00" + b"\x00" * 8, 512) is None


def test_a_long_answer_is_truncated_over_udp() -> None:
    query = Query(7, 0x0100, Question("grp.default.svc.cluster.local", RType.A))
    answer = Answer(records=[(RType.A, bytes([198, 18, 7, i])) for i in range(2, 60)])
    assert len(build_response(query, answer)) > 512
    short = build_response(query, answer, limit=512)
    assert struct.unpack("!H", short[2:4])[0] & 0x0200 and struct.unpack("!H", short[6:8])[0] == 0
    # A client that offers a bigger buffer (EDNS(0)) gets it.
    assert parse_query(query_bytes("x.cluster.local", 1, edns=4096)).udp_size == 4096


def test_resolv_conf_is_what_the_kubelet_writes_for_cluster_first() -> None:
    assert resolv_conf("198.18.4.1", "team") == (
        "search team.svc.cluster.local svc.cluster.local cluster.local\nnameserver 198.18.4.1\noptions ndots:5\n"
    )
