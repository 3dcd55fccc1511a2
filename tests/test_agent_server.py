"""Each node's agent server: what a run goes through once the first has started them.

The first run on a cluster execs the agent on the head, which starts the head's server
(``pytest_sky.agent.server``), and reaches each worker over ssh; the second, a fork of the
head's server, starts the workers' on its way; from the third on, every rank is a fork of its
node's server.  What a user notices: the same output, exit codes and
failures either way, a server that only a holder of the cluster key may use, and a run that
still works when a server is gone.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.protocol import AGENT_PORT, GREETING, door_answer, door_secret
from tests.plugin_helpers import needs_local_backend

pytestmark = needs_local_backend

# Every ancestor of the rank's shell, up to pid 1; then whether the node's server is one.
SERVED = (
    'p=$$ chain=\' \'; while [ "$p" -gt 1 ]; do chain="$chain$p "; '
    "p=$(sed -n 's/^PPid:\\s*//p' /proc/$p/status); done; "
    "server=$(cat ~/.sky/agent.pid 2>/dev/null); "
    'case "$chain" in *" $server "*) echo served ;; *) echo not-served ;; esac'
)

# Whether the node's server has written its pid file, and is that process.
SERVER_KNOWN = (
    'p=$(cat ~/.sky/agent.pid 2>/dev/null); if [ -z "$p" ]; then echo none; '
    'elif grep -q agent.pyz "/proc/$p/cmdline"; then echo known; else echo stale; fi'
)


def serve(cluster: pytest_sky.Cluster) -> None:
    """Two runs: the first starts the head's server, the second (served) each worker's.  Each
    test calls it, whichever of the module's tests ran before on this cluster (xdist)."""
    for _ in range(2):
        assert cluster.run("true").returncode == 0


@pytest.fixture(scope="module")
def cluster(module_home: Path) -> Iterator[pytest_sky.Cluster]:
    with pytest_sky.launch(num_nodes=3, name=f"served-{os.getpid() % 10000}") as c:
        yield c


def test_from_the_third_run_every_rank_runs_under_its_node_server(module_home: Path) -> None:
    with pytest_sky.launch(num_nodes=3, name=f"fresh-{os.getpid() % 10000}") as cluster:
        # A server is known by its pid file before the run that started it goes on (the
        # leftover check, run at once, kills an agent process it cannot tell from a job's).
        first = cluster.run(SERVED + "; " + SERVER_KNOWN)
        # An exec on the head, which starts its server; ssh to the workers.
        assert [r.stdout for r in first.ranks] == ["not-served\nknown\n"] + ["not-served\nnone\n"] * 2, first.output
        second = cluster.run(SERVED + "; " + SERVER_KNOWN)
        assert [r.stdout for r in second.ranks] == ["served\nknown\n"] + ["not-served\nknown\n"] * 2, second.output
        res = cluster.run(SERVED)
        assert res.returncode == 0, res.output
        assert [r.stdout for r in res.ranks] == ["served\n"] * 3, res.output
        # Not the environment of the session that started the server: no stale SSH_CONNECTION.
        env = cluster.run('echo "${SSH_CONNECTION:-none}"')
        assert [r.stdout for r in env.ranks] == ["none\n"] * 3, env.output


def test_a_served_rank_keeps_its_output_byte_for_byte_and_its_exit_code(cluster) -> None:
    serve(cluster)
    # Trailing blank lines, a last line without a break, and a line that looks like the end
    # mark: none of them ends the rank early or loses a line.
    res = cluster.run(
        '[ "$SKYPILOT_NODE_RANK" = 1 ] && printf "a\\n\\n\\n"; '
        '[ "$SKYPILOT_NODE_RANK" = 2 ] && { echo "PSKY-EXIT 0"; echo ""; printf "tail"; }; true'
    )
    assert res.returncode == 0, res.output
    assert [r.stdout for r in res.ranks[1:]] == ["a\n\n\n", "PSKY-EXIT 0\n\ntail\n"]
    failed = cluster.run('[ "$SKYPILOT_NODE_RANK" = 1 ] && exit 3; true')
    assert failed.ranks[1].returncode == 3
    assert failed.returncode == 3 and "rank 1" in (failed.error or ""), failed.error


def _ask(ip: str, answer: Callable[[bytes], bytes]) -> bytes:
    """What a node's server sends after its greeting, given ``answer(greeting)``, until it
    closes (the lifeline stays open: a rank runs to its end)."""
    with socket.create_connection((ip, AGENT_PORT), timeout=10) as sock:
        greeting = sock.recv(256)
        assert greeting.startswith(GREETING)
        sock.sendall(answer(greeting))
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:  # closed with our bytes unread: refused
            pass
        return out


def test_only_a_holder_of_the_cluster_key_gets_past_a_server_door(cluster, module_home: Path) -> None:
    serve(cluster)
    secret = door_secret((module_home / "clusters" / cluster.name / "id_ed25519").read_bytes())
    worker = cluster.node_ips[1]
    program = b"echo ran"
    wrong = _ask(worker, lambda _: b"0" * 64 + b" rank m %d\n" % len(program) + program)
    assert wrong == b""  # closed at once, nothing run
    right = _ask(worker, lambda g: door_answer(secret, g, f"rank m {len(program)}") + program)
    assert b"\nran\n" in right and right.rstrip().endswith(b"PSKY-EXIT m 0"), right


