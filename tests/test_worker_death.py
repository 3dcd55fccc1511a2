"""A worker that dies mid-job fails the job within seconds, naming the rank; nothing is left."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

import pytest_sky
from pytest_sky.job import JobStatus
from tests.contract import JOB_FAILS_WITHIN_S, within_promise
from tests.leftovers import live_nodes, our_links


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path))
    c = pytest_sky.launch(num_nodes=3, name=f"fault-{os.getpid() % 10000}-{time.monotonic_ns() % 1000}")
    c.run("true")  # connection and head-to-worker masters up: the fault is the only slow thing
    data = c.journal.load()
    yield c
    c.down()
    assert our_links(tmp_path) == []
    assert live_nodes(data) == []


def wait_running(job, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while job.status != JobStatus.RUNNING:
        assert time.monotonic() < deadline, "job did not start"
        time.sleep(0.05)


def node_has(cluster, rank: int, pattern: str) -> bool:
    init = cluster.journal.load()["nodes"][rank]["init_pid"]
    proc = subprocess.run(
        ["nsenter", "-t", str(init), "-p", "-m", "pgrep", "-f", pattern], capture_output=True, check=False
    )
    return proc.returncode == 0


def wait_for_process(cluster, rank: int, pattern: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not node_has(cluster, rank, pattern):
        assert time.monotonic() < deadline, f"{pattern} never started on rank {rank}"
        time.sleep(0.02)


def test_worker_processes_killed(cluster):
    job = cluster.submit("sleep 77")
    wait_running(job)
    wait_for_process(cluster, 1, "^sleep 77")
    init = cluster.journal.load()["nodes"][1]["init_pid"]
    start = time.monotonic()
    subprocess.run(["nsenter", "-t", str(init), "-p", "-m", "pkill", "-KILL", "-f", "^sleep 77"], check=True)
    assert job.wait(15) == JobStatus.FAILED
    took = time.monotonic() - start
    assert took < JOB_FAILS_WITHIN_S, within_promise(took)
    assert "rank 1" in job.error and "137" in job.error
    for rank in (0, 2):  # the other ranks were stopped
        assert not node_has(cluster, rank, "^sleep 77")


def test_worker_sshd_killed(cluster):
    """Killing a node's sshd (its first process) ends the whole node, as a crashed machine."""
    job = cluster.submit("sleep 78")
    wait_running(job)
    wait_for_process(cluster, 2, "^sleep 78")
    init = cluster.journal.load()["nodes"][2]["init_pid"]
    start = time.monotonic()
    os.kill(init, signal.SIGKILL)
    assert job.wait(15) == JobStatus.FAILED
    took = time.monotonic() - start
    assert took < JOB_FAILS_WITHIN_S, within_promise(took)
    assert "rank 2" in job.error, job.error
    for rank in (0, 1):
        assert not node_has(cluster, rank, "^sleep 78")


def test_attached_run_reports_a_lost_worker(cluster):
    init = cluster.journal.load()["nodes"][1]["init_pid"]
    killer = subprocess.Popen(
        ["bash", "-c", f"until nsenter -t {init} -p -m pgrep -f '^sleep 79' >/dev/null; do :; done; kill -9 {init}"]
    )
    start = time.monotonic()
    res = cluster.run("sleep 79", timeout=30)
    killer.wait(10)
    took = time.monotonic() - start
    assert took < JOB_FAILS_WITHIN_S + 1, within_promise(took, JOB_FAILS_WITHIN_S + 1)  # +1: the killer's own start
    assert res.returncode != 0
    assert "rank 1" in res.error
