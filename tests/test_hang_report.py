"""A hung run says where every rank waits (issue 47): on the local backend and on emulated
pods (which hold no ``SYS_PTRACE``), through ``run(timeout=...)``, ``Job.wait(timeout)`` and a
rank's ssh to another node, with nothing left running afterwards.

The frameworks' hangs (gloo, torchrun, mpirun) are the smoke suite's (``smoke/test_hangs.py``);
here a plain Python program stands for a rank: where it waits is known to the line.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

import pytest_sky
from pytest_sky import Cluster
from pytest_sky.diagnosis import Capture, ProcessView, waiting
from pytest_sky.errors import RunTimeoutError
from tests.plugin_helpers import needs_local_backend

#: Written on every node by the run itself (the nodes share no files with this machine).
HANG = """\
cat > ~/hang.py <<'EOF'
import time

def main():
    print("ready", flush=True)
    time.sleep(600)

main()
EOF
"""
SLEEP_LINE = 5


def _over_ssh(worker: str) -> str:
    """Rank 0 runs hang.py on ``worker`` over ssh, after copying it there itself (the
    worker's own rank may not have written its copy yet)."""
    return (
        f'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then ssh {worker} "cat > hang.py" < ~/hang.py && '
        f"exec ssh {worker} python3 hang.py; fi\n"
    )


def _pythons(capture: Capture, rank: int) -> list[ProcessView]:
    (node,) = [n for n in capture.nodes if n.rank == rank]
    assert node.error is None, node.error
    return [p for p in node.processes if p.python]


def _assert_sleeping_in_main(proc: ProcessView) -> None:
    assert proc.note == "", proc.note
    main = proc.stacks[-1]
    wait = waiting(main, proc.interpreter_dirs(), proc.argv)
    assert wait.user is not None and wait.user.where() == f"hang.py:{SLEEP_LINE} main", main
    assert (wait.user.source, wait.call) == ("time.sleep(600)", "time.sleep")


def _left_running(cluster: Cluster) -> list[str]:
    """Every hang.py still running on any node 30 s after its run was stopped (a stop is a
    SIGTERM, the rank's grace, then SIGKILL: the run's caller does not wait for it)."""
    check = "for _ in $(seq 300); do pgrep -f '^python3 .*hang.py$' >/dev/null || exit 0; sleep 0.1; done; "
    check += "pgrep -af '^python3 .*hang.py$'"
    res = cluster.run(check, timeout=60)
    return [f"rank {r.rank}: {line}" for r in res.ranks for line in r.stdout.splitlines()]


@pytest.fixture(scope="module")
def cluster(module_home: object) -> Iterator[Cluster]:
    c = pytest_sky.launch(num_nodes=2, name=f"hang-{os.getpid() % 10000}")
    yield c
    c.down()


@needs_local_backend
def test_a_run_past_its_deadline_says_where_every_rank_waits_then_stops_them(cluster: Cluster) -> None:
    """Rank 0 sleeps in its own function; rank 1 has exited.  The task sets its own
    PYTHONPATH, and its Python is still armed."""
    run = HANG + '[ "$SKYPILOT_NODE_RANK" = 0 ] && exec python3 ~/hang.py; echo "worker done"'
    started = time.monotonic()
    with pytest.raises(RunTimeoutError) as info:
        cluster.run(run, env={"PYTHONPATH": "/opt/elsewhere"}, timeout=8)
    assert time.monotonic() - started < 8 + 15  # the capture is bounded (diagnosis.CAPTURE_SECONDS)
    capture = info.value.capture
    assert isinstance(capture, Capture) and capture.error is None
    assert [(r.rank, r.state) for r in capture.ranks] == [(0, "running"), (1, "exited (0)")]
    assert capture.ranks[0].last_lines == ("ready",) and capture.ranks[1].last_lines == ("worker done",)
    (python,) = _pythons(capture, 0)
    _assert_sleeping_in_main(python)
    assert python.wchan and python.threads  # what the kernel says it waits in
    assert _pythons(capture, 1) == []
    summary = capture.summary()
    assert f"main thread: hang.py:{SLEEP_LINE} main: time.sleep(600)\n      waits in time.sleep" in summary
    assert cluster.stopped[-1].capture is capture and cluster.stopped[-1].timeline is info.value.timeline
    assert _left_running(cluster) == []


@needs_local_backend
def test_what_a_rank_starts_on_another_node_over_ssh_is_its_too(cluster: Cluster) -> None:
    """As mpirun's remote ranks: ssh carries the job's token to the other node, and that
    node's sshd arms the Python it starts (the session has none of the rank's environment)."""
    worker = cluster.node_ips[1]
    run = HANG + _over_ssh(worker) + 'echo "worker done"'
    with pytest.raises(RunTimeoutError) as info:
        cluster.run(run, timeout=8)
    capture = info.value.capture
    assert [r.state for r in capture.ranks] == ["running", "exited (0)"]
    (remote,) = _pythons(capture, 1)
    assert remote.argv == ("python3", "hang.py")
    _assert_sleeping_in_main(remote)
    assert "ssh" in _pythons_and_leaves(capture, 0)
    # A plain ssh session outlives its client (mpirun's orted ends with its connection): this
    # test ends its remote rank itself, by the pid its node gave.
    cluster.run(f'[ "$SKYPILOT_NODE_RANK" = 0 ] || kill {remote.pid}', timeout=60)
    assert _left_running(cluster) == []


@needs_local_backend
def test_a_secret_is_masked_in_every_part_of_the_capture_on_every_node(cluster: Cluster) -> None:
    """A task's secret on a command line, here and on the node a rank's ssh reaches (whose
    process holds it in no environment: the values come from the client, through the head),
    and in what the rank printed: the capture shows ``***`` wherever the value would stand."""
    canary = "canary-" + os.urandom(6).hex()
    worker = cluster.node_ips[1]
    run = (
        HANG
        + 'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then echo "token $API_TOKEN"; '
        + f'ssh {worker} "cat > hang.py" < ~/hang.py && exec ssh {worker} python3 hang.py "--token=$API_TOKEN"; fi\n'
        + 'echo "worker done"'
    )
    task = pytest_sky.Task(run=run, num_nodes=2, secrets={"API_TOKEN": canary})
    with pytest.raises(RunTimeoutError) as info:
        cluster.run(task, timeout=8)
    capture = info.value.capture
    assert [r.state for r in capture.ranks] == ["running", "exited (0)"]
    (remote,) = _pythons(capture, 1)
    assert remote.argv == ("python3", "hang.py", "--token=***")
    _assert_sleeping_in_main(remote)
    assert f"ssh {worker} python3 hang.py --token=***" in _pythons_and_leaves(capture, 0)
    assert "token ***" in capture.ranks[0].last_lines
    for shown in (capture.summary(), capture.full(), capture.to_json(), str(info.value)):
        assert canary not in shown
    cluster.run(f'[ "$SKYPILOT_NODE_RANK" = 0 ] || kill {remote.pid}', timeout=60)
    assert _left_running(cluster) == []


def _pythons_and_leaves(capture: Capture, rank: int) -> str:
    (node,) = [n for n in capture.nodes if n.rank == rank]
    return " ".join(p.command for p in node.processes)


@needs_local_backend
def test_a_wait_past_its_bound_says_where_the_jobs_ranks_are_and_the_job_goes_on(cluster: Cluster) -> None:
    job = cluster.submit(HANG + "exec python3 ~/hang.py")
    deadline = time.monotonic() + 60
    while "ready" not in job.logs() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        with pytest.raises(RunTimeoutError) as info:
            job.wait(0.5)
        capture = info.value.capture
        assert [r.state for r in capture.ranks] == ["running", "running"]
        for rank in (0, 1):
            _assert_sleeping_in_main(*_pythons(capture, rank))
        assert "when Job.wait gave up after 0.5 s" in capture.summary()
        assert job.status == "RUNNING"
    finally:
        job.cancel()
    assert _left_running(cluster) == []


@needs_local_backend
def test_a_run_that_ends_by_itself_captures_nothing(cluster: Cluster) -> None:
    assert cluster.run_timeout is None  # outside pytest's fixtures a run has no deadline of its own
    cluster.stopped.clear()
    assert cluster.run("true", timeout=60).ok
    assert cluster.stopped == []


def test_pods_without_ptrace_say_where_their_ranks_wait(emu: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on emulated pods, which hold no SYS_PTRACE (DESIGN.md section 8): the
    stacks come from the interpreters themselves."""
    pytest.importorskip("kubernetes", reason="pip install kubernetes")
    from pytest_sky.backends.privileges import POD_CAPABILITIES

    assert "SYS_PTRACE" not in POD_CAPABILITIES
    monkeypatch.setenv("KUBECONFIG", str(emu.kubeconfig_path))  # type: ignore[attr-defined]
    c = pytest_sky.launch(num_nodes=2, name=f"hang-k8s-{os.getpid() % 10000}", backend="kubernetes")
    try:
        worker = c.node_ips[1]
        run = HANG + _over_ssh(worker) + "exec python3 ~/hang.py"
        with pytest.raises(RunTimeoutError) as info:
            c.run(run, timeout=15)
        capture = info.value.capture
        assert capture.error is None and [r.state for r in capture.ranks] == ["running", "running"]
        remote, own = sorted(_pythons(capture, 1), key=lambda p: p.argv)
        for proc in (remote, own):
            _assert_sleeping_in_main(proc)
    finally:
        c.down()