def test_a_served_rank_whose_lifeline_closes_is_stopped_term_first_then_killed(cluster, module_home: Path) -> None:
    """The head lets go of a rank (another failed, the run timed out or was cancelled) by
    closing its connection, at any moment, even before the rank has started: the server
    sends SIGTERM to the job, SIGKILL after the grace to what ignored it, and the output
    still starts with the rank's pid and ends with its mark and status."""
    import time

    from pytest_sky.agent.supervisor import GRACE_SECONDS

    serve(cluster)
    secret = door_secret((module_home / "clusters" / cluster.name / "id_ed25519").read_bytes())
    # "t" is let go of at once, "k" once its trap ignores SIGTERM.
    programs = {b"t": b"echo up; sleep 60", b"k": b"trap '' TERM; echo up; sleep 60"}
    socks = {}
    start = time.monotonic()
    for mark, program in programs.items():
        sock = socket.create_connection((cluster.node_ips[1], AGENT_PORT), timeout=20)
        sock.sendall(door_answer(secret, sock.recv(256), f"rank {mark.decode()} {len(program)}") + program)
        socks[mark] = sock
    socks[b"t"].shutdown(socket.SHUT_WR)  # maybe before the rank has even started
    outs = {b"t": b"", b"k": b""}
    while b"up\n" not in outs[b"k"]:
        chunk = socks[b"k"].recv(65536)
        assert chunk, outs
        outs[b"k"] += chunk
    socks[b"k"].shutdown(socket.SHUT_WR)  # now its trap holds: SIGKILL after the grace
    stopped = time.monotonic()
    ends = {}
    for mark, sock in socks.items():
        while chunk := sock.recv(65536):
            outs[mark] += chunk
        sock.close()
        ends[mark] = time.monotonic() - (start if mark == b"t" else stopped)
        assert outs[mark].startswith(b"PSKY-PID "), outs
        assert outs[mark].rstrip().endswith(b"PSKY-EXIT " + mark + (b" 143" if mark == b"t" else b" 137")), outs
    assert ends[b"t"] < GRACE_SECONDS, ends  # TERM ended it: no grace waited out
    assert GRACE_SECONDS <= ends[b"k"] < GRACE_SECONDS + 3, ends


def test_each_rank_leads_a_process_group_and_its_supervisor_says_nothing(cluster) -> None:
    """PROGRAM leads a process group of its own (a stop signals it whole), made with bash's
    job control, whose notice that a job is done (printed now and then when the job is
    quick) must never be written: a served rank's supervisor would write it into its
    server's log, an exec'd run's into the channel that reaches the user."""
    serve(cluster)
    res = cluster.run('read -r _ _ _ _ group _ </proc/$$/stat; [ "$group" = $$ ] && echo leads')
    assert [r.stdout for r in res.ranks] == ["leads\n"] * 3, res.output
    for _ in range(15):  # 45 supervisors; before the fix about one in five wrote the notice
        assert cluster.run("echo hi").returncode == 0
    logs = cluster.run("cat ~/.sky/agent-server.log")
    assert [r.stdout for r in logs.ranks] == [""] * 3, logs.output


