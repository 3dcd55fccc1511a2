"""The local backend and the runner against real namespace nodes.

One shared 3-node cluster serves the read-only checks; tests that break or remove things
launch their own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky import Task, procs
from pytest_sky.backends import netns
from pytest_sky.backends.local import LocalBackend
from pytest_sky.errors import ProvisionError, RunTimeoutError, TaskError
from pytest_sky.state import StateStore
from tests.leftovers import live_nodes, our_links
from tests.unprivileged import AS_NOBODY, AS_ROOT_WITHOUT_CAPS, run_python, world_dir


@pytest.fixture(scope="module")
def sky_home(module_home: Path) -> Path:
    return module_home


@pytest.fixture(scope="module")
def cluster3(sky_home: Path):
    cluster = pytest_sky.launch(num_nodes=3, name=f"lb3-{os.getpid() % 10000}")
    yield cluster
    cluster.down()


def by_rank(result: pytest_sky.RunResult) -> list[str]:
    return [r.stdout.strip() for r in result.ranks]


def gone(record_data: dict, name: str) -> list[str]:
    """What of cluster ``name`` is still here (nothing, once it is torn down): its link into
    its namespace, its nodes, its namespace's holder (and the holder's dialer)."""
    cluster_dir = StateStore().cluster_dir(name)
    holders = [f"holder {pid}" for pid in netns.holder_processes(str(cluster_dir))]
    return [*our_links(cluster_dir), *map(str, live_nodes(record_data)), *holders]


def test_hostnames_and_hosts_file(cluster3):
    name = cluster3.name
    res = cluster3.run(
        f"hostname; getent ahostsv4 {name}-worker2 | awk 'NR==1{{print $1}}'; grep -c '::ffff:' /etc/hosts"
    )
    assert res.returncode == 0, res.output
    for rank, out in enumerate(by_rank(res)):
        host, worker2_ip, mapped = out.split()
        assert host == (f"{name}-head" if rank == 0 else f"{name}-worker{rank}")
        assert worker2_ip == cluster3.node_ips[2]
        assert mapped == "3"  # every node also listed in ::ffff: form (torch c10d)


def test_nodes_are_isolated_pid_namespaces(cluster3):
    """A task's pkill cannot reach the host (nor, by the same token, another node)."""
    marker = f"psky-marker-{os.getpid()}-{time.monotonic_ns()}"
    victim = subprocess.Popen(["bash", "-c", f"exec -a {marker} sleep 60"])
    try:
        pattern = f"[{marker[0]}]{marker[1:]}"  # a pattern that does not match its own shell
        res = cluster3.run(f"cat /proc/1/comm; pkill -f '{pattern}'; echo pkill=$?")
        assert res.returncode == 0, res.output
        for out in by_rank(res):
            assert out.split() == ["sshd", "pkill=1"]  # pid 1 is sshd; nothing matched
        assert victim.poll() is None, "a node's pkill killed a host process"
    finally:
        victim.kill()
        victim.wait()


def test_the_way_out_of_the_cluster_is_its_gateway(cluster3):
    """A node's routes: its cluster's /24 on its link, and everything else through the
    cluster's gateway at .1, as a pod's through its node (what the gateway lets through:
    ``tests/test_node_network.py``).  Route lookups only: nothing is sent anywhere."""
    res = cluster3.run("ip -4 route show; ip route get 198.19.255.254 2>&1 | head -n1")
    subnet = cluster3.node_ips[0].rsplit(".", 1)[0]
    for out in by_rank(res):
        default, own, elsewhere = out.splitlines()
        assert default.startswith(f"default via {subnet}.1 dev eth0"), out
        assert own.startswith(f"{subnet}.0/24 dev eth0") and "quickack 1" in own, out
        assert f"via {subnet}.1 dev eth0" in elsewhere, out


