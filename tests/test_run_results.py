"""What a run returns and raises, as a pytest user reads it: ``check=True``, stdout and stderr
apart (every way a rank is started: the first run's exec and ssh, later runs' agent servers),
``Job.result()`` that waits, and the names ``pytest_sky`` exports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import pytest_sky
from pytest_sky import Job, JobStatus, RunError, RunFailedError, require_on_nodes
from pytest_sky.errors import RunTimeoutError
from tests.plugin_helpers import needs_local_backend

pytestmark = needs_local_backend


@pytest.fixture
def fresh(home: Path) -> pytest_sky.Cluster:
    """A cluster no run has used yet: its first run execs the agent and reaches the worker
    over ssh, its second starts the worker's server, its third goes through both servers."""
    with pytest_sky.launch(num_nodes=2) as c:
        yield c


def test_stdout_and_stderr_apart_on_every_way_a_rank_starts(fresh: pytest_sky.Cluster) -> None:
    script = "echo out-$SKYPILOT_NODE_RANK; echo err-$SKYPILOT_NODE_RANK >&2; echo out2; printf 'no end' >&2"
    for attempt in range(3):
        res = fresh.run(script)
        assert res.returncode == 0, res.output
        for r in res.ranks:
            assert r.stdout == f"out-{r.rank}\nout2\n", (attempt, r)
            assert r.stderr == f"err-{r.rank}\nno end\n", (attempt, r)
            assert sorted(r.output.splitlines()) == sorted(f"out-{r.rank}\nout2\nerr-{r.rank}\nno end".split("\n"))
        # The merged log keeps every line of both streams, prefixed.
        assert sum(") err-" in line for line in res.output.splitlines()) == 2
        assert sum(") out-" in line for line in res.output.splitlines()) == 2


def test_a_rank_that_writes_much_to_both_streams_keeps_each_streams_order(fresh: pytest_sky.Cluster) -> None:
    script = "for i in $(seq 3000); do echo out $i; echo err $i >&2; done"
    for _ in range(3):
        res = fresh.run(script, timeout=120)
        assert res.returncode == 0, res.error
        for r in res.ranks:
            assert r.stdout.splitlines() == [f"out {i}" for i in range(1, 3001)]
            assert r.stderr.splitlines() == [f"err {i}" for i in range(1, 3001)]


def test_check_raises_naming_the_rank_and_its_last_lines(fresh: pytest_sky.Cluster) -> None:
    assert fresh.run("exit 3").returncode == 3  # without check: the result, as before
    with pytest.raises(RunError) as caught:  # RunFailedError is a RunError
        fresh.run("echo fine; [ $SKYPILOT_NODE_RANK = 1 ] || exit 0; echo step-one; echo boom >&2; exit 3", check=True)
    exc = caught.value
    assert isinstance(exc, RunFailedError)
    assert exc.result.returncode != 0 and exc.result.ranks[1].returncode == 3
    first, *tail = str(exc).splitlines()
    assert f"rank 1 (worker1, {fresh.node_ips[1]}) exited with code 3" in first, first
    assert [line.strip() for line in tail] == ["fine", "step-one", "boom"]
    assert fresh.results[-1] is exc.result  # kept for the failure report, raised or not
    assert fresh.run("true", check=True).ok


def test_job_result_waits_for_the_end(fresh: pytest_sky.Cluster) -> None:
    job = fresh.submit("sleep 1; echo done-$SKYPILOT_NODE_RANK; echo late >&2")
    assert isinstance(job, Job)
    result = job.result()
    assert job.status is JobStatus.SUCCEEDED
    assert [r.stdout for r in result.ranks] == ["done-0\n", "done-1\n"]
    assert [r.stderr for r in result.ranks] == ["late\n", "late\n"]
    slow = fresh.submit("sleep 30")
    with pytest.raises(RunTimeoutError, match="still"):
        slow.result(timeout=0.5)
    slow.cancel()


def test_the_public_names_import_from_the_package_and_it_ships_its_types() -> None:
    assert issubclass(RunFailedError, RunError) and callable(require_on_nodes)
    names = ["Job", "JobStatus", "RunError", "RunFailedError", "require_on_nodes"]
    assert set(names) <= set(pytest_sky.__all__)
    # Importing them costs no cluster machinery until used (a fresh interpreter).
    code = "import sys, pytest_sky; from pytest_sky import RunError; print('pytest_sky.cluster' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    assert (Path(pytest_sky.__file__).parent / "py.typed").is_file()