def test_a_client_that_stalls_at_the_door_holds_up_no_one(cluster, module_home: Path) -> None:
    """A server reads every handshake as its bytes come: a client silent after connecting, or
    stopped halfway through its request line or its program, delays nobody else's rank; and
    a request that comes in pieces, however it is cut, runs once it is whole."""
    serve(cluster)
    secret = door_secret((module_home / "clusters" / cluster.name / "id_ed25519").read_bytes())
    worker = cluster.node_ips[1]
    program = b"echo pieced"
    stalled = [socket.create_connection((worker, AGENT_PORT), timeout=10) for _ in range(3)]
    try:
        greetings = [sock.recv(256) for sock in stalled]
        whole = door_answer(secret, greetings[1], f"rank m {len(program)}") + program
        line_end = whole.index(b"\n") + 1
        stalled[1].sendall(whole[: line_end // 2])  # half its request line
        partial = door_answer(secret, greetings[2], f"rank p {len(program)}")
        stalled[2].sendall(partial + program[:4])  # its line, and part of its program
        res = cluster.run(SERVED)
        assert [r.stdout for r in res.ranks] == ["served\n"] * 3, res.output
        stalled[1].sendall(whole[line_end // 2 :])
        stalled[2].sendall(program[4:])
        for sock, mark in ((stalled[1], b"m"), (stalled[2], b"p")):
            out = b""
            while chunk := sock.recv(65536):
                out += chunk
            assert b"\npieced\n" in out and out.rstrip().endswith(b"PSKY-EXIT " + mark + b" 0"), out
    finally:
        for sock in stalled:
            sock.close()


# Run on the head: each worker's server killed over ssh, and waited for.
KILL_WORKER_SERVERS = (
    '[ "$SKYPILOT_NODE_RANK" = 0 ] || exit 0; for ip in $(echo "$SKYPILOT_NODE_IPS" | tail -n +2); do '
    """ssh "$ip" 'p=$(cat ~/.sky/agent.pid); kill "$p"; while kill -0 "$p" 2>/dev/null; do sleep 0.01; done' """
    "|| exit 1; done"
)


def test_a_run_goes_the_old_way_when_a_server_is_gone(cluster) -> None:
    serve(cluster)
    kill = cluster.run(KILL_WORKER_SERVERS)
    assert kill.returncode == 0, kill.output
    again = cluster.run("hostname")  # the workers refuse: over ssh, which starts new servers
    assert again.returncode == 0, again.output
    assert [r.stdout.strip() for r in again.ranks] == [f"{cluster.name}-{n}" for n in ("head", "worker1", "worker2")]
    res = cluster.run(SERVED)
    assert [r.stdout for r in res.ranks] == ["served\n"] * 3, res.output


def test_a_worker_whose_server_port_is_silent_gets_its_ranks_over_ssh(module_home: Path) -> None:
    """A network policy that lets only SSH through between pods: the run still reaches every
    rank (after one wait for the silent port), and later runs go straight to ssh."""
    name = f"filtered-{os.getpid() % 10000}"
    with pytest_sky.launch(num_nodes=2, name=name, capabilities=("NET_ADMIN",)) as cluster:
        serve(cluster)
        drop = cluster.run('[ "$SKYPILOT_NODE_RANK" = 0 ] || iptables -A INPUT -p tcp --dport 7022 -j DROP')
        assert drop.returncode == 0, drop.output
        for _ in range(2):
            res = cluster.run(SERVED)
            assert res.returncode == 0, res.output
            assert [r.stdout for r in res.ranks] == ["served\n", "not-served\n"], res.output
        remembered = cluster.run('[ "$SKYPILOT_NODE_RANK" = 1 ] || ls ~/.sky/agent-filtered')
        assert remembered.ranks[0].stdout == f"{cluster.node_ips[1]}\n", remembered.output


# Whether the rank's shell has a bash supervisor (argv ``psky-rank``) among its ancestors.
UNDER_BASH_SUPERVISOR = (
    'p=$BASHPID; while [ "$p" -gt 1 ]; do p=$(sed -n "s/^PPid:\\s*//p" /proc/$p/status); '
    'tr "\\0" " " </proc/$p/cmdline | grep -q " psky-rank " && { echo bash-supervisor; exit 0; }; done; '
    "echo server-itself"
)
PIDFD_OPEN = "python3 -c 'import os; os.pidfd_open(os.getpid())' 2>&1 | tail -n 1"


def test_where_a_pods_profile_refuses_pidfds_each_server_hands_its_ranks_to_a_bash_supervisor(
    module_home: Path,
) -> None:
    """An older container runtime's seccomp profile refuses pidfd_open: the server cannot
    watch a rank by pidfd, so it spawns the rank's bash supervisor, which then keeps the same
    contract (output, exit codes, a lifeline that stops the whole job, no cgroup left)."""
    import time

    from pytest_sky.agent.supervisor import GRACE_SECONDS
    from pytest_sky.errors import RunTimeoutError

    name = f"nopidfd-{os.getpid() % 10000}"
    options = {"node_refused_syscalls": ["pidfd_open"]}
    with pytest_sky.launch(num_nodes=2, name=name, backend_options=options) as cluster:
        serve(cluster)
        refused = cluster.run(PIDFD_OPEN)
        assert [r.stdout for r in refused.ranks] == ["PermissionError: [Errno 1] Operation not permitted\n"] * 2
        res = cluster.run(SERVED + "; " + UNDER_BASH_SUPERVISOR)
        assert [r.stdout for r in res.ranks] == ["served\nbash-supervisor\n"] * 2, res.output
        failed = cluster.run('[ "$SKYPILOT_NODE_RANK" = 1 ] && exit 3; echo fine')
        assert failed.returncode == 3 and failed.ranks[1].returncode == 3, failed.output
        with pytest.raises(RunTimeoutError):  # its lifeline closes: SIGTERM, ignored; SIGKILL after the grace
            cluster.run("trap '' TERM; sleep 1005", timeout=1)
        deadline = time.monotonic() + GRACE_SECONDS + 10
        left = "pgrep -c -f 'sleep 100[5]' || true; ls /sys/fs/cgroup | grep -c '^psky-job-'"
        while (res := cluster.run(left)).returncode != 0 or [r.stdout.split() for r in res.ranks] != [["0", "1"]] * 2:
            assert time.monotonic() < deadline, res.output  # "1": the cgroup of the job that counts
    # And where pidfds work, the server supervises each rank itself.
    with pytest_sky.launch(num_nodes=2, name=f"{name}-ok") as cluster:
        serve(cluster)
        res = cluster.run(UNDER_BASH_SUPERVISOR)
        assert [r.stdout for r in res.ranks] == ["server-itself\n"] * 2, res.output
