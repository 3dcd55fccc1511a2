"""A job owns every process it starts, on every node: after a failed, timed-out or cancelled
run, nothing it started is left, not even processes that made a session of their own, were
daemonised, or lost their parent.  Proven on real nodes with ``pgrep`` on every rank, both
with the node cgroups of the local backend and with the environment-token fallback that
Kubernetes pods (read-only cgroupfs) get."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.backends import netns
from pytest_sky.errors import RunTimeoutError
from pytest_sky.job import JobStatus
from tests.plugin_helpers import ROOTLESS

# Every way a process escapes its rank's process group: a new session, a subshell whose
# parent exits at once (reparented to the node's init), nohup, a double fork.
ESCAPES = (
    "setsid sleep 1001 & (sleep 1002 &); nohup sh -c 'sleep 1003' >/dev/null 2>&1 & setsid sh -c 'sleep 1004 & exit'; "
)
# The regex does not match its own text (``100[0-9]`` is not ``100`` and a digit).
COUNT = "pgrep -f 'sleep 100[0-9]' | wc -l"
STARTED = f'until [ "$({COUNT})" -ge 5 ]; do sleep 0.02; done; echo all-started; '


def _two_nodes(kind: str, served: bool, pidfds: bool = True, clone3: bool = True):
    """Two nodes with writable cgroups (local nodes), or with none (as pods see them).
    ``served``: after two runs, which started every node's agent server, so that the next
    run's ranks are supervised by the servers (``agent.supervisor``); else its next run is
    its first, whose ranks run under the bash supervisor (``shell/rank_supervisor.sh``).
    ``pidfds=False``: the nodes' seccomp profile refuses pidfd_open, as an older runtime's
    does, and each server hands its ranks to a bash supervisor instead.  ``clone3=False``:
    the profile refuses clone3 (ENOSYS, as today's runtimes' do), and libc's ``posix_spawn``,
    which starts every rank, falls back to clone."""
    if kind == "cgroup" and ROOTLESS:
        pytest.skip("rootless nodes have no cgroups (none are the user's to give): the fallback runs")
    options: dict[str, object] = {"node_cgroups": "ro"} if kind == "fallback" else {}
    refused = [*(["pidfd_open"] * (not pidfds)), *(["clone3"] * (not clone3))]
    if refused:
        options["node_refused_syscalls"] = refused
    name = f"tree-{kind[:2]}{'-s' * served}{'-n' * (not pidfds)}{'-c' * (not clone3)}-{os.getpid() % 10000}"
    c = pytest_sky.launch(num_nodes=2, name=name, backend_options=options)
    try:
        for _ in range(2 * served):
            assert c.run("true").returncode == 0
        yield c
    finally:
        c.down()


KINDS = [
    "cgroup",
    "fallback",
    "cgroup-served",
    "fallback-served",
    "cgroup-served-nopidfd",
    "fallback-served-nopidfd",
    "cgroup-served-noclone3",
]


@pytest.fixture(params=KINDS)
def cluster(request: pytest.FixtureRequest, home: Path):
    kind, *flags = request.param.split("-")
    yield from _two_nodes(kind, "served" in flags, pidfds="nopidfd" not in flags, clone3="noclone3" not in flags)


@pytest.fixture(params=["cgroup", "fallback"])
def first_run_cluster(request: pytest.FixtureRequest, home: Path):
    """A cluster whose next run is its first: every rank under the bash supervisor."""
    yield from _two_nodes(request.param, False)


def left_on_nodes(c) -> list[str]:
    return [r.stdout.strip() for r in c.run(COUNT).ranks]


# Rank 1 fails only once the head's rank has said "all-started" (asked over ssh, as any node
# may): the failure then stops two ranks that both spawned their escapes, however late the
# head's rank started.
HEAD_STARTED = (
    'head=$(echo "$SKYPILOT_NODE_IPS" | head -n 1); '
    'until ssh -o BatchMode=yes "$head" test -e /tmp/tree-started; do sleep 0.05; done; '
)


def test_a_failed_run_leaves_no_process_on_any_node(cluster):
    start = time.monotonic()
    fail = f'[ "$SKYPILOT_NODE_RANK" = 1 ] && {{ {HEAD_STARTED}exit 3; }}; '
    res = cluster.run(ESCAPES + STARTED + "touch /tmp/tree-started; " + fail + "sleep 1000")
    assert res.returncode == 3
    assert all("all-started" in r.stdout for r in res.ranks)  # both ranks got to spawn them
    assert time.monotonic() - start < 8
    assert left_on_nodes(cluster) == ["0", "0"]


def test_a_timed_out_run_leaves_no_process_on_any_node(cluster):
    with pytest.raises(RunTimeoutError):
        cluster.run(ESCAPES + STARTED + "sleep 1000", timeout=4)
    start = time.monotonic()
    while left_on_nodes(cluster) != ["0", "0"]:
        assert time.monotonic() - start < 5, f"still running after 5 s: {left_on_nodes(cluster)}"


def test_a_cancelled_job_leaves_no_process_on_any_node(cluster):
    job = cluster.submit(ESCAPES + STARTED + "sleep 1000")
    deadline = time.monotonic() + 20
    while job.logs().count("all-started") < 2:  # the real signal: both ranks said so
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.05)
    assert job.status == JobStatus.RUNNING
    assert all(int(n) >= 5 for n in left_on_nodes(cluster))
    start = time.monotonic()
    job.cancel()
    assert job.wait(10) == JobStatus.CANCELLED
    assert left_on_nodes(cluster) == ["0", "0"]
    assert time.monotonic() - start < 5


def test_a_finished_run_kills_what_it_left_running(cluster):
    res = cluster.run(ESCAPES + STARTED + "true")
    assert res.returncode == 0
    assert left_on_nodes(cluster) == ["0", "0"]


def test_torchrun_stops_its_workers_on_sigterm_before_the_kill(cluster):
    """SIGTERM reaches every process of the job at once, with a grace before cgroup.kill:
    a process that cleans up on SIGTERM gets to (torchrun stopping its workers)."""
    script = (
        "trap 'echo cleaned-$SKYPILOT_NODE_RANK >> ~/cleanup.log; exit 0' TERM; "
        "echo armed; while :; do sleep 0.05; done"
    )
    job = cluster.submit(script)
    deadline = time.monotonic() + 20
    while job.logs().count("armed") < 2:
        assert time.monotonic() < deadline, job.logs()
        time.sleep(0.05)
    job.cancel()
    assert job.wait(10) == JobStatus.CANCELLED
    res = cluster.run("cat ~/cleanup.log")
    assert [r.stdout.strip() for r in res.ranks] == ["cleaned-0", "cleaned-1"]


@pytest.mark.skipif(ROOTLESS, reason="rootless nodes have no cgroups: none are the user's to give")
def test_nodes_have_cgroups_of_their_own_and_leave_none_behind(home: Path):
    root = netns.cgroup2_root()
    assert root is not None, "this host has no writable cgroup2 hierarchy (see /proc/mounts)"
    c = pytest_sky.launch(num_nodes=2, name=f"tree-cg-{os.getpid() % 10000}")
    try:
        paths = [Path(p) for p in c.journal.load()["cgroups"]]
        assert all(p.parent == root and p.is_dir() for p in paths)
        # Inside, a node sees its own cgroup as the root (a cgroup namespace), writable.
        res = c.run("cat /proc/self/cgroup; ls /sys/fs/cgroup/cgroup.kill")
        assert res.returncode == 0, res.output
        v2 = [[line for line in r.stdout.splitlines() if line.startswith("0::")] for r in res.ranks]
        assert all(lines and lines[0].startswith("0::/psky-job-") for lines in v2), res.output
    finally:
        c.down()
    assert not any(p.exists() for p in paths)


def test_a_rank_told_to_stop_before_it_even_waits_is_stopped():
    """The head may let go of a rank at once (another rank failed in its first millisecond):
    the lifeline closes before the supervisor reaches its wait, and the rank must still stop
    within the grace, not run to its end.  (Run here on this host, as on any machine.)"""
    import subprocess

    from pytest_sky.agent.rank import RANK_SUPERVISOR, program_env

    start = time.monotonic()
    proc = subprocess.run(
        ["/bin/bash", "-c", RANK_SUPERVISOR, "psky-rank"],
        env=program_env("echo up; sleep 60"),
        stdin=subprocess.DEVNULL,  # the lifeline is closed from the start
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert time.monotonic() - start < 5, proc.stdout
    assert proc.returncode != 0
    assert proc.stdout.startswith("PSKY-PID ")


def test_a_process_that_keeps_forking_is_stopped_with_all_it_started(cluster):
    """The kill is repeated until nothing of the job is left: a child forked (or exec'd) while
    the supervisor read /proc was missed by a one-shot kill and outlived the run."""
    spawner = "setsid sh -c 'while :; do sleep 1005 & sleep 0.005; done' >/dev/null 2>&1 & "
    res = cluster.run(spawner + "until [ \"$(pgrep -f 'sleep 1005' | wc -l)\" -ge 20 ]; do sleep 0.02; done; true")
    assert res.returncode == 0, res.output
    assert left_on_nodes(cluster) == ["0", "0"]


# The rank supervisor above this shell, and how many of its children are forks of it (its
# lifeline's reader and its stderr's, psky-rank by their arguments); the check runs in between, as a child.
_SUPERVISOR_FORKS = r"""
sup=$$
is_rank() { tr '\0' '\n' <"/proc/$1/cmdline" | grep -x psky-rank >/dev/null; }  # not -q: no EPIPE for tr
until is_rank "$sup"; do sup=$(awk '/^PPid:/ {print $2}' "/proc/$sup/status"); done
forks() { for c in $(pgrep -P "$sup"); do is_rank "$c" && echo "$c"; done | wc -l; }
echo "before $(forks)"
bash -c "$CHECK" || echo "check failed: $?"
echo "after $(forks)"
"""


def test_the_leftover_check_spares_its_own_supervisor(first_run_cluster):
    """Between two tests that share a cluster the check kills every other rank supervisor;
    it killed the reader of its own supervisor's lifeline too (a fork of the supervisor,
    with its arguments), so a check that hung could not be stopped by the head."""
    import shlex

    from pytest_sky.cluster import LEFTOVER_CHECK

    res = first_run_cluster.run(f"CHECK={shlex.quote(LEFTOVER_CHECK)}\n{_SUPERVISOR_FORKS}")
    assert res.returncode == 0, res.output
    # Two forks: the lifeline's reader and the reader of the rank's stderr, both spared.
    assert [r.stdout.split() for r in res.ranks] == [["before", "2", "after", "2"]] * 2, res.output


# An "agent" (by its arguments) running the check, with a child that still has the agent's
# arguments: what a rank the agent is starting looks like until it has exec'd.
_AGENT_STARTING_A_RANK = r"""
bash -c '(exec -a x/agent.pyz sleep 300) & rank=$!
until tr "\0" "\n" <"/proc/$rank/cmdline" | grep -x x/agent.pyz >/dev/null; do sleep 0.01; done
bash -c "$CHECK" || echo "check failed: $?"
if kill "$rank" 2>/dev/null; then echo spared; else echo killed; fi' x/agent.pyz
"""


def test_the_leftover_check_spares_a_rank_its_agent_is_starting(cluster):
    """The first run on a cluster is the check when its first test ran nothing; the head's
    agent then starts the workers' ranks over ssh while the head's rank already checks, and
    an ssh client not yet exec'd (the agent's fork, with its arguments) was killed: "run
    failed on rank 1 with exit code 137", and the shared cluster was replaced."""
    import shlex

    from pytest_sky.cluster import LEFTOVER_CHECK

    res = cluster.run(f"export CHECK={shlex.quote(LEFTOVER_CHECK)}\n{_AGENT_STARTING_A_RANK}")
    assert res.returncode == 0, res.output
    assert [r.stdout for r in res.ranks] == ["spared\n"] * 2, res.output


