"""What a local node can connect to (``gateway``, ``clusterns``; DESIGN.md section 5, "What
a node reaches"): its own cluster, and the world as a pod does, through its cluster's
gateway; never a port of a host process at any host address, another cluster's subnet or
the link-local range; and nothing of the host's forwarding or firewall changes for it.

Traffic goes only to this machine's own addresses and the clusters' nodes, but for one
package download from the package index pip uses (where the host's own pip can reach it).
The link-local range is checked where nothing is sent: the gateway's route and rules, and
what its dialer answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky import Task
from pytest_sky.backends import gateway
from tests.leftovers import host_settings_lock, processes_mentioning
from tests.unprivileged import AS_NOBODY, run_python, world_dir

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("sshd") is None, reason="needs root (rootless runs as nobody) and OpenSSH sshd"
)

IP = shutil.which("ip") or "/usr/sbin/ip"
PACKAGE = "six==1.16.0"  # a small wheel with no dependencies
#: The download a setup does, the same on the host and on a node: pip's own index, with what
#: the system's pip configuration says (a node sees /etc, not the host user's home).
DOWNLOAD = "python -m pip download --no-deps --no-cache-dir --only-binary=:all: --disable-pip-version-check -q -d"


class HostService:
    """A host process listening on every address (0.0.0.0), which records who connected."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("0.0.0.0", 0), backlog=64)
        self.port = self.sock.getsockname()[1]
        self.peers: list[tuple[str, int]] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            self.peers.append(peer)
            with contextlib.suppress(OSError):
                conn.sendall(b"the host's\n")
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def service() -> Iterator[HostService]:
    svc = HostService()
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def cluster(module_home: Path) -> Iterator[pytest_sky.Cluster]:
    c = pytest_sky.launch(num_nodes=2, name=f"net-{os.getpid() % 10000}")
    yield c
    c.down()


def holder_pid(cluster: pytest_sky.Cluster) -> int:
    return int(cluster.journal.load()["holder"]["pid"])


