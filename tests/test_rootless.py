"""Rootless local clusters (``netns.userns``, ``backends/clusterns.py``): an ordinary user
gets the same nodes as root, in a user namespace of their own, and a host that refuses one
gets one line that says which setting and what to do.

The end-to-end tests really run as an unprivileged user (``nobody``, through
``tests/unprivileged.py``), so they run on every root CI machine; ``.ci/run`` also runs the
whole multinode smoke suite as an ordinary user of its own."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_sky.backends import clusterns, netns, privileges
from pytest_sky.backends.netns import userns
from pytest_sky.ssh import config as ssh_config
from tests.leftovers import processes_mentioning
from tests.unprivileged import AS_NOBODY, run_python, world_dir


@pytest.mark.parametrize(("name", "refuses", "allows"), userns.REFUSING_SETTINGS)
def test_a_host_that_refuses_user_namespaces_gets_one_line(tmp_path: Path, name: str, refuses: str, allows: str):
    path = tmp_path / name.replace(".", "/")
    path.parent.mkdir(parents=True)
    path.write_text(refuses + "\n")
    problem = netns.userns_problem(proc_sys=tmp_path)
    assert problem is not None and "\n" not in problem
    assert f"({name} = {refuses})" in problem
    assert f"`sysctl -w {name}={allows}`" in problem and "run pytest as root" in problem
    path.write_text(allows + "\n")
    assert netns.userns_problem(proc_sys=tmp_path) is None  # and this host allows them


def test_the_node_program_leaves_to_the_node_the_mounts_the_host_leaves_to_it():
    from pytest_sky import naming
    from pytest_sky.backends import nodeinit

    assert {"/" + d for d in nodeinit.NODE_OWN_DIRS} == set(naming.NODE_OWN_MOUNTS)


def test_a_rootless_node_names_only_the_group_its_namespace_maps():
    confined = privileges.rootless(privileges.for_node())
    assert (privileges.PING_GROUP_RANGE, "0 0") in confined.sysctls
    assert confined.capabilities == privileges.for_node().capabilities


def test_openssh_gets_the_socket_from_the_proxy_command():
    cfg = ssh_config.render(
        [ssh_config.HostEntry(alias="c", hostname="198.18.0.2", user="ada", proxy_command="dial", proxy_fdpass=True)],
        identity_file="k",
        known_hosts="kh",
    )
    block = cfg.split("\n\n")[1]
    assert "  ProxyCommand dial\n  ProxyUseFdpass yes" in block and "  User ada" in block


def _hold(tmp_path: Path, door: str) -> subprocess.Popen[bytes]:
    marker = f"{netns.HOLDER_MARKER}{tmp_path}"
    restore = netns.holder_tools()["iptables-restore"]
    argv = [sys.executable, "-S", "-I", str(userns.CLUSTERNS), "hold", marker, door, "1500", "rootless", restore]
    return subprocess.Popen(argv, stdout=subprocess.PIPE)


def test_holders_lease_distinct_subnets_and_dial_inside_their_own_network(tmp_path: Path):
    doors = [f"@psky-test-door-{os.getpid()}-{tag}" for tag in ("a", "b")]
    holders = [_hold(tmp_path, door) for door in doors]
    try:
        said = [h.stdout.readline().split() for h in holders]  # type: ignore[union-attr]
        assert [w[0] for w in said] == [b"LEASED", b"LEASED"]  # the nodes may start
        assert [h.stdout.readline() for h in holders] == [b"READY\n"] * 2  # type: ignore[union-attr]
        indexes = [int(w[1]) for w in said]
        assert indexes[0] != indexes[1]
        # Its own network: the bridge's address answers there (nothing listens: refused),
        # and the host has no such address.
        base = f"198.{18 + indexes[0] // 256}.{indexes[0] % 256}."
        with pytest.raises(ConnectionRefusedError):
            clusterns.dial(doors[0], base + "1", 9)
        assert not any(base in line for line in Path("/proc/net/fib_trie").read_text().splitlines())
        # The door answers its own user only: another user's process is turned away.
        intruder = f"from pytest_sky.backends import clusterns\ntry:\n    clusterns.dial({doors[1]!r}, '{base}1', 22)\n"
        intruder += "except OSError as e:\n    print(e.errno)\n"
        assert run_python(AS_NOBODY, intruder).stdout.strip() == str(errno.EACCES)
        # A lease is held as long as its holder lives, and free the moment it dies.
        probe = socket.socket(socket.AF_UNIX)
        with pytest.raises(OSError) as taken:
            probe.bind(clusterns.subnet_lease_name(indexes[0]))
        assert taken.value.errno == errno.EADDRINUSE
        holders[0].kill()
        holders[0].wait()
        probe.bind(clusterns.subnet_lease_name(indexes[0]))
        probe.close()
        with pytest.raises(OSError):
            clusterns.dial(doors[0], base + "1", 9)
    finally:
        for h in holders:
            h.kill()
            h.wait()
            h.stdout.close()  # type: ignore[union-attr]


#: Run as ``nobody``: a rootless cluster, used as a test uses one, then torn down; one JSON line.
ROOTLESS_LIFE = r"""
import json, subprocess
import pytest_sky
from pytest_sky.backends import netns
out = {"mode": netns.local_mode().value}
c = pytest_sky.launch(num_nodes=3, name="rootless")
try:
    next_ip = 'echo "$SKYPILOT_NODE_IPS" | sed -n "$(( (SKYPILOT_NODE_RANK + 1) % 3 + 1 ))p"'
    r = c.run(f"echo mine > /tmp/mine-$SKYPILOT_NODE_RANK; ls /tmp/mine*; hostname; id -un; ssh $({next_ip}) hostname")
    out["ranks"] = [x.stdout.split() for x in r.ranks]
    ssh = subprocess.run(["ssh", "-F", c.ssh_config, c.name, "hostname"], capture_output=True, text=True, timeout=60)
    out["openssh"] = ssh.stdout.strip() or ssh.stderr.strip()
    reach = "timeout 3 bash -c 'echo > /dev/tcp/%s/22' && echo reached || echo cut" % c.node_ips[2]
    out["before"] = c.run(reach).ranks[1].stdout.strip()
    c.partition([0, 1], [2])
    out["partitioned"] = c.run(reach).ranks[1].stdout.strip()
    c.heal()
    c.kill_node(2)
    c.restart_node(2, wipe=True)
    out["restarted"] = c.run("ls /tmp/mine* 2>&1 || true").ranks[2].stdout.strip()
    out["user"] = c.info.head.route.user
    out["held"] = netns.holder_processes(str(c.journal.cluster_dir))
