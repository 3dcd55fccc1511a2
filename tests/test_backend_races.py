"""Races and silent failures of the local backend, each forced to happen: a reaper racing a
bridge's creator, a kernel without pidfds, a run killed while its nodes start, a host that
already routes part of 198.18.0.0/15."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from pytest_sky.backends import clusterns, netns
from pytest_sky.backends.local import LocalBackend
from pytest_sky.cluster import reap_orphans
from pytest_sky.errors import ProvisionError
from pytest_sky.state import StateStore
from tests.bridges import IP, free_indexes


def test_a_reaper_never_deletes_a_bridge_whose_creator_is_still_at_work(tmp_path: Path) -> None:
    """A creator stalled between creating its bridge and naming its owner, however long:
    the reaper waits for it (the creators' lock), then sees the owner, and leaves it."""
    clusters = tmp_path / "clusters"
    (clusters / "busy").mkdir(parents=True)
    (clusters / "busy" / "record.json").write_text("{}")
    index = free_indexes(1)
    name = clusterns.bridge_name(index)
    reaped: list[list[str]] = []
    try:
        with netns.link_lock(exclusive=False):  # the creator, mid-way
            subprocess.run([IP, "link", "add", name, "type", "bridge"], check=True)
            reaper = threading.Thread(target=lambda: reaped.append(LocalBackend().reap_stray_links(clusters)))
            reaper.start()
            reaper.join(1.5)  # longer than any grace period a reaper could use
            assert netns.link_exists(name), "the reaper deleted a bridge while its creator was at work"
            netns.set_alias(name, str(clusters / "busy"))
        reaper.join(30)
        assert len(reaped) == 1 and f"link {name}" not in reaped[0] and netns.link_exists(name)
    finally:
        netns.delete_links(IP, [name])


def test_a_bridge_whose_creator_died_before_naming_it_is_reaped(tmp_path: Path) -> None:
    index = free_indexes(1)
    name = clusterns.bridge_name(index)
    subprocess.run([IP, "link", "add", name, "type", "bridge"], check=True)  # nobody holds the lock
    try:
        LocalBackend().reap_stray_links(tmp_path / "clusters")  # or another run's, at the same time
        assert netns.link_alias(name) != "", "the unnamed bridge is still there"  # None: gone
    finally:
        netns.delete_links(IP, [name])


@pytest.mark.skipif(netns.cgroup2_root() is None, reason="this host gives us no cgroup v2 hierarchy to write")
def test_a_dead_nodes_cgroup_goes_with_its_jobs_cgroups_once_its_bridge_is_gone(tmp_path: Path) -> None:
    """A node killed with its owner leaves its cgroup empty, with the cgroups its jobs had
    inside it: once its bridge is gone the reaper removes the whole tree, innermost first."""
    root = netns.cgroup2_root()
    assert root is not None
    node = root / f"{netns.LINK_PREFIX}9993n0"  # past every subnet index: no bridge of that name is ever made
    (node / "psky-job-1-0").mkdir(parents=True)
    try:
        LocalBackend().reap_stray_links(tmp_path / "clusters")  # or another run's, at the same time
        assert not node.exists()
    finally:
        netns.kill_cgroups([node])


def test_a_clusters_links_go_in_one_deletion_that_spares_a_foreign_link_in_its_group(tmp_path: Path) -> None:
    """Teardown deletes the bridge and its veths by their link group (one kernel operation);
    a link of the host's that happens to carry the same group number stays, and so do the
    links of every other cluster."""
    index = free_indexes(2)
    name, other = clusterns.bridge_name(index), clusterns.bridge_name(index + 1)
    subnet, base = clusterns.subnet_of(index)
    group = netns.link_group(name)
    foreign = f"tgrp{os.getpid() % 100000}"
    assert netns.create_bridge(IP, name, base + "1", 24, subnet, 1500, str(tmp_path))
    try:
        netns.ip_batch(IP, [f"link add {name}n{r} group {group} type veth peer name {name}x{r}" for r in range(3)])
        netns.ip_batch(IP, [f"link add {other}n0 group {netns.link_group(other)} type veth peer name {other}x0"])
        assert Path(f"/sys/class/net/{name}/netdev_group").read_text().strip() == str(group)
        netns.delete_cluster_links(IP, name)
        assert [n for n in (name, *(f"{name}n{r}" for r in range(3))) if netns.link_exists(n)] == []
        assert netns.link_exists(f"{other}n0")

        assert netns.create_bridge(IP, name, base + "1", 24, subnet, 1500, str(tmp_path))
        netns.ip_batch(IP, [f"link add {name}n0 group {group} type veth peer name {name}x0"])
        netns.ip_batch(IP, [f"link add {foreign} group {group} type veth peer name {foreign}p"])
        netns.delete_cluster_links(IP, name, [f"{name}n0"])
        assert netns.link_exists(foreign), "a link that is not the cluster's was deleted"
        assert not netns.link_exists(name) and not netns.link_exists(f"{name}n0")
    finally:
        netns.delete_links(IP, [name, f"{name}n0", f"{name}n1", f"{name}n2", f"{other}n0", foreign])


def test_a_new_bridge_forwards_nothing(tmp_path: Path) -> None:
    """A bridge on the host (the emulator's; a local cluster's is in a namespace of its own,
    whose link to the host forwards nothing either: ``tests/test_node_network.py``) routes
    nothing that arrives on it, whatever the host's ``ip_forward`` says."""
    index = free_indexes(1)
    name = clusterns.bridge_name(index)
    subnet, base = clusterns.subnet_of(index)
    assert netns.create_bridge(IP, name, base + "1", 24, subnet, 1500, str(tmp_path))
    try:
        assert netns.link_alias(name) == str(tmp_path)
        assert Path(f"/proc/sys/net/ipv4/conf/{name}/forwarding").read_text().strip() == "0"
    finally:
        netns.delete_links(IP, [name])


def test_kill_and_wait_kills_and_waits_without_pidfds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before Linux 5.3 (or under a seccomp filter) pidfd_open fails with ENOSYS: every pid
    must still be killed and waited for, never taken for gone."""

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]
    try:
        assert netns.kill_and_wait([p.pid for p in procs], timeout=5) == []
        assert [p.poll() for p in procs] == [-9, -9, -9]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_run_killed_between_spawning_nodes_and_recording_them_is_reaped(tmp_path: Path) -> None:
    """SIGKILL right after the nodes are spawned and before their pids are in the record: the
    record already says where they are (cgroups, node directories), so the next run's
    reaper removes every process, link and cgroup."""
    home = tmp_path / "state"
    code = textwrap.dedent(
        """
        import os, signal
        from pytest_sky.backends import netns
        import pytest_sky
        real = netns.start_nodes
        def start_then_die(*a, **kw):
            real(*a, **kw)
            os.kill(os.getpid(), signal.SIGKILL)
        netns.start_nodes = start_then_die
        pytest_sky.launch(num_nodes=3, name="killed-mid")
        """
    )
    env = {**os.environ, "PYTEST_SKY_HOME": str(home), "CI": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    node_dirs = str(home / "clusters" / "killed-mid" / "nodes") + "/"
    assert StateStore(home).load("killed-mid") is not None
    journal = StateStore(home).journal("killed-mid").load()
    cgroups = [c for c in journal.get("cgroups", []) if c]
    try:
        assert len(netns.node_processes(node_dirs)) >= 3  # the nodes outlived their owner
        assert "killed-mid" in reap_orphans(StateStore(home))
        assert netns.node_processes(node_dirs) == []
        assert not any(str(home) in (netns.link_alias(n) or "") for n in os.listdir("/sys/class/net"))
        assert not any(os.path.exists(c) for c in cgroups)
    finally:  # never leak, even when the reaper under test failed
        netns.reap_nodes([], cgroups=cgroups, node_dirs=node_dirs)
        links = [n for n in os.listdir("/sys/class/net") if str(home) in (netns.link_alias(n) or "")]
        netns.delete_links(IP, links + list(journal.get("veths", [])))


def _local_lease(owner: str) -> int:
    """A local cluster's lease as its holder takes it, here in this process (root's): the
    subnet's lease socket (let go at once: the link holds the name), then the host's link
    into the cluster's namespace, named after the subnet."""
    uplink = clusterns.Uplink(owner, LocalBackend().mtu, netns.routed_networks(IP))
    index, lease = clusterns._lease(uplink.claim)
    lease.close()
    return index