def in_gateway(cluster: pytest_sky.Cluster, *argv: str) -> str:
    """Run ``argv`` in the cluster's namespace (its holder's), as root of the host."""
    proc = subprocess.run(
        ["nsenter", f"--net=/proc/{holder_pid(cluster)}/ns/net", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return proc.stdout + proc.stderr


#: On a node: connect to each address at a port (``python - PORT ADDR...``), one JSON line.
CONNECT = r"""
import json, socket, sys
port, out = int(sys.argv[1]), {}
for address in sys.argv[2:]:
    try:
        with socket.create_connection((address, port), 5) as s:
            out[address] = "connected: " + s.recv(64).decode(errors="replace")
    except OSError as e:
        out[address] = type(e).__name__
print(json.dumps(out))
"""


def connect_from_nodes(cluster: pytest_sky.Cluster, port: int, addresses: list[str]) -> list[dict[str, str]]:
    script = cluster.run(f"cat > ~/connect.py <<'EOF'\n{CONNECT}\nEOF")
    assert script.ok, script.output
    res = cluster.run(f"python ~/connect.py {port} {' '.join(addresses)}", timeout=120)
    assert res.returncode == 0, res.output
    return [json.loads(r.stdout) for r in res.ranks]


def host_addresses(cluster: pytest_sky.Cluster) -> list[str]:
    """Every IPv4 address of this host, its end of the cluster's link and the gateway's
    address (the bridge's, ``.1``) among them."""
    subnet = cluster.node_ips[0].rsplit(".", 1)[0]
    return sorted({*gateway.host_addresses(), f"{subnet}.1", f"{subnet}.254"})


def refused_at_once(rank: int, seen: dict[str, str]) -> None:
    """No host address reached, and none left a node's connect waiting for its timeout: a
    node is told (refused, reset, unreachable), as a pod whose policy rejects it is."""
    reached = {a: r for a, r in seen.items() if r.startswith("connected")}
    assert not reached, f"rank {rank} reached the host's service: {reached}"
    hung = sorted(a for a, r in seen.items() if r == "TimeoutError")
    assert not hung, f"rank {rank}: a connect to {hung} was dropped, not refused"


def test_a_host_service_is_unreachable_from_a_node_at_every_host_address(cluster, service: HostService) -> None:
    addresses = host_addresses(cluster)
    assert f"{cluster.node_ips[0].rsplit('.', 1)[0]}.254" in gateway.host_addresses()  # the host's end
    results = connect_from_nodes(cluster, service.port, addresses)
    for rank, seen in enumerate(results):
        refused_at_once(rank, seen)
    assert service.peers == []
    # The host's end of the cluster's link routes nothing that arrives on it and has no IPv6.
    link = cluster.journal.load()["bridge"]
    assert Path(f"/proc/sys/net/ipv4/conf/{link}/forwarding").read_text().strip() == "0"
    assert Path(f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6").read_text().strip() == "1"
    # The control: the host's own client reaches it, and the nodes reach each other.
    with socket.create_connection(("127.0.0.1", service.port), 5) as s:
        assert s.recv(64) == b"the host's\n"
    assert cluster.run(f"ssh {cluster.node_ips[1]} true").ok


def test_an_address_the_host_gains_later_is_refused_too(cluster, service: HostService) -> None:
    """The gateway was told the host's addresses when the cluster started; one added since
    (here to the cluster's own link on the host, which goes with it) is the host's too, and
    its dialer refuses it before connecting."""
    link = cluster.journal.load()["bridge"]
    late = "198.51.100.7"  # TEST-NET-2: only ever this host's own address here
    subprocess.run([IP, "addr", "add", f"{late}/32", "dev", link], check=True, timeout=30)
    try:
        (seen, _) = connect_from_nodes(cluster, service.port, [late])
    finally:
        subprocess.run([IP, "addr", "del", f"{late}/32", "dev", link], check=False, timeout=30)
    assert not seen[late].startswith("connected") and seen[late] in ("ConnectionResetError", "ConnectionRefusedError")
    assert service.peers == []


def test_the_gateway_never_routes_to_link_local_or_another_clusters_subnet(cluster) -> None:
    """Nothing sent: the gateway's own route lookups, its rules, and its dialer's answers."""
    routes = in_gateway(cluster, IP, "route", "get", "169.254.169.254") + in_gateway(
        cluster, IP, "route", "get", "198.19.255.254"
    )
    assert routes.count("unreachable") == 2, routes
    rules = in_gateway(cluster, "iptables-save")
    prerouting = [line for line in rules.splitlines() if line.startswith("-A PREROUTING")]
    redirect = next(i for i, line in enumerate(prerouting) if "REDIRECT" in line)
    for net in ("169.254.0.0/16", "198.18.0.0/15", "127.0.0.0/8"):
        assert any(f"-d {net}" in line and "RETURN" in line for line in prerouting[:redirect]), prerouting
    assert gateway.refusal("169.254.169.254") and gateway.refusal("198.19.0.2") and gateway.refusal("127.0.0.1")
    own = next(a for a in gateway.host_addresses() if not a.startswith(("127.", "198.18.", "198.19.")))
    assert gateway.refusal(own) == "an address of this host's"
    assert gateway.refusal("192.0.2.250") is None  # an address of no one here: out it would go


def test_a_node_reaches_its_own_cluster_and_names_resolve(cluster) -> None:
    res = cluster.run(f"ssh {cluster.node_ips[1]} hostname; getent hosts {cluster.name}-worker1")
    assert res.ok, res.output
    # Names are resolved through the gateway, as a pod's through the cluster's DNS.
    conf = cluster.run("cat /etc/resolv.conf").ranks[0].stdout
    assert f"nameserver {cluster.node_ips[0].rsplit('.', 1)[0]}.1" in conf.splitlines(), conf


def host_can_download(tmp_path: Path) -> str | None:
    """Why this host's own pip cannot download the package (None: it can), run as a node
    runs it: a home without pip settings, the system's configuration only."""
    home = tmp_path / "host-home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8"}
    argv = [sys.executable, *DOWNLOAD.split()[1:], str(tmp_path / "host-dl"), PACKAGE]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["pip failed"])[-1]


def test_a_setup_downloads_a_package_with_pip_where_the_host_can(cluster, tmp_path: Path) -> None:
    why = host_can_download(tmp_path)
    if why:
        pytest.skip(f"this host's own pip cannot download {PACKAGE}: {why}")
    task = Task(setup=f"{DOWNLOAD} ~/dl {PACKAGE}", run="ls ~/dl", num_nodes=2)
    res = cluster.run(task, timeout=600)
    assert res.returncode == 0, res.output
    assert [r.stdout.strip() for r in res.ranks] == ["six-1.16.0-py2.py3-none-any.whl"] * 2, res.output


def firewall_and_forwarding() -> dict[str, str]:
    """The host's forwarding settings and firewall, as text (counters left out)."""
    out = {}
    for name in ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding", "net/ipv4/conf/all/forwarding"):
        out[name] = Path("/proc/sys", name).read_text().strip()
    for argv in (["iptables-save"], ["ip6tables-save"], ["nft", "list", "ruleset"]):
        if shutil.which(argv[0]):
            text = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False).stdout
            out[argv[0]] = "\n".join(
                re.sub(r"\[\d+:\d+\]", "", line) for line in text.splitlines() if not line.startswith("#")
            )
    return out


