"""The fault API on a real local cluster: kill, restart, partition, degrade and heal.

Each test checks what a user would notice when the fault is there (and that it is gone once
undone), so each fails if the fault were not applied; each teardown checks that a cluster
torn down after a fault leaves no link, process or cgroup behind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import pytest_sky
from pytest_sky import procs
from pytest_sky.backends import clusterns, netns
from pytest_sky.errors import NotSupportedError, TaskError
from pytest_sky.job import JobStatus
from pytest_sky.state import StateStore
from tests.contract import JOB_FAILS_WITHIN_S, within_promise
from tests.leftovers import live_nodes, our_links


def launch_three() -> pytest_sky.Cluster:
    c = pytest_sky.launch(num_nodes=3, name=f"fapi-{os.getpid() % 10000}-{time.monotonic_ns() % 1000}")
    c.run("true")  # the connection and the head's masters up: the fault is the only slow thing
    return c


def down_and_check_nothing_left(c: pytest_sky.Cluster) -> None:
    """Tear down after faults: no link, node process or cgroup of the cluster remains."""
    data = c.journal.load()  # the last nodes started (a restarted node's new pids)
    c.down()
    assert our_links(StateStore().cluster_dir(c.name)) == []
    assert live_nodes(data) == []
    assert [p for p in data["cgroups"] if p and os.path.exists(p)] == []


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A cluster of the test's own: for kills and restarts, which change the nodes themselves."""
    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path))
    c = launch_three()
    yield c
    down_and_check_nothing_left(c)


@pytest.fixture(scope="module")
def module_cluster(module_home):
    c = launch_three()
    yield c
    down_and_check_nothing_left(c)


@pytest.fixture
def network(module_cluster):
    """The module's cluster for a test of network faults, which a heal undoes: each test gets
    it healed, as a cluster shared by a scope is (the plugin's reset), and checked to be so."""
    yield module_cluster
    module_cluster.heal()
    assert not module_cluster.network_faults
    assert probes(module_cluster, [(2, 1, 22), (1, 2, 22)]) == ["open", "open"]


def probes(cluster, checks: list[tuple[int, int, int]], timeout: float = 2.0) -> list[str]:
    """What each ``(src, dst, port)`` sees, rank ``src`` opening TCP to rank ``dst``'s
    ``port``: "open", "refused" or "timeout".  All at once, in one run: a dropped packet's
    only signal is the timeout, so probes one after another would each wait it out."""
    lines = []
    for i, (src, dst, port) in enumerate(checks):
        ip = cluster.node_ips[dst]
        lines.append(
            f'[ "$SKYPILOT_NODE_RANK" != {src} ] || {{ timeout {timeout} bash -c "exec 3<>/dev/tcp/{ip}/{port}" '
            f"2>/dev/null; case $? in 0) r=open ;; 124) r=timeout ;; *) r=refused ;; esac; echo {i} $r; }} &"
        )
    res = cluster.run("\n".join([*lines, "wait"]), timeout=30)
    assert res.returncode == 0, res.output
    seen = dict(line.split() for r in res.ranks for line in r.stdout.splitlines())
    return [seen[str(i)] for i in range(len(checks))]


def probe(cluster, src: int, dst: int, port: int = 22, timeout: float = 2.0) -> str:
    """What rank ``src`` sees opening TCP to rank ``dst``: "open", "refused" or "timeout"."""
    return probes(cluster, [(src, dst, port)], timeout)[0]