def test_mtu_is_high_by_default(cluster3):
    assert by_rank(cluster3.run("cat /sys/class/net/eth0/mtu")) == ["65535"] * 3


def test_private_home_run_and_keys(cluster3):
    res = cluster3.run(
        'echo "$HOME"; stat -c %a ~/.ssh/id_ed25519; touch /run/only-here-$SKYPILOT_NODE_RANK;'
        "ls /run | grep -c only-here; touch ~/mine-$SKYPILOT_NODE_RANK; ls ~ | grep -c mine-"
    )
    for out in by_rank(res):
        home, mode, count, mine = out.split()
        assert home == netns.NODE_HOME  # the same path on every node, as on a cluster
        assert mode == "600"
        assert count == mine == "1"  # each node sees only its own /run and its own home


def test_python_on_nodes_is_the_test_interpreter(cluster3):
    res = cluster3.run("command -v python; python -c 'import sys; print(sys.prefix)'")
    for out in by_rank(res):
        path, prefix = out.split()
        assert Path(path).parent == Path(sys.executable).parent
        assert prefix == sys.prefix


def test_env_values_arrive_literally(cluster3, tmp_path: Path):
    canary = tmp_path / "injected"
    value = f"$(touch {canary}); '; echo pwned; \"`touch {canary}`"
    res = cluster3.run('printf "%s\\n" "$X"', env={"X": value})
    assert by_rank(res) == [value] * 3
    # An injection would have run on the nodes, whose files are their own: look there.
    assert by_rank(cluster3.run(f"ls {canary} 2>/dev/null | wc -l")) == ["0"] * 3


def test_job_ids_increase_and_task_id_names_them(cluster3):
    first = cluster3.run("true")
    second = cluster3.run("true")
    assert second.job_id == first.job_id + 1
    assert second.task_id.endswith(f"_{cluster3.name}_{second.job_id}")


def test_setup_runs_first_and_its_failure_stops_the_run(cluster3):
    ok = cluster3.run(
        Task(setup="echo setup-$SKYPILOT_SETUP_NODE_RANK", run="echo run-$SKYPILOT_NODE_RANK", num_nodes=3)
    )
    assert by_rank(ok) == [f"setup-{r}\nrun-{r}" for r in range(3)]
    bad = cluster3.run(Task(setup='[ "$SKYPILOT_SETUP_NODE_RANK" = 2 ] && exit 4; true', run="echo never", num_nodes=3))
    assert bad.returncode == 4
    assert "setup failed on rank 2" in bad.error and "exit code 4" in bad.error
    assert "never" not in bad.output


def test_timeout_stops_every_rank(cluster3):
    marker = f"{time.monotonic_ns()}"
    start = time.monotonic()
    with pytest.raises(RunTimeoutError, match="within 1 s"):
        cluster3.run(f"sleep 3{marker[-4:]}.5 ; echo late", timeout=1)
    pattern = f"[s]leep 3{marker[-4:]}.5"
    assert time.monotonic() - start < 5
    # The agent noticed the closed channel and stopped the ranks' process trees.
    deadline = time.monotonic() + 10
    while True:
        left = cluster3.run(f"pgrep -f '{pattern}' || true")
        if all(not r.stdout.strip() for r in left.ranks) or time.monotonic() > deadline:
            break
    assert all(not r.stdout.strip() for r in left.ranks), left.output


def test_single_node_prefix(sky_home: Path):
    with pytest_sky.launch(num_nodes=1, name=f"lb1-{os.getpid() % 10000}") as c:
        res = c.run(Task(name="solo", run="echo one"))
        assert res.output.startswith("(solo, pid=") and res.output.endswith(") one\n")