def test_a_rank_is_in_its_jobs_account_from_its_first_command(cluster, request: pytest.FixtureRequest):
    """Its job's cgroup where the node has them (moved there before it runs), its job's token
    where it has none; each run's its own."""
    from pytest_sky import shell

    probe = f'grep "^0::" /proc/self/cgroup; echo "${shell.JOB_SCOPE_VAR}"'
    firsts = [cluster.run(probe) for _ in range(2)]
    tokens = set()
    for res in firsts:
        assert res.returncode == 0, res.output
        for r in res.ranks:
            group, token = r.stdout.split()
            assert token.startswith(shell.JOB_SCOPE_PREFIX), r.stdout
            tokens.add(token)
            if request.node.callspec.params["cluster"].startswith("cgroup"):
                assert group.startswith(f"0::/{shell.CGROUP_PREFIX}"), r.stdout
    assert len(tokens) == 4, firsts[0].output + firsts[1].output


# The agent's own module, in the node, with the node's python: what a run calls as it starts.
_WARM_PROBE = (
    "import os, sys; sys.path.insert(0, os.path.expanduser('~/.sky/agent.pyz')); "
    "from pytest_sky.agent import rank; before = open('/proc/self/cgroup').read(); "
    "print(rank.move_into_own_cgroup(), open('/proc/self/cgroup').read() == before)"
)


