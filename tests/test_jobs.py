"""Detached jobs: they live on the head, report status, logs and results, and can be cancelled."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky.errors import RunTimeoutError
from pytest_sky.job import JobStatus


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    home = tmp_path_factory.mktemp("jobs-home")
    old = os.environ.get("PYTEST_SKY_HOME")
    os.environ["PYTEST_SKY_HOME"] = str(home)
    c = pytest_sky.launch(num_nodes=2, name=f"jobs-{os.getpid() % 10000}")
    yield c
    c.down()
    if old is None:
        os.environ.pop("PYTEST_SKY_HOME", None)
    else:
        os.environ["PYTEST_SKY_HOME"] = old


def test_submit_returns_at_once_and_the_job_finishes(cluster):
    # The job cannot end before this test lets it (a file it waits for on every node): that
    # submit returned while it runs is then shown by its status, whatever the machine's load.
    cluster.run("rm -f ~/go")
    job = cluster.submit("until [ -e ~/go ]; do sleep 0.05; done; echo done-$SKYPILOT_NODE_RANK")
    assert job.status in (JobStatus.PENDING, JobStatus.RUNNING)
    cluster.run("touch ~/go")
    assert job.wait(30) == JobStatus.SUCCEEDED
    result = job.result()
    assert result is not None and result.returncode == 0
    assert [r.stdout for r in result.ranks] == ["done-0\n", "done-1\n"]
    assert "(head, rank=0, pid=" in job.logs() and ") done-1" in job.logs()


def test_logs_follow_streams_until_the_end(cluster):
    job = cluster.submit('for i in 1 2 3; do echo "tick $i"; sleep 0.2; done')
    lines = list(job.logs(follow=True))
    assert [line.split(") ", 1)[1] for line in lines if "rank=0" in line] == ["tick 1", "tick 2", "tick 3"]
    assert job.status == JobStatus.SUCCEEDED


def test_job_ids_increase_and_the_queue_lists_them(cluster):
    a = cluster.submit("true")
    b = cluster.submit("true")
    assert b.id == a.id + 1
    a.wait(30), b.wait(30)
    queue = {j["id"]: j["status"] for j in cluster.queue()}
    assert queue[a.id] == queue[b.id] == "SUCCEEDED"


def test_failing_rank_fails_the_job_and_names_it(cluster):
    # The other rank would run for ten minutes: the job's end within the wait is its stop.
    job = cluster.submit('if [ "$SKYPILOT_NODE_RANK" = 1 ]; then exit 7; fi; sleep 600')
    assert job.wait(120) == JobStatus.FAILED
    assert "rank 1" in job.error and "exit code 7" in job.error


def test_cancel_stops_every_rank(cluster):
    marker = f"{time.monotonic_ns() % 100000}"
    job = cluster.submit(f"echo up; sleep 9{marker}")
    deadline = time.monotonic() + 20
    while job.logs().count(") up") < 2:  # both ranks are running: the cancel stops a live job
        assert time.monotonic() < deadline, f"the job never ran on both ranks: {job.logs()}"
        time.sleep(0.05)
    assert job.status == JobStatus.RUNNING
    running = cluster.run(f"pgrep -fx 'sleep 9{marker}' | wc -l")
    assert [r.stdout.strip() for r in running.ranks] == ["1", "1"]
    assert job.cancel() == JobStatus.CANCELLED
    left = cluster.run(f"pgrep -fx 'sleep 9{marker}' | wc -l")
    assert [r.stdout.strip() for r in left.ranks] == ["0", "0"]


def test_wait_timeout_says_what_it_waited_for(cluster):
    job = cluster.submit("sleep 30")
    with pytest.raises(RunTimeoutError, match=rf"job {job.id} .* still RUNNING after 0.5 s"):
        job.wait(0.5)
    job.cancel()


def test_job_survives_the_client_disconnecting(cluster, tmp_path: Path):
    job = cluster.submit("sleep 1; echo survived")
    cluster._client.close()  # the client goes away; the job does not
    again = pytest_sky.get_cluster(cluster.name)
    assert again.job(job.id).wait(30) == JobStatus.SUCCEEDED
    assert "survived" in again.job(job.id).logs()


def test_detached_ssh_to_workers_needs_no_agent(cluster):
    """mpirun's case: a detached job on the head reaches workers over SSH, no ssh-agent."""
    job = cluster.submit(
        "unset SSH_AUTH_SOCK SSH_AGENT_PID\n"
        'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then ssh "$(echo "$SKYPILOT_NODE_IPS" | tail -n1)" hostname; fi'
    )
    assert job.wait(30) == JobStatus.SUCCEEDED
    assert job.result().ranks[0].stdout.strip() == f"{cluster.name}-worker1"
