"""The head's job queue, as SkyPilot's: first in, first out, each job holding its CPUs.

SkyPilot's ``test_large_job_queue`` (``tests/smoke_tests/test_cluster_job.py``) submits 75
jobs of 0.5 CPU to an 8-CPU cluster and cancels the first 16: then jobs 17-32 run and 43 wait.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky import Cluster, Task
from tests.plugin_helpers import needs_local_backend

pytestmark = needs_local_backend


@pytest.fixture
def eight_cpus(home: Path) -> Iterator[Cluster]:
    cluster = pytest_sky.launch(num_nodes=1, cpus=8, name=f"jq{os.getpid() % 10000}")
    try:
        yield cluster
    finally:
        cluster.down()


def statuses(cluster: Cluster) -> dict[int, str]:
    return {job["id"]: job["status"] for job in cluster.queue()}


def settle(cluster: Cluster, ready, timeout: float = 60) -> dict[int, str]:
    """The queue once ``ready(queue)`` holds: started jobs change their own records."""
    deadline = time.monotonic() + timeout
    while not ready(now := statuses(cluster)):
        assert time.monotonic() < deadline, now
    return now


@pytest.mark.long(6)
def test_seventy_five_jobs_on_eight_cpus_run_sixteen_at_a_time_in_order(eight_cpus: Cluster):
    jobs = [eight_cpus.submit(f"echo {i}; exec sleep 600") for i in range(1, 76)]
    assert [j.id for j in jobs] == list(range(jobs[0].id, jobs[0].id + 75))
    queue = settle(eight_cpus, lambda q: sum(s == "RUNNING" for s in q.values()) == 16)
    assert [queue[j.id] for j in jobs] == ["RUNNING"] * 16 + ["PENDING"] * 59
    for job in jobs[:16]:
        job.cancel()
    queue = settle(eight_cpus, lambda q: sum(s == "RUNNING" for s in q.values()) == 16)
    assert [queue[j.id] for j in jobs] == ["CANCELLED"] * 16 + ["RUNNING"] * 16 + ["PENDING"] * 43


def test_a_job_that_waited_for_its_turn_when_its_cluster_stopped_is_failed_driver(home: Path):
    """As sky: every job whose agent the stop ended is FAILED_DRIVER, the pending one too (it
    stayed PENDING for good when the check waited for a pending job to be 30 s old: a loaded
    machine's `exec -d; stop` often stopped it before its turn)."""
    from pytest_sky.cli.power import start_cluster, stop_cluster
    from pytest_sky.state import StateStore

    cluster = pytest_sky.launch(num_nodes=1, cpus=1, name=f"jq3{os.getpid() % 10000}")
    try:
        first = cluster.submit(Task(run="exec sleep 600", resources={"cpus": 1}))
        waiting = cluster.submit("true")
        settle(cluster, lambda q: q[first.id] == "RUNNING" and q[waiting.id] == "PENDING")
        store = StateStore()
        stop_cluster(store, store.load(cluster.name))
        start_cluster(store, store.load(cluster.name))
        assert {j: (info["status"], info.get("failed_phase")) for j, info in _records(cluster).items()} == {
            first.id: ("FAILED", "driver"),
            waiting.id: ("FAILED", "driver"),
        }
    finally:
        cluster.down()


def _records(cluster: Cluster) -> dict[int, dict]:
    return {job["id"]: job for job in cluster.queue()}


def test_a_job_holds_the_cpus_its_task_asks_for_and_a_run_waits_its_turn(home: Path):
    cluster = pytest_sky.launch(num_nodes=2, cpus=2, name=f"jq2{os.getpid() % 10000}")
    try:
        big = cluster.submit(Task(run="exec sleep 600", num_nodes=2, resources={"cpus": 2}))
        small = cluster.submit("true")  # 0.5 CPU: it would fit, but it came second
        settle(cluster, lambda q: q[big.id] == "RUNNING")
        waiting = cluster.submit("exec sleep 600")
        assert statuses(cluster)[small.id] == "PENDING"
        assert waiting.cancel() == "CANCELLED"  # a pending job is cancelled where it waits
        big.cancel()
        assert small.wait(30) == "SUCCEEDED"
        result = cluster.run("echo ran-$SKYPILOT_NODE_RANK")  # attached runs queue too: none left
        assert result.returncode == 0 and [r.stdout for r in result.ranks] == ["ran-0\n", "ran-1\n"]
    finally:
        cluster.down()


def test_without_a_cpu_count_every_job_starts_at_once(home: Path):
    cluster = pytest_sky.launch(num_nodes=1, name=f"jq3{os.getpid() % 10000}")
    try:
        jobs = [cluster.submit("exec sleep 600") for _ in range(6)]
        queue = settle(cluster, lambda q: all(q[j.id] != "PENDING" for j in jobs))
        assert [queue[j.id] for j in jobs] == ["RUNNING"] * 6
    finally:
        cluster.down()


def test_gpu_fractions_share_a_gpu_as_skypilots_multi_echo(home: Path, start_emulator):
    """On a node of one GPU, jobs asking for half of it run two at a time (pods: GPUs exist)."""
    emu = start_emulator(nodes=1, gpus_per_node=1)
    options = {"kubeconfig": str(emu.kubeconfig_path)}
    name = f"jqg{os.getpid() % 10000}"
    cluster = pytest_sky.launch(num_nodes=1, name=name, backend="kubernetes", backend_options=options, gpus="V100:1")
    try:
        half = Task(run="exec sleep 600", resources={"accelerators": "V100:0.5"})
        jobs = [cluster.submit(half) for _ in range(3)]
        no_gpu = cluster.submit("true")  # asks for no GPU, but waits its turn behind them
        queue = settle(cluster, lambda q: sum(s == "RUNNING" for s in q.values()) == 2)
        assert [queue[j.id] for j in [*jobs, no_gpu]] == ["RUNNING", "RUNNING", "PENDING", "PENDING"]
        jobs[0].cancel()
        assert no_gpu.wait(60) == "SUCCEEDED"
        assert statuses(cluster)[jobs[2].id] == "RUNNING"
    finally:
        cluster.down()


def test_a_job_that_starts_rings_the_jobs_waiting_behind_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Job 2 waited only for job 1 to go first: job 1's start must wake it, not job 1's end
    (a job asking for no GPU behind a GPU job would otherwise wait out that job)."""
    import threading

    from pytest_sky import procs
    from pytest_sky.agent import queue
    from pytest_sky.protocol import JobRecord, JobStatus, RunSpec

    monkeypatch.setenv("HOME", str(tmp_path))
    jobs = tmp_path / ".sky" / "jobs"
    for job_id in ("1", "2"):
        (jobs / job_id).mkdir(parents=True)
    queue.Doorbell(str(jobs / "2"))  # job 2 is waiting: its bell is there, held open
    me = os.getpid()
    (jobs / "queue").write_text(f"2 {me} {procs.start_time(me)} 0.5 0.0 P\n")
    spec = RunSpec(cluster="c", task_name="t", nodes=[])
    first = JobRecord(id=1, status=JobStatus.PENDING)
    assert queue.take_turn(first, str(jobs / "1"), spec, threading.Event(), []) is True
    listener = os.open(jobs / "2" / queue.BELL, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert os.read(listener, 16) == b"!"
    finally:
        os.close(listener)