def test_the_hosts_forwarding_and_firewall_are_as_they_were(module_home: Path, tmp_path: Path) -> None:
    """Before a cluster, while it runs and after it: the same.  Everything of its gateway
    is in its own namespace."""
    with host_settings_lock():
        before = firewall_and_forwarding()
        with pytest_sky.launch(num_nodes=2, name=f"netfw-{os.getpid() % 10000}") as c:
            assert c.run("getent hosts localhost").ok
            during = firewall_and_forwarding()
            assert "1" in in_gateway(c, "cat", "/proc/sys/net/ipv4/ip_forward")  # the gateway's own
        after = firewall_and_forwarding()
    assert during == before and after == before


#: Run as ``nobody``: a rootless cluster reaching for the host's service and downloading a
#: package; one JSON line.
ROOTLESS = r"""
import json, os, sys
import pytest_sky
from pytest_sky import Task
from pytest_sky.backends import gateway
port, download = os.environ["PSKY_PORT"], os.environ["PSKY_DOWNLOAD"]
out = {}
c = pytest_sky.launch(num_nodes=2, name="rlnet")
try:
    subnet = c.node_ips[0].rsplit(".", 1)[0]
    addresses = sorted({*gateway.host_addresses(), f"{subnet}.1"})
    c.run("cat > ~/connect.py <<'EOF'\n" + os.environ["PSKY_CONNECT"] + "\nEOF")
    res = c.run(f"python ~/connect.py {port} {' '.join(addresses)}", timeout=120)
    out["connect"] = [r.stdout for r in res.ranks]
    if download:
        res = c.run(Task(setup=download, run="ls ~/dl", num_nodes=2), timeout=600)
        out["download"] = [r.stdout.strip() for r in res.ranks] if res.returncode == 0 else res.output
finally:
    c.down()
print(json.dumps(out))
"""