def test_the_move_that_warms_the_kernel_moves_nothing(first_run_cluster, request: pytest.FixtureRequest):
    """A run starts by moving itself into its own cgroup (``rank.warm_cgroup_moves``), so the
    kernel's wait before the ranks' moves is paid early: the move is taken where the node's
    cgroups are writable, leaves the process where it was, and is refused quietly where they
    are read-only (as in a pod)."""
    import shlex
    import sys

    res = first_run_cluster.run(f"{shlex.quote(sys.executable)} -I -S -c {shlex.quote(_WARM_PROBE)}")
    assert res.returncode == 0, res.output
    taken = "True" if request.node.callspec.params["first_run_cluster"] == "cgroup" else "False"
    assert [r.stdout.split() for r in res.ranks] == [[taken, "True"]] * 2, res.output


def test_runs_leave_no_job_cgroup_behind(cluster, request: pytest.FixtureRequest):
    """Each rank's cgroup is made by its caller (the head's agent, a worker's agent server) and
    removed once the rank is over (a worker's just after its exit status went out): a node
    that has run many jobs holds the cgroup of the running one only."""
    for _ in range(4):  # the first goes the old way (exec, ssh); then the agent servers
        assert cluster.run("true").returncode == 0
    own = "1" if request.node.callspec.params["cluster"].startswith("cgroup") else "0"  # the running job's
    count = "n=$(ls /sys/fs/cgroup | grep -c '^psky-job-')"
    res = cluster.run(f"for i in $(seq 250); do {count}; [ $n = {own} ] && break; sleep 0.02; done; echo $n")
    assert [r.stdout.strip() for r in res.ranks] == [own, own], res.output