def _bridge_lease(owner: str) -> int:
    """A bridge's lease on the host (the emulator's pods' network)."""
    return netns.lease_subnet(IP, LocalBackend().mtu, owner)


def _emulator_lease(owner: str) -> int:
    from kube_emulator.network import PodNetwork

    net = PodNetwork()
    net.check()
    net.lease(owner)
    return net.index


@pytest.mark.parametrize("lease", [_local_lease, _emulator_lease], ids=["local-cluster", "emulator-pods"])
def test_a_subnet_the_host_already_routes_is_never_chosen(
    lease: Callable[[str], int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A VPN or fake-IP DNS tool may route part of 198.18.0.0/15 (in a table of its own, as
    WireGuard does): a local cluster's lease and the emulator's pod network skip every /24 it
    overlaps."""
    start = free_indexes(4)
    start += start % 2  # a /23 boundary
    routed = f"198.18.{start}.0/23"
    subprocess.run([IP, "route", "add", "blackhole", routed, "table", "51820"], check=True)
    monkeypatch.setattr(clusterns.random, "randrange", lambda n: start)
    index = None
    try:
        index = lease(str(tmp_path))
        assert index not in (start, start + 1), f"leased {clusterns.subnet_of(index)[0]}, inside {routed}"
        assert index == start + 2
    finally:
        subprocess.run([IP, "route", "del", "blackhole", routed, "table", "51820"], check=False)
        if index is not None:
            netns.delete_links(IP, [clusterns.bridge_name(index)])


def test_a_holders_lease_taken_while_a_bridge_is_made_wins_and_the_bridge_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster's holder may lease a subnet at any moment, also between a bridge leaser's
    (the emulator's) look and its bridge: the bridge leaser looks for holders' leases once its
    bridge exists, and on finding one deletes the bridge and takes the next subnet.  The
    holder's lease is made to appear exactly then."""
    start = free_indexes(2)
    monkeypatch.setattr(clusterns.random, "randrange", lambda n: start)
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    looked: list[tuple[int, bool]] = []
    real_leased = clusterns.subnet_leased

    def leased(index: int) -> bool:
        looked.append((index, netns.link_exists(clusterns.bridge_name(index))))
        if index == start and not real_leased(index):
            holder.bind(clusterns.subnet_lease_name(index))  # the holder, just before the look
        return real_leased(index)

    monkeypatch.setattr(clusterns, "subnet_leased", leased)
    index = None
    try:
        index = _bridge_lease(str(tmp_path))
        assert looked[0] == (start, True), looked  # the look came after the bridge was made
        assert index == start + 1 and not netns.link_exists(clusterns.bridge_name(start))
    finally:
        holder.close()
        if index is not None:
            netns.delete_links(IP, [clusterns.bridge_name(index)])


def test_a_bridge_made_while_a_holder_leases_wins_and_the_lease_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The holder's side of the same race: it binds its lease, then looks for root's bridge
    on that subnet, and on finding one lets the lease go and takes the next."""
    start = free_indexes(2)
    monkeypatch.setattr(clusterns.random, "randrange", lambda n: start)
    looked: list[tuple[int, bool]] = []

    def root_bridge(index: int) -> bool:
        looked.append((index, clusterns.subnet_leased(index)))
        return index == start  # root's bridge, made just before the look

    monkeypatch.setattr(clusterns, "_root_bridge", root_bridge)
    index, lease = clusterns._lease()
    try:
        assert looked[0] == (start, True), looked  # the look came after the lease was bound
        assert index == start + 1 and not clusterns.subnet_leased(start)
    finally:
        lease.close()


def test_a_link_that_survives_its_deletion_is_an_error_not_a_silent_leak(tmp_path: Path) -> None:
    """``ip -force`` goes on past a failed line, so a deletion that did not happen would
    otherwise pass for one that did, and teardown would report success over a leak."""
    index = free_indexes(1)
    name = clusterns.bridge_name(index)
    subnet, base = clusterns.subnet_of(index)
    assert netns.create_bridge(IP, name, base + "1", 24, subnet, 1500, str(tmp_path))
    try:
        with pytest.raises(ProvisionError, match=rf"^could not delete link {name} \(ip gave no reason\): run"):
            netns.delete_links("/bin/true", [name])  # an ip that deletes nothing
        assert netns.link_exists(name)
    finally:
        netns.delete_links(IP, [name])
    assert not netns.link_exists(name)


def test_a_teardown_leaves_the_links_a_new_launch_made_under_the_freed_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The moment a cluster's group is deleted its bridge's name is free: another launch may
    make a bridge of that very name before the teardown's last pass, which must leave it."""
    from pytest_sky.backends.netns import links

    index = free_indexes(1)
    name = clusterns.bridge_name(index)
    subnet, base = clusterns.subnet_of(index)
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    for owner in (old, new):  # a bridge naming a directory that is gone is any reaper's to take
        os.mkdir(owner)
    assert netns.create_bridge(IP, name, base + "1", 24, subnet, 1500, old)
    real = links.ip_batch

    def and_then_a_new_launch(ip: str, commands, *, force: bool = False) -> str:
        out = real(ip, commands, force=force)
        if any(c.startswith("link del group") for c in commands):
            assert netns.create_bridge(IP, name, base + "1", 24, subnet, 1500, new)
        return out

    monkeypatch.setattr(links, "ip_batch", and_then_a_new_launch)
    try:
        netns.delete_cluster_links(IP, name)
        assert netns.link_alias(name) == new, "the teardown deleted a bridge another launch had just made"
    finally:
        monkeypatch.undo()
        netns.delete_links(IP, [name])