finally:
    c.down()
out["holders"] = netns.holder_processes(str(c.journal.cluster_dir))  # this cluster's: others' may run
print(json.dumps(out))
"""


def test_an_ordinary_user_gets_a_whole_cluster_and_leaves_nothing():
    home = world_dir("psky-rootless-")  # reachable by an unprivileged user
    try:
        proc = run_python(AS_NOBODY, ROOTLESS_LIFE, env={"PYTEST_SKY_HOME": str(home)}, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["mode"] == "rootless" and out["user"] == "nobody"
        hostnames = [f"rootless-{n}" for n in ("head", "worker1", "worker2")]
        for rank, words in enumerate(out["ranks"]):
            # Its own /tmp (its file only), its own name, the user, and the next node by ssh.
            assert words == [f"/tmp/mine-{rank}", hostnames[rank], "nobody", hostnames[(rank + 1) % 3]], out
        assert out["openssh"] == "rootless-head"  # OpenSSH, through the holder's door
        assert (out["before"], out["partitioned"]) == ("reached", "cut")
        assert "No such file or directory" in out["restarted"]  # wiped: a fresh disk
        # Its holder and the holder's dialer, found by its directory, then gone.
        assert len(out["held"]) == 2 and out["holders"] == []
        assert not processes_mentioning(str(home))
        # Every file of the cluster is gone, its layers' work directories (mode 000) included.
        assert [p.name for p in home.glob("clusters/*")] + [p.name for p in home.glob("trash/*")] == []
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_report_header_says_which_mode_runs():
    from pytest_sky.settings import resolve

    assert "backend=local (rootless) (from default)" in resolve().describe("rootless")
    assert "backend=local (from default)" in resolve().describe()


ASKS_FOR_CAPABILITIES = r"""
import pytest_sky
try:
    pytest_sky.launch(num_nodes=2, name="capable", capabilities=("NET_ADMIN",))
except pytest_sky.SkyError as e:
    print(e)
"""


def test_capabilities_beyond_a_pods_are_refused_in_one_line():
    home = world_dir("psky-rootless-")
    try:
        proc = run_python(AS_NOBODY, ASKS_FOR_CAPABILITIES, env={"PYTEST_SKY_HOME": str(home)})
        assert [p.name for p in home.glob("clusters/*")] == []
    finally:
        shutil.rmtree(home, ignore_errors=True)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    assert "NET_ADMIN" in lines[0] and "run pytest as root" in lines[0]