def test_a_rootless_node_reaches_the_world_and_never_the_host(service: HostService, tmp_path: Path) -> None:
    download = "" if host_can_download(tmp_path) else f"{DOWNLOAD} ~/dl {PACKAGE}"
    home = world_dir("psky-rlnet-")
    try:
        env = {"PYTEST_SKY_HOME": str(home), "PSKY_PORT": str(service.port), "PSKY_CONNECT": CONNECT}
        proc = run_python(AS_NOBODY, ROOTLESS, env={**env, "PSKY_DOWNLOAD": download}, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        for rank, text in enumerate(out["connect"]):
            refused_at_once(rank, json.loads(text))
        assert service.peers == []
        if download:
            assert out["download"] == ["six-1.16.0-py2.py3-none-any.whl"] * 2, out
        assert not processes_mentioning(str(home))
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if not download:
        pytest.skip(f"this host's own pip cannot download {PACKAGE}; the host's service was out of reach")


# -- the gateway's parts, without a cluster -------------------------------------------------


def test_the_gateways_rules_send_out_only_what_may_go() -> None:
    plan = gateway.GatewayPlan(
        bridge="psky7",
        address="198.18.7.1",
        subnet="198.18.7.0/24",
        uplink="uplink",
        host_end="198.18.7.254",
        host_addresses=("192.0.2.2", "127.0.0.1", "198.18.9.254"),
    )
    rules = gateway.rules(plan).splitlines()
    returns = [line for line in rules if line.endswith("-j RETURN")]
    assert "-A PREROUTING -i psky7 -d 192.0.2.2/32 -j RETURN" in returns  # the host's: no route
    assert not any("127.0.0.1/32" in line or "198.18.9.254" in line for line in returns)  # covered by ranges
    assert rules.index(returns[-1]) < rules.index(
        f"-A PREROUTING -i psky7 -p tcp -j REDIRECT --to-ports {gateway.RELAY_PORT}"
    )
    assert ":FORWARD DROP [0:0]" in rules
    assert "-A FORWARD -i psky7 -o uplink -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT" in rules
    assert "-A FORWARD -i uplink -o psky7 -j ACCEPT" in rules
    rootless = gateway.rules(gateway.GatewayPlan(bridge="psky7", address="198.18.7.1", subnet="198.18.7.0/24"))
    assert "uplink" not in rootless
    # Forwarding in the namespace, rootless too: only then does the kernel answer a packet
    # it has no route for (the host's addresses) instead of dropping it while a node waits.
    assert ("net/ipv4/ip_forward", "1") in gateway.sysctls(gateway.GatewayPlan("psky7", "198.18.7.1", "x"))


def test_a_nodes_resolver_is_its_gateway_and_the_hosts_nameservers_are_asked() -> None:
    host = "search example.internal\nnameserver 127.0.0.53\noptions edns0 trust-ad\n"
    assert gateway.resolv_conf(host, "198.18.7.1") == (
        "nameserver 198.18.7.1\nsearch example.internal\noptions edns0 trust-ad\n"
    )
    assert gateway.nameservers(host) == ["127.0.0.53"]
    assert gateway.nameservers("search x\n") == ["127.0.0.1"]
    trie = (
        "Main:\n  +-- 0.0.0.0/0 3 0 5\n     |-- 192.0.2.2\n        /32 host LOCAL\n"
        "     |-- 192.0.2.255\n        /32 link BROADCAST\n"
    )
    assert gateway.host_addresses(trie) == ["192.0.2.2"]


def test_a_query_the_host_cannot_answer_fails_at_once() -> None:
    """SERVFAIL for the one question asked (its id and question kept, for the resolver to
    match), never silence; and nothing for what is not one query."""
    query = bytes.fromhex("abcd0120000100000000000106707974686f6e036f726700000100010000291000000000000000")
    answer = gateway.servfail(query)
    assert answer[:2] == b"\xab\xcd" and answer[2] & 0x80 and answer[3] & 0x0F == 2
    assert answer[4:12] == b"\0\1\0\0\0\0\0\0" and answer[12:] == query[12:28]  # python.org A IN
    assert gateway.servfail(b"short") == b"" and gateway.servfail(query[:20]) == b""