def test_teardown_removes_links_processes_and_record(sky_home: Path):
    c = pytest_sky.launch(num_nodes=2, name=f"lbdown-{os.getpid() % 10000}")
    data = c.journal.load()
    holder = data["holder"]["pid"]
    left = gone(data, c.name)
    assert left[:3] == [data["bridge"], *(str(n["pid"]) for n in data["nodes"])]
    assert f"holder {holder}" in left and len(left) == 5, left  # the holder and its dialer
    c.down()
    assert gone(data, c.name) == []
    assert StateStore().load(c.name) is None
    c.down()  # idempotent


def test_teardown_is_no_slower_than_bring_up_and_frees_the_name_at_once(sky_home: Path):
    """An 8-node cluster goes faster than it came (DESIGN §7: one kill per node, its links in
    one kernel operation, its files deleted in the background); when ``down`` returns its
    links and processes are gone and its name can be launched again straight away."""
    name = f"lbfast-{os.getpid() % 10000}"
    t0 = time.perf_counter()
    c = pytest_sky.launch(num_nodes=8, name=name)
    up = time.perf_counter() - t0
    data = c.journal.load()
    t0 = time.perf_counter()
    c.down()
    down = time.perf_counter() - t0
    assert gone(data, name) == []
    assert [p for p in data["cgroups"] if p and Path(p).exists()] == []
    assert down <= up, f"teardown {down:.3f} s, bring-up {up:.3f} s"
    with pytest_sky.launch(num_nodes=1, name=name) as again:
        assert again.run("hostname").ranks[0].stdout.strip() == f"{name}-head"


