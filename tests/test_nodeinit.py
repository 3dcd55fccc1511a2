"""The node start without a shell (``backends/nodeinit.py``), driven through ``netns.start_nodes``
as the local backend and the emulator's kubelet drive it: what a node gets from its system
calls (link, address, route, mounts) is what ``ip`` and ``mount`` used to give it, and a node
that cannot start says which step failed and leaves nothing."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from pytest_sky import procs
from pytest_sky.backends import clusterns, netns
from pytest_sky.backends.netns import output, spawn
from pytest_sky.backends.nodeinit_protocol import Report, Stage
from pytest_sky.errors import ProvisionError
from tests.bridges import IP, free_indexes


@pytest.fixture
def bridge(tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """(bridge, subnet, base address) of a fresh bridge of ours, gone afterwards with its links."""
    index = free_indexes(1)
    name = clusterns.bridge_name(index)
    subnet, base = clusterns.subnet_of(index)
    assert netns.create_bridge(IP, name, base + "1", 24, subnet, 1500, str(tmp_path))
    yield name, subnet, base
    netns.delete_cluster_links(IP, name)


def spec(tmp_path: Path, bridge: str, base: str, rank: int, **kw: object) -> netns.NodeSpec:
    root = tmp_path / f"node{rank}"
    (root / "etc").mkdir(parents=True)
    (root / "home").mkdir()
    (root / "etc" / "passwd").write_text(Path("/etc/passwd").read_text())
    (root / "etc" / "hosts").write_text(f"{base}{2 + rank} n{rank}\n")
    return netns.NodeSpec(hostname=f"n{rank}", ip=f"{base}{2 + rank}", root=root, veth=f"{bridge}n{rank}", **kw)


def start(specs: list[netns.NodeSpec], bridge: str, subnet: str) -> list[netns.NodeProcess]:
    return netns.start_nodes(specs, bridge=bridge, prefixlen=24, subnet=subnet, mtu=1500, tools=netns.require_tools())


def in_node(node: netns.NodeProcess, *argv: str) -> str:
    nsenter = netns.fault_tools()["nsenter"]
    return subprocess.run(
        [nsenter, "-t", str(node.init_pid), "-n", "-m", "-u", "-p", *argv], capture_output=True, text=True, check=True
    ).stdout


def test_a_node_gets_its_link_address_and_route_from_its_own_system_calls(tmp_path, bridge):
    name, subnet, base = bridge
    listen = [sys.executable, "-c", "import socket\ns = socket.create_server(('0.0.0.0', 7))\nwhile True: s.accept()"]
    nodes = start([spec(tmp_path, name, base, r, command=listen) for r in range(2)], name, subnet)
    try:
        head = nodes[0]
        assert in_node(head, "hostname").strip() == "n0"
        assert f"inet {base}2/24" in in_node(head, "ip", "-o", "addr", "show", "eth0")
        assert "quickack 1" in in_node(head, "ip", "route", "show", subnet)
        assert netns.node_mac(head.ip) in in_node(head, "ip", "link", "show", "eth0")
        host_end = Path("/sys/class/net") / head.veth
        assert (host_end / "master").resolve().name == name
        assert (host_end / "netdev_group").read_text().strip() == str(netns.link_group(name))
        assert netns.link_alias(head.veth) == str(tmp_path / "node0")
        assert "UP" in subprocess.run([IP, "link", "show", head.veth], capture_output=True, text=True).stdout
        # Over the bridge, node to node: the addresses and links are real (dialled until the
        # listener is there: a refusal is the real signal that it is not yet).
        dial = (
            "import socket, time\n"
            "deadline = time.monotonic() + 20\n"
            "while True:\n"
            "    try:\n"
            f"        socket.create_connection(('{nodes[1].ip}', 7), timeout=5).close(); break\n"
            "    except ConnectionRefusedError:\n"
            "        assert time.monotonic() < deadline\n"
            "        time.sleep(0.01)\n"
            "print('connected')\n"
        )
        assert in_node(head, sys.executable, "-c", dial).strip() == "connected"
        # The keepers carry the node directories on their command lines (how a reaper finds them).
        assert {pid for pid, _ in netns.node_processes(str(tmp_path))} >= {n.pid for n in nodes}
    finally:
        netns.stop_nodes(IP, nodes)
    assert all(not procs.is_alive(n.pid) and not procs.is_alive(n.init_pid) for n in nodes)
    assert not netns.link_exists(nodes[0].veth)


def test_the_first_process_s_exit_code_is_written_where_the_emulator_reads_it(tmp_path, bridge):
    name, subnet, base = bridge
    (node,) = start([spec(tmp_path, name, base, 0, command=["sh", "-c", "exit 7"])], name, subnet)
    try:
        try:
            fd = os.pidfd_open(node.pid)
        except ProcessLookupError:
            pass  # ended and reaped already
        else:
            try:
                assert select.select([fd], [], [], 30)[0], "the keeper did not end with its node"
            finally:
                os.close(fd)
        assert node.exit_code() == 7
    finally:
        netns.stop_nodes(IP, [node])


def test_a_read_only_mount_keeps_the_source_s_flags(tmp_path, bridge):
    """``mount --bind -o ro`` as util-linux does it: read-only, and nothing the host's own
    mount forbids (nosuid, nodev, noexec) is allowed on the node."""
    name, subnet, base = bridge
    source = tmp_path / "src"
    source.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "nosuid,nodev,noexec", "psky-test-src", str(source)], check=True)
    try:
        (node,) = start(
            [spec(tmp_path, name, base, 0, command=["sleep", "600"], extra_mounts={str(source): "/run/psky-ro"})],
            name,
            subnet,
        )
        try:
            mounts = in_node(node, "cat", "/proc/mounts").splitlines()
            options = next(line.split()[3] for line in mounts if " /run/psky-ro " in line).split(",")
            assert {"ro", "nosuid", "nodev", "noexec"} <= set(options)
        finally:
            netns.stop_nodes(IP, [node])
    finally:
        subprocess.run(["umount", str(source)], check=True)


def test_a_node_that_cannot_mount_says_which_mount_and_leaves_nothing(tmp_path, bridge):
    name, subnet, base = bridge
    missing = tmp_path / "not-there"
    # The failing node first: the host hears of its failure before it has heard of the
    # others, which may have made their veths already (CI once found one left).
    specs = [
        spec(tmp_path, name, base, 0, command=["sleep", "600"], extra_mounts={str(missing): "/run/x"}),
        *(spec(tmp_path, name, base, r, command=["sleep", "600"]) for r in range(1, 4)),
    ]
    with pytest.raises(ProvisionError, match=rf"node n0 did not start: mount bind {missing} on /run/x"):
        start(specs, name, subnet)
    assert netns.node_processes(str(tmp_path)) == []
    assert [s.veth for s in specs if netns.link_exists(s.veth)] == []
    assert [c for c in (netns.node_cgroup(s.veth) for s in specs) if c is not None and c.exists()] == []


def relay(capfd: pytest.CaptureFixture[str], said: list[Report]) -> str:
    """What the spawner's relay passes on when node 0's pipe carries ``said`` and then closes."""
    from pytest_sky.backends import nodeinit

    up_r, up_w = os.pipe()
    os.write(up_w, b"".join(r.encode() for r in said))
    os.close(up_w)
    stdin_r, stdin_w = os.pipe()  # the host's end, still open: as the spawner's stdin
    saved = os.dup(0)
    os.dup2(stdin_r, 0)
    try:
        nodeinit._relay({up_r: 0}, keepers=[])
    finally:
        os.dup2(saved, 0)
        for fd in (saved, stdin_r, stdin_w):
            os.close(fd)
    return capfd.readouterr().out


def host_reads(relayed: str, log: Path) -> list[netns.NodeProcess]:
    """What the host makes of the relayed reports (one node, whose log is ``log``)."""
    spawner = object.__new__(spawn._Spawner)
    spec = netns.NodeSpec(hostname="n0", ip="198.18.0.2", root=Path("/nonexistent"), veth="psky0n0")
    spawner.specs, spawner.cgroups, spawner.started = [spec], [None], {}
    spawner.plans = [SimpleNamespace(log=str(log))]
    out_r, out_w = os.pipe()
    os.write(out_w, relayed.encode())
    os.close(out_w)
    with os.fdopen(out_r, "rb") as stdout:
        spawner.lines = output.Lines(SimpleNamespace(stdout=stdout))
        return spawner.wait_configured(timeout=5)


def test_a_keeper_s_ready_after_its_init_s_configured_is_still_relayed_and_read(capfd):
    """The keeper says READY after forking the init, which may be configured first; the
    spawner relays both reports whatever their order, and the host waits for both (a 64-node
    bench run once lost node 53's READY this way)."""
    reports = [Report(Stage.CONFIGURED, 0), Report(Stage.READY, 0, keeper_pid=4242, init_pid=4243)]
    relayed = relay(capfd, reports)
    assert [Report.decode(line) for line in relayed.splitlines()] == reports
    (node,) = host_reads(relayed, Path("/nonexistent/node.log"))
    assert (node.pid, node.init_pid) == (4242, 4243)


def test_a_node_whose_pipe_closes_before_it_is_configured_fails_with_its_log(capfd, tmp_path: Path):
    """A keeper that died without a word: the relay says EXITED, and the host names the node
    and quotes its log's last line (what the dying process printed)."""
    relayed = relay(capfd, [Report(Stage.READY, 0, keeper_pid=4242, init_pid=4243)])
    assert Report.decode(relayed.splitlines()[-1]) == Report(Stage.EXITED, 0)
    log = tmp_path / "node.log"
    log.write_text("sshd: no hostkeys available\n")
    expected = "node n0 did not start: the node's first process exited | sshd: no hostkeys"
    with pytest.raises(ProvisionError, match=re.escape(expected)):
        host_reads(relayed, log)


def test_a_mounts_destination_is_resolved_inside_the_nodes_root(tmp_path: Path) -> None:
    """An image's /var/run -> /run (absolute) must lead a volume's mount, and the directories
    made for it, to the node's /run, never the host's; a relative link stays inside too, and
    .. stops at the node's root."""
    from pytest_sky.backends.rootpath import within

    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")
    (root / "etc").mkdir()
    (root / "etc" / "alt").symlink_to("../run")
    (root / "loop").symlink_to("/loop")
    r = str(root)
    assert within(r, "/var/run/secrets/kubernetes.io/serviceaccount") == f"{r}/run/secrets/kubernetes.io/serviceaccount"
    assert within(r, "/etc/alt/x") == f"{r}/run/x"
    assert within(r, "/../../etc/passwd") == f"{r}/etc/passwd"
    assert within(r, "/") == f"{r}/"
    with pytest.raises(Exception, match="too many symbolic links"):
        within(r, "/loop/x")