def host_connect(cluster, ip: str, port: int, timeout: float) -> str:
    """The host's own view of a node's port: "open", "refused" or "silent" (no answer).  A
    rootless cluster's nodes are reached through its door: the host has no route to them,
    and a connection to their addresses would leave this machine."""
    door = cluster.info.head.route.door
    try:
        with clusterns.dial(door, ip, port, timeout) if door else socket.create_connection((ip, port), timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except OSError:  # timed out, or no host answers ARP for the address
        return "silent"


def _ssh_seconds(cluster, rank: int, remote: str, data: bytes | None) -> tuple[float, bytes]:
    start = time.monotonic()
    proc = subprocess.run(
        ["ssh", "-F", cluster.ssh_config, f"{cluster.name}-worker{rank}", remote],
        input=data,
        capture_output=True,
        timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    return elapsed, proc.stdout


def ssh_throughput(cluster, rank: int, mib: int, upload: bool) -> float:
    """MB/s of ``mib`` MiB over SSH between the host and node ``rank`` (to it, or from it),
    less what the same ssh without the bytes costs, measured just before (its start and
    handshake, which a busy machine slows by seconds, are no part of the link's rate)."""
    floor, _ = _ssh_seconds(cluster, rank, "true", None)
    size = mib * 2**20
    remote = "cat >/dev/null" if upload else f"head -c {size} /dev/zero"
    elapsed, out = _ssh_seconds(cluster, rank, remote, b"\0" * size if upload else None)
    assert upload or len(out) == size
    return size / max(elapsed - floor, 1e-3) / 1e6


# ------------------------------------------------------------------------------ kill/restart


def test_kill_node_fails_the_job_naming_the_rank_and_silences_the_node(cluster):
    job = cluster.submit("echo up; exec sleep 91")
    # Mid-job means every rank runs: RUNNING alone is the head's word, said before it has
    # reached the workers (a node killed then is found by a connection that times out).
    deadline = time.monotonic() + 10
    while job.logs().count(") up\n") < cluster.num_nodes:
        assert time.monotonic() < deadline, f"not every rank started: {job.logs()}"
        time.sleep(0.05)
    node = cluster.journal.load()["nodes"][1]
    start = time.monotonic()
    cluster.kill_node(1)
    assert job.wait(15) == JobStatus.FAILED
    took = time.monotonic() - start
    assert took < JOB_FAILS_WITHIN_S, within_promise(took)
    assert "rank 1" in job.error, job.error
    # Every process of the node is gone at once, sshd included: nothing answers at its address.
    assert not procs.is_alive(node["pid"], node.get("start_time"))
    assert not procs.is_alive(node["init_pid"])
    assert host_connect(cluster, cluster.node_ips[1], 22, timeout=1.0) == "silent"
    assert host_connect(cluster, cluster.node_ips[2], 22, timeout=5.0) == "open"  # the others are untouched


def test_restart_node_keeps_name_ip_host_key_and_disk(cluster):
    marker = f"m{os.getpid()}"
    res = cluster.run(
        f'[ "$SKYPILOT_NODE_RANK" = 1 ] || exit 0; echo {marker} > ~/home-file; echo {marker} > /var/tmp/root-file'
    )
    assert res.returncode == 0, res.output
    cluster.kill_node(1)
    cluster.restart_node(1)
    # From the head, with host keys checked strictly: the same key answers at the same name.
    hop = cluster.run(
        '[ "$SKYPILOT_NODE_RANK" = 0 ] || exit 0; '
        f"ssh -o StrictHostKeyChecking=yes -o BatchMode=yes {cluster.name}-worker1 "
        "'hostname; hostname -I; cat ~/home-file /var/tmp/root-file'"
    )
    assert hop.returncode == 0, hop.output
    lines = hop.ranks[0].stdout.split()
    assert lines == [f"{cluster.name}-worker1", cluster.node_ips[1], marker, marker]
    assert cluster.run("hostname").returncode == 0  # the agent reaches every rank again


def test_restart_node_with_wipe_gives_a_fresh_disk(cluster):
    res = cluster.run('[ "$SKYPILOT_NODE_RANK" = 2 ] || exit 0; echo x > ~/home-file; echo x > /var/tmp/root-file')
    assert res.returncode == 0, res.output
    cluster.restart_node(2, wipe=True)  # a running node: rebooted
    after = cluster.run("ls ~/home-file /var/tmp/root-file 2>/dev/null | wc -l")
    assert after.returncode == 0, after.output  # the agent and keys came back with provisioning
    assert [r.stdout.strip() for r in after.ranks] == ["0", "0", "0"]


def test_restart_head_reconnects_the_client(cluster):
    cluster.kill_node(0)
    cluster.restart_node(0)
    res = cluster.run("hostname")
    assert res.returncode == 0, res.output
    assert [r.stdout.strip() for r in res.ranks] == [f"{cluster.name}-{n}" for n in ("head", "worker1", "worker2")]


# ------------------------------------------------------------------------------ network


def test_partition_drops_between_groups_and_heal_restores(network):
    cluster = network
    assert probes(cluster, [(2, 1, 22), (2, 1, 9)]) == ["open", "refused"]  # a closed port answers with a reset
    cluster.partition([0, 1], [2])
    seen = probes(cluster, [(2, 1, 22), (2, 1, 9), (1, 2, 22), (0, 2, 9), (0, 1, 22), (0, 2, 22)])
    # Dropped, not rejected: nothing comes back; the head too, beyond its SSH.  Within a group
    # nothing changed, nor on the harness's control path (head to worker SSH).
    assert seen == ["timeout", "timeout", "timeout", "timeout", "open", "open"]
    res = cluster.run("hostname")  # so a job still runs on every rank and is collected
    assert res.returncode == 0 and len(res.ranks) == 3, res.output
    cluster.heal()
    assert probes(cluster, [(2, 1, 22), (0, 2, 9)]) == ["open", "refused"]
    assert not cluster.network_faults


def test_partition_survives_a_restart_of_a_partitioned_node(cluster):
    cluster.partition([1], [2])
    cluster.restart_node(2)
    assert probe(cluster, 1, 2) == "timeout"
    cluster.heal()
    assert probe(cluster, 1, 2) == "open"


def test_degrade_loss_drops_packets_both_ways(network):
    cluster = network
    ip = cluster.node_ips[1]
    tries = 40

    def unanswered() -> int:  # a SYN to a closed port, or its reset, lost: no answer in time
        with ThreadPoolExecutor(tries) as pool:  # at once: each lost one waits out its timeout
            seen = pool.map(lambda _: host_connect(cluster, ip, 9, timeout=0.25), range(tries))
            return sum(answer != "refused" for answer in seen)

    assert unanswered() == 0
    cluster.degrade(1, loss_pct=40)
    lost = unanswered()  # 1 - 0.6 * 0.6 = 64 % expected
    assert 0.3 * tries <= lost <= 0.95 * tries, lost
    cluster.heal()
    assert unanswered() == 0


def test_degrade_rate_caps_bandwidth_both_ways_and_heal_lifts_it(network):
    cluster = network
    # 0.5 MB/s: a busy machine has slowed the uncapped link (ssh's own encryption, on shared
    # cores) to a few MB/s, so the cap is set far below any rate it reaches uncapped; the
    # ratios compare with this test's own uncapped transfers, and the cap's bound holds however
    # slow the machine (load only lowers a rate).
    cap_mbit = 4
    before = ssh_throughput(cluster, 1, 20, upload=False)
    cluster.degrade(1, rate_mbit=cap_mbit)
    down = ssh_throughput(cluster, 1, 2, upload=False)
    up = ssh_throughput(cluster, 1, 2, upload=True)
    assert down < cap_mbit / 8 * 1.3, down
    assert up < cap_mbit / 8 * 1.3, up
    assert before > 3 * down, (before, down)
    assert cluster.network_faults.degraded[1].rate_mbit == cap_mbit
    cluster.heal()
    assert ssh_throughput(cluster, 1, 20, upload=False) > 3 * down


def connect_ms(cluster, ip: str, tries: int = 7) -> list[float]:
    """Round trips to a closed port (SYN out, reset back), in ms, sorted."""
    out = []
    for _ in range(tries):
        start = time.monotonic()
        assert host_connect(cluster, ip, 9, timeout=3.0) == "refused"
        out.append((time.monotonic() - start) * 1000)
    return sorted(out)


def test_degrade_delay_and_jitter_both_ways(network):
    cluster = network
    ip = cluster.node_ips[1]
    assert cluster.link_shaping == ("netem" if netns.netem_available() else "tbf+iptables+nfqueue")
    floor = connect_ms(cluster, ip)  # the link's own round trip, as this machine's load has it now
    cluster.degrade(1, delay_ms=60)
    held = connect_ms(cluster, ip)
    assert held[0] >= 115, held  # 60 ms each way on every round trip (a lower bound: load only adds)
    assert held[3] - floor[3] < 2 * 120, (floor, held)  # and once: not twice the asked delay
    cluster.degrade(1, delay_ms=60, jitter_ms=50)
    jittered = connect_ms(cluster, ip, tries=12)
    assert jittered[-1] - jittered[0] > 25, jittered
    assert probe(cluster, 0, 1) == "open"  # the delayed link still carries the control path
    cluster.heal()
    healed = connect_ms(cluster, ip)
    assert healed[3] < held[0] - 60, (healed, held)  # the delay went: well under the least delayed
    if not netns.netem_available():  # the delayer went with the delay
        assert cluster.journal.load().get("delayers") == {}


def test_bad_fault_arguments_are_one_line_errors(network):
    cluster = network
    with pytest.raises(TaskError, match="no rank 3"):
        cluster.kill_node(3)
    with pytest.raises(TaskError, match="both groups"):
        cluster.partition([0, 1], [1, 2])
    with pytest.raises(TaskError, match="loss_pct"):
        cluster.degrade(1, loss_pct=150)


# ------------------------------------------------------------------------------ the CLI


def test_cli_faults_act_on_a_cluster_of_another_process(cluster, tmp_path):
    """`pytest-sky fault` runs in a process of its own: the journal alone tells it the nodes."""

    def sky(*args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTEST_SKY_HOME": str(tmp_path), "CI": "1"}
        argv = [sys.executable, "-m", "pytest_sky.cli", "fault", cluster.name, *args]
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        return proc

    assert "partitions: [0, 1] | [2]" in sky("partition", "head,worker1", "2").stdout
    assert probe(cluster, 2, 1) == "timeout"
    assert "rank 1: rate_mbit=50" in sky("degrade", "1", "--rate-mbit", "50").stdout
    assert "partitions: none" in sky("heal").stdout
    assert probe(cluster, 2, 1) == "open"
    sky("kill", "worker1")
    assert host_connect(cluster, cluster.node_ips[1], 22, timeout=1.0) == "silent"
    sky("restart", "1")
    assert host_connect(cluster, cluster.node_ips[1], 22, timeout=5.0) == "open"
    res = cluster.run("hostname")
    assert res.returncode == 0, res.output
    bad = subprocess.run(
        [sys.executable, "-m", "pytest_sky.cli", "fault", cluster.name, "kill", "worker7"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTEST_SKY_HOME": str(tmp_path)},
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2 and "no node 'worker7'" in bad.stderr


# ------------------------------------------------------------------------------ Kubernetes


def test_kubernetes_kill_node_deletes_the_pod_and_the_rest_says_what_it_needs(tmp_path, monkeypatch, emu):
    pytest.importorskip("kubernetes", reason="pip install kubernetes")
    pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")
    from pytest_sky.backends import kube_manifests as manifests
    from pytest_sky.backends.kubernetes import KubernetesBackend
    from tests.kube_helpers import alive, pod_processes

    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path))
    opts = {"kubeconfig": str(emu.kubeconfig_path)}
    c = pytest_sky.launch(num_nodes=2, name=f"fk8s-{os.getpid() % 10000}", backend="kubernetes", backend_options=opts)
    # As a real kubelet, the emulator's acts on a deletion seconds later: a force-deleted
    # pod's container would still run when its object is gone.
    emu.set_faults(kubelet_delay=3)
    try:
        job = c.submit("sleep 92")
        deadline = time.monotonic() + 30
        while job.status != JobStatus.RUNNING:
            assert time.monotonic() < deadline, "job did not start"
            time.sleep(0.05)
        while not any(_cmdline(pid) == "sleep 92" for pid, _ in pod_processes(emu, f"{c.name}-worker1")):
            assert time.monotonic() < deadline, "rank 1 did not start"
            time.sleep(0.05)
        old = pod_processes(emu, f"{c.name}-worker1")  # its keeper, sshd, the rank and its sleep
        start = time.time()
        c.kill_node(1)
        assert alive(old) == []  # nothing of the old pod runs once kill_node returns
        assert job.wait(15) == JobStatus.FAILED
        # The promise is the job's: it fails within 5 s of the kill, by the head's clock (one
        # clock here), while kill_node itself waits out the kubelet's 3 s before it returns.
        took = job.info()["ended"] - start
        assert took < JOB_FAILS_WITHIN_S, within_promise(took)
        assert "rank 1" in job.error, job.error
        api = KubernetesBackend(**opts).api()
        pods = api.list_namespaced_pod("default", label_selector=manifests.selector(c.name)).items
        assert [p.metadata.name for p in pods] == [manifests.pod_name(c.name, 0)]
        with pytest.raises(NotSupportedError, match="NetworkPolicy"):
            c.partition([0], [1])
        with pytest.raises(NotSupportedError, match="NetworkPolicy"):
            c.degrade(1, rate_mbit=10)
        c.heal()  # nothing to undo: not an error
    finally:
        emu.set_faults(kubelet_delay=None)
        c.down()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _keyscan(cluster, ip: str) -> str:
    """The ed25519 host key that answers at ``ip``, as the head sees it."""
    res = cluster.run(f'[ "$SKYPILOT_NODE_RANK" = 0 ] || exit 0; ssh-keyscan -t ed25519 -T 10 {ip} 2>/dev/null')
    assert res.returncode == 0, res.output
    fields = res.ranks[0].stdout.split()
    assert len(fields) == 3, res.output
    return " ".join(fields[1:])


def test_kubernetes_restart_node_recreates_the_pod_and_every_node_learns_its_new_ip(tmp_path, monkeypatch, emu):
    pytest.importorskip("kubernetes", reason="pip install kubernetes")
    pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")
    from pytest_sky.backends import kube_manifests as manifests
    from pytest_sky.backends.kubernetes import KubernetesBackend

    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path))
    opts = {"kubeconfig": str(emu.kubeconfig_path)}
    from tests.kube_helpers import alive, pod_processes

    api = KubernetesBackend(**opts).api()
    c = pytest_sky.launch(num_nodes=3, name=f"rk8s-{os.getpid() % 10000}", backend="kubernetes", backend_options=opts)
    sel = manifests.selector(c.name)
    emu.set_faults(kubelet_delay=3)  # the kubelet stops a deleted pod's container 3 s later
    try:
        old_ip, worker1 = c.node_ips[1], f"{c.name}-worker1"
        old_key = _keyscan(c, old_ip)
        assert c.run('[ "$SKYPILOT_NODE_RANK" = 1 ] || exit 0; echo x > ~/home-file').returncode == 0
        old_uid = api.read_namespaced_pod(worker1, "default").metadata.uid
        old = pod_processes(emu, worker1)
        c.kill_node(1)
        assert alive(old) == []
        c.restart_node(1)
        new = api.read_namespaced_pod(worker1, "default")
        assert new.metadata.uid != old_uid  # a new pod, as a real restart of one is
        assert manifests.labels(c.name, 1).items() <= new.metadata.labels.items()
        assert [v.secret.secret_name for v in new.spec.volumes if v.secret] == [manifests.secret_name(c.name)]
        new_ip = new.status.pod_ip
        assert new_ip != old_ip  # the emulator hands a new address, as a real CNI does
        # The handle, the saved record (another process, the CLI) and every run name it.
        assert c.node_ips[1] == new_ip
        assert pytest_sky.get_cluster(c.name).node_ips == c.node_ips
        res = c.run(
            'echo "ips=$(echo "$SKYPILOT_NODE_IPS" | paste -sd, -)"; echo "own=$(hostname -I)"; '
            "[ -e ~/home-file ] && echo home=kept || echo home=gone"
        )
        assert res.returncode == 0, res.output
        seen = [dict(line.split("=", 1) for line in r.stdout.splitlines()) for r in res.ranks]
        assert [s["ips"] for s in seen] == [",".join(c.node_ips)] * 3
        assert new_ip in seen[1]["own"].split()
        assert seen[1]["home"] == "gone"  # a recreated pod's filesystem is the image's again
        # Same host key at the new address; strict checking from the head and from the
        # other worker (their ssh files were rewritten) and from the client passes.
        assert _keyscan(c, new_ip) == old_key
        strict = "ssh -o StrictHostKeyChecking=yes -o BatchMode=yes"
        hop = c.run(f'[ "$SKYPILOT_NODE_RANK" = 1 ] && exit 0; {strict} {worker1} hostname -I')
        assert hop.returncode == 0, hop.output
        assert [hop.ranks[r].stdout.split() for r in (0, 2)] == [[new_ip], [new_ip]]
        client = subprocess.run(
            ["ssh", "-F", c.ssh_config, worker1, "hostname"], capture_output=True, text=True, timeout=60
        )
        assert client.returncode == 0 and client.stdout.strip() == worker1, client.stderr
        # The head too: the client's port-forward and shared connection follow its new pod,
        # and the workers reach it at its new address, strictly checked.  A running node is
        # killed by restart_node itself, and its successor never runs beside it.
        old_head, old = c.node_ips[0], pod_processes(emu, f"{c.name}-head")
        c.restart_node(0)
        assert alive(old) == []
        assert c.node_ips[0] != old_head
        back = c.run(f'echo "ips=$(echo "$SKYPILOT_NODE_IPS" | paste -sd, -)"; {strict} {c.name}-head hostname -I')
        assert back.returncode == 0, back.output
        assert [r.stdout.split() for r in back.ranks] == [[f"ips={','.join(c.node_ips)}", c.node_ips[0]]] * 3
    finally:
        emu.set_faults(kubelet_delay=None)
        c.down()
    assert api.list_namespaced_pod("default", label_selector=sel).items == []
    assert api.list_namespaced_secret("default", label_selector=sel).items == []
    assert [s.metadata.name for s in api.list_namespaced_service("default").items if s.metadata.name == c.name] == []


# ------------------------------------------------------------------------------ pure parts


def test_fault_state_round_trips_through_the_journal_form():
    from pytest_sky.backends.base import LinkDegradation, NetworkFaults

    faults = NetworkFaults(
        partitions=((frozenset({0, 1}), frozenset({2})),), degraded={1: LinkDegradation(5, 1, 2.5, 100)}
    )
    assert NetworkFaults.from_json(faults.to_json()) == faults
    assert faults.cut_off(2) == {0, 1} and faults.cut_off(0) == {2} and faults.cut_off(3) == set()
    assert not NetworkFaults.from_json(None)


def test_partition_rules_keep_only_head_worker_ssh():
    head, w1 = "198.18.5.2", "198.18.5.3"
    on_head = netns.iptables_rules(netns.LinkFaults(head_ip=head, is_head=True, blocked=(w1,)), netem=False)
    assert f"-A PSKY-OUT -d {w1} -p tcp --dport 22 -j RETURN" in on_head
    assert f"-A PSKY-OUT -d {w1} -j DROP" in on_head and "REJECT" not in on_head
    on_worker = netns.iptables_rules(
        netns.LinkFaults(head_ip=head, is_head=False, blocked=("198.18.5.4",)), netem=False
    )
    assert "RETURN" not in on_worker  # worker-to-worker SSH is cut like everything else
    lossy = netns.iptables_rules(netns.LinkFaults(head_ip=head, is_head=False, loss_pct=25), netem=False)
    assert lossy.count("--probability 0.250000 -j DROP") == 2  # each direction
    assert "--probability" not in netns.iptables_rules(
        netns.LinkFaults(head_ip=head, is_head=False, loss_pct=25), netem=True
    )


def test_delayer_reads_packet_ids_from_a_netlink_batch():
    import struct

    from pytest_sky.backends import nfdelay

    def packet(pid: int) -> bytes:
        hdr = nfdelay._attr(nfdelay.NFQA_PACKET_HDR, struct.pack("!IHB", pid, 0x0800, 3))
        other = nfdelay._attr(9, b"\1\2\3")  # an attribute it must skip
        body = struct.pack("=BBH", 2, 0, 0) + other + hdr
        return struct.pack("=IHHII", 16 + len(body), (3 << 8) | nfdelay.NFQNL_MSG_PACKET, 0, 0, 0) + body

    assert nfdelay.packet_ids(packet(7) + packet(4242)) == [7, 4242]