def test_the_ssh_config_shares_one_connection_and_teardown_closes_it(sky_home: Path):
    """``ssh -F <ssh_config> <cluster>`` multiplexes over one master (as on Kubernetes), which
    the launch opens in the background without waiting: a burst straight after launch gets
    clean output (no race to become the master), and teardown leaves no ssh of ours behind."""
    from pytest_sky import run_command_in_parallel

    c = pytest_sky.launch(num_nodes=2, name=f"lbmux-{os.getpid() % 10000}")
    cfg = c.ssh_config
    (control,) = [line.split()[1] for line in Path(cfg).read_text().splitlines() if "ControlPath" in line]
    sockets = control.replace("%C", "")  # this launch's own prefix
    try:
        results = run_command_in_parallel(["ssh", "-F", cfg, c.name, "echo hi"], 20, 20)
        assert [r.output for r in results] == ["hi\n"] * 20
        check = subprocess.run(["ssh", "-F", cfg, "-O", "check", c.name], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr  # the master is there: later clients use it
        results = run_command_in_parallel(["ssh", "-F", cfg, c.name, "echo hi"], 20, 20)
        assert [r.output for r in results] == ["hi\n"] * 20
    finally:
        c.down()
    # The master renames itself "ssh: <socket> [mux]"; its opener names the config.
    ours = [p for p in procs.pids() if any(s in " ".join(procs.cmdline(p) or []) for s in (cfg, sockets))]
    assert _exits(ours), [procs.cmdline(p) for p in ours]
    assert list(Path(sockets).parent.glob(Path(sockets).name + "*")) == []


def _exits(pids: list[int], timeout: float = 5.0) -> bool:
    """Whether every pid exits within ``timeout`` (an ssh master told to exit goes at once)."""
    deadline = time.monotonic() + timeout
    while any(procs.is_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)  # polling /proc: these are not our children, no pidfd wait is kept
    return True


def test_a_process_leaves_no_files_of_its_torn_down_clusters_when_it_exits(tmp_path: Path):
    """Teardown leaves the deletion of a cluster's files to a thread; the process still
    waits for it before it exits, and what a killed process left is reported by ``doctor``
    and removed by the next reaper."""
    home = tmp_path / "home"
    script = "import pytest_sky\nfor i in range(3):\n    pytest_sky.launch(num_nodes=2, name=f'lbfiles{i}').down()\n"
    env = {**os.environ, "PYTEST_SKY_HOME": str(home), "PYTHONPATH": str(Path(__file__).parent.parent)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    assert list((home / "clusters").iterdir()) == []
    assert list((home / "trash").iterdir()) == []
    # A process killed while it deleted: its entry (named after its dead pid) is a leftover.
    stale = home / "trash" / "999999999.1-0"
    (stale / "nodes" / "0").mkdir(parents=True)
    from pytest_sky.doctor import leftovers

    assert f"files {stale} (the process that was deleting or using them is gone)" in leftovers(home)
    pytest_sky.reap_orphans(StateStore(home))
    assert not stale.exists()


def test_parallel_launches_get_distinct_subnets(sky_home: Path):
    clusters: list[pytest_sky.Cluster] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            clusters.append(pytest_sky.launch(num_nodes=2, name=f"lbpar{i}-{os.getpid() % 10000}"))
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        subnets = {c.node_ips[0].rsplit(".", 1)[0] for c in clusters}
        assert len(subnets) == 4
    finally:
        for c in clusters:
            c.down()


def test_failed_provision_leaves_nothing(sky_home: Path, monkeypatch: pytest.MonkeyPatch):
    real = netns.require_tools

    def broken_sshd() -> dict[str, str]:
        tools = real()
        tools["sshd"] = "/bin/false"
        return tools

    monkeypatch.setattr(netns, "require_tools", broken_sshd)
    name = f"lbfail-{os.getpid() % 10000}"
    start = time.monotonic()
    with pytest.raises(ProvisionError, match="did not come up: node exited"):
        pytest_sky.launch(num_nodes=2, name=name)
    # The nodes' exit is the signal: the launch does not wait out its ready timeout (60 s).
    assert time.monotonic() - start < 30
    # Nothing of this cluster (links are told apart by the directory their alias names: the
    # module's other clusters, other runs and xdist workers have links of their own).
    assert our_links(sky_home / "clusters" / name) == []
    assert StateStore().load(name) is None


def test_invalid_cluster_name_is_refused_before_anything_exists(sky_home: Path):
    with pytest.raises(TaskError, match="invalid cluster name"):
        pytest_sky.launch(num_nodes=2, name="Bad_Name")


def test_mtu_option(sky_home: Path):
    with pytest_sky.launch(num_nodes=2, name=f"lbmtu-{os.getpid() % 10000}", backend_options={"mtu": 1500}) as c:
        assert by_rank(c.run("cat /sys/class/net/eth0/mtu")) == ["1500", "1500"]
    with pytest.raises(ProvisionError, match="MTU"):
        LocalBackend(mtu=70000)


def test_a_system_call_the_nodes_cannot_refuse_is_one_line():
    with pytest.raises(ProvisionError) as info:
        LocalBackend(node_refused_syscalls=["pidfd_open", "fork"])
    assert str(info.value) == (
        "node_refused_syscalls: fork cannot be refused here (known: pidfd_send_signal, pidfd_open, clone3, pidfd_getfd)"
    )


def test_root_without_its_capabilities_is_told_what_to_do():
    """An ordinary user gets a rootless cluster (``tests/test_rootless.py``); root whose
    capabilities a restricted container dropped gets one line."""
    import shutil

    home = world_dir("psky-nonroot-")  # reachable by an unprivileged user
    code = (
        "import pytest_sky\n"
        "try:\n"
        "    pytest_sky.launch(num_nodes=2, name='nonroot')\n"
        "except pytest_sky.SkyError as e:\n"
        "    print(e)\n"
    )
    try:
        proc = run_python(AS_ROOT_WITHOUT_CAPS, code, env={"PYTEST_SKY_HOME": str(home)})
    finally:
        shutil.rmtree(home, ignore_errors=True)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    assert "needs root" in lines[0] and "CAP_NET_ADMIN" in lines[0] and "dropped" in lines[0]


@pytest.mark.parametrize(
    ("nf", "rules", "problem"),
    [
        ("1\n", "-P FORWARD DROP\n", True),
        ("1\n", "-P FORWARD ACCEPT\n", False),
        ("0\n", "-P FORWARD DROP\n", False),
        ("1\n", "-P FORWARD DROP\n-A FORWARD -i psky+ -o psky+ -j ACCEPT\n", False),
        (None, "-P FORWARD DROP\n", False),
    ],
)
def test_forward_policy_detection(nf, rules, problem):
    message = netns.forward_policy_problem(nf, rules)
    assert (message is not None) == problem
    if message:
        assert "iptables" in message and "\n" not in message


def test_a_smaller_task_runs_on_the_first_nodes(cluster3):
    """As `sky exec`: a task runs on its num_nodes first nodes; a command on all of them."""
    res = cluster3.run(Task(run='echo "$SKYPILOT_NUM_NODES $(echo "$SKYPILOT_NODE_IPS" | wc -l)"', num_nodes=2))
    assert by_rank(res) == ["2 2", "2 2"]
    assert cluster3.run(Task(name="solo", run="hostname")).output.startswith("(solo, pid=")
    with pytest.raises(TaskError, match="num_nodes=4"):
        cluster3.run(Task(run="true", num_nodes=4))


def test_reaper_removes_bridges_no_cluster_owns_and_only_those(sky_home: Path, tmp_path: Path):
    """A run killed between creating a bridge and recording it leaves a bridge behind; a
    bridge whose owner lives stays, whichever state directory it is in, and so does one
    whose directory names no owner at all (nothing proves it dead)."""
    from pytest_sky.cluster import reap_orphans
    from pytest_sky.state import ClusterRecord

    ip = netns.require_tools()["ip"]
    store, other = StateStore(), StateStore(tmp_path / "other")
    me = os.getpid()
    other.save(ClusterRecord("x", "local", 1, owner_pid=me, owner_start_time=procs.start_time(me)))
    orphan, foreign, unknown = "psky9990", "psky9991", "psky9992"
    owners = {orphan: store.cluster_dir("gone"), foreign: other.cluster_dir("x"), unknown: tmp_path}
    for name, owner in owners.items():
        with netns.link_lock(exclusive=False):  # as creators do: another worker's reaper waits for the alias
            netns.ip_batch(ip, [f"link add {name} type bridge", f"link set {name} up"])  # no address: sends nothing
            netns.set_alias(name, str(owner))
    try:
        reap_orphans(store)  # which removed the orphan, this or another run's, is not the point
        assert not netns.link_exists(orphan)
        assert netns.link_exists(foreign) and netns.link_exists(unknown)
    finally:
        netns.delete_links(ip, list(owners))


def test_a_killed_runs_bridge_goes_at_the_next_reap_of_any_state_directory(tmp_path: Path):
    """A run SIGKILLed (a whole xdist session, say) leaves its cluster's namespace holder, and
    with it the cluster's bridge and the host's link into its namespace, whose alias names a
    state directory nobody uses again (a test's temporary one).  The next reaper pass of
    another state directory kills that holder and removes the link, judged by its owner's
    liveness: a cluster whose owner lives keeps them though no node is left (stopped), and so
    does a kept cluster whose owner died.  A rootless process's pass leaves root's holders
    and links alone and does not fail on them."""
    from pytest_sky.cluster import reap_orphans
    from pytest_sky.lifecycle import teardown

    dead = StateStore(tmp_path / "dead")
    code = (  # the links are seen while their owner lives: once it is dead, any run's reaper may take them
        "import os, signal, pytest_sky\n"
        "from pytest_sky.state import StateStore\n"
        "from tests.leftovers import our_links\n"
        "for name, keep in (('killed', False), ('kept', True)):\n"
        "    pytest_sky.launch(num_nodes=1, name=name, keep=keep).kill_node(0)\n"
        "    (link,) = our_links(StateStore().cluster_dir(name))\n"
        "    print(name, link, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTEST_SKY_HOME": str(dead.root), "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    seen = dict(map(str.split, proc.stdout.splitlines()))
    assert set(seen) == {"killed", "kept"}, proc.stdout
    live_store = StateStore(tmp_path / "live")
    live = pytest_sky.launch(num_nodes=1, name="alive", store=live_store)
    user_home = world_dir("psky-reaper-")
    try:
        live.kill_node(0)  # as `pytest-sky stop` leaves it: no node left, its holder and link stay
        killed, kept, alive = dead.cluster_dir("killed"), dead.cluster_dir("kept"), live_store.cluster_dir("alive")
        # The owner is dead; its holders and links outlived it.
        assert our_links(killed) == [seen["killed"]] and our_links(kept) == [seen["kept"]]
        assert netns.holder_processes(str(killed)) and netns.holder_processes(str(kept))
        before = {d: (our_links(d), netns.holder_processes(str(d))) for d in (kept, alive)}
        assert all(links and holders for links, holders in before.values()), before
        rootless = run_python(
            AS_NOBODY,
            "from pytest_sky.cluster import reap_orphans\nprint(reap_orphans())\n",
            env={"PYTEST_SKY_HOME": str(user_home)},
        )
        assert rootless.returncode == 0 and f"link {seen['killed']}" not in rootless.stdout, rootless
        assert netns.holder_processes(str(killed)), rootless.stdout  # not a user's to take
        reap_orphans(StateStore(tmp_path / "reaper"))
        assert our_links(killed) == [] and netns.holder_processes(str(killed)) == []
        assert {d: (our_links(d), netns.holder_processes(str(d))) for d in (kept, alive)} == before
    finally:
        shutil.rmtree(user_home, ignore_errors=True)
        live.down()
        for record in dead.records():
            teardown(record, dead)


#: In a mount namespace of its own, over a state directory only it sees: a stopped cluster
#: (no node left), its owner alive until told to go on (a line on stdin).
PRIVATE_LAUNCH = """
import sys, pytest_sky
c = pytest_sky.launch(num_nodes=1, name="private")
c.kill_node(0)
print(c.journal.cluster_dir, flush=True)
sys.stdin.readline()
c.down()
"""


def test_a_holder_whose_directory_only_its_own_mount_namespace_sees_is_not_taken(tmp_path: Path):
    """A launch in a mount namespace of its own (its state directory on a private tmpfs or
    overlay) has a directory this process cannot see; the reaper judges it as its holder
    sees it, so a live owner's holder stays though no node of it is left."""
    state = tmp_path / "state"
    state.mkdir()
    script = f'mount -t tmpfs psky-test {state} && PYTEST_SKY_HOME={state}/home exec {sys.executable} -c "$0"'
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    inner = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, PRIVATE_LAUNCH],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert inner.stdout is not None and inner.stdin is not None
        cluster_dir = inner.stdout.readline().strip()
        assert cluster_dir.startswith(str(state)) and not Path(cluster_dir).exists()  # not from here
        holders = netns.holder_processes(cluster_dir)
        assert holders
        gone = netns.reap_ownerless_holders(netns.require_tools()["ip"])  # another's may go: not this one
        assert not {f"namespace holder {pid}" for pid in holders} & set(gone), gone
        assert netns.holder_processes(cluster_dir) == holders
        inner.stdin.write("go\n")
        inner.stdin.close()
        assert inner.wait(timeout=120) == 0
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()


def test_the_reaper_neither_takes_nor_reports_a_link_another_teardown_just_deleted(
    sky_home: Path, monkeypatch: pytest.MonkeyPatch
):
    """Another process's teardown may delete its bridge between the reaper's listing and its
    look at the bridge's alias: a link that is gone is not an unowned one (under xdist the
    reaper once reported such a link as a stray it had taken)."""
    from pytest_sky.backends import local

    gone = "psky9989"
    assert not netns.link_exists(gone)
    real = os.listdir

    def listing_with_a_link_deleted_since(path):  # the listing saw it; it is gone now
        names = real(path)
        return [*names, gone] if str(path) == "/sys/class/net" else names

    monkeypatch.setattr(local.os, "listdir", listing_with_a_link_deleted_since)
    assert gone not in local.LocalBackend().reap_stray_links(StateStore().root / "clusters")


def test_each_cluster_directory_is_the_top_of_its_own_hierarchy_for_ext4(tmp_path: Path):
    """``clusters/`` carries chattr's ``T``: ext4 spreads the cluster directories made under
    it over block groups, so a launch right after a teardown does not scan past the last
    cluster's freshly deleted inodes (64 nodes: 1.45 s to ready without it, 1.0 s with it,
    on this machine's journal-less ext4)."""
    import array
    import fcntl

    from pytest_sky import state

    probe = tmp_path / "probe"
    probe.mkdir()
    flags = array.array("l", [0])
    fd = os.open(probe, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, state._FS_IOC_GETFLAGS, flags, True)
    except OSError:
        pytest.skip(f"{tmp_path}'s filesystem has no inode flags (chattr): nothing to place")
    finally:
        os.close(fd)
    StateStore(tmp_path / "home")
    lsattr = subprocess.run(["lsattr", "-d", str(tmp_path / "home" / "clusters")], capture_output=True, text=True)
    assert lsattr.stdout.split()[0].count("T") == 1, lsattr.stdout


def test_the_local_journal_reads_what_the_dict_journal_wrote_and_round_trips(tmp_path: Path):
    """A journal an earlier version wrote (a plain dict, the same keys) reads as typed records,
    and what the typed journal writes reads back equal."""
    from pytest_sky.backends.local_journal import LocalJournal
    from pytest_sky.state import Journal

    spec = netns.NodeSpec(hostname="c-head", ip="198.18.3.2", root=tmp_path / "nodes" / "0", veth="psky3n0")
    old = {
        "index": 3,
        "bridge": "psky3",
        "veths": ["psky3n0"],
        "cgroups": [""],
        "node_dirs": str(tmp_path / "nodes") + "/",
        "specs": [spec.to_json()],
        "mtu": 1500,
        "home_files": [".ssh/id"],
        "nodes": [{"pid": 10, "init_pid": 11, "start_time": 99, "log": "/x/node.log"}],
        "delayers": {"0": {"pid": 12, "start_time": 1, "parent": 13, "parent_start": 2}},
    }
    journal = Journal(tmp_path / "backend.json")
    journal.update(**old)
    state = LocalJournal.load(journal)
    assert state.nodes == [netns.NodeRecord(pid=10, init_pid=11, start_time=99, log="/x/node.log")]
    assert state.specs[0].veth == "psky3n0" and state.delayers[0] == netns.Delayer(12, 1, 13, 2)
    assert not state.faults
    state.save(journal)
    assert LocalJournal.load(journal) == state
    journal.update(nodes=[{"init_pid": 1}])  # no pid: not a node record
    with pytest.raises(ProvisionError, match="not a local journal"):
        LocalJournal.load(journal)


def test_a_node_record_in_the_emulator_s_shape_is_reaped_like_a_typed_one(monkeypatch: pytest.MonkeyPatch):
    """``reap_nodes`` takes the JSON object a record holds (the emulator's carries ``veth`` and
    no ``log``) as well as a NodeRecord: both name the same pids."""
    from pytest_sky.backends.netns import reap

    killed: list[list[int]] = []
    monkeypatch.setattr(reap, "kill_and_wait", lambda pids: killed.append(list(pids)) or [])
    me = os.getpid()
    raw = {"pid": me, "init_pid": 0, "start_time": procs.start_time(me), "veth": "psky9p3"}
    netns.reap_nodes([raw])
    netns.reap_nodes([netns.NodeRecord.from_json(raw)])
    assert killed == [[me], [me]]
