"""Training under network faults: a collective across a partition, an all_reduce over a slow link.

Each test runs an example from ``examples/`` on a real cluster, breaks the network with the
fault API (``Cluster.partition``, ``Cluster.degrade``) and asserts on what the ranks printed:
a gloo all_reduce whose peer is cut off fails within its configured timeout, naming its rank,
instead of hanging; an all_reduce over a link capped by ``degrade(rate_mbit=...)`` is
measurably slower than over the same link uncapped.  Network faults are the local backend's
(on Kubernetes they raise NotSupportedError), hence ``no_kubernetes``.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from pytest_sky import Cluster, Task
from pytest_sky.job import JobStatus

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_TIMEOUT = 120.0  # seconds: torch imports on 2 loaded cores, far below anything that hangs


def _needs_torch() -> None:
    pytest.importorskip("torch", reason="torch is not installed (pip install 'pytest-sky[torch]')")


def _wait_for_lines(job, text: str, count: int, timeout: float = RUN_TIMEOUT) -> None:
    """Follow the job's log until ``count`` lines contain ``text`` (every rank got that far)."""
    seen = 0
    deadline = time.monotonic() + timeout
    for line in job.logs(follow=True):
        seen += text in line
        if seen >= count:
            return
        assert time.monotonic() < deadline, f"only {seen} of {count} ranks printed {text!r}\n{job.logs()}"
    pytest.fail(f"job ended before {count} ranks printed {text!r}: {job.error}\n{job.logs()}")


@pytest.mark.multinode(num_nodes=2)
@pytest.mark.no_kubernetes
def test_allreduce_across_a_partition_fails_naming_the_rank(sky_cluster: Cluster):
    _needs_torch()
    task = Task.from_yaml(EXAMPLES / "partition_allreduce" / "task.yaml")
    gloo_timeout = float(task.envs["GLOO_TIMEOUT_S"])
    job = sky_cluster.submit(task)
    _wait_for_lines(job, "STEP 1", 2)  # both ranks are in the loop: the link carries it
    start = time.monotonic()
    sky_cluster.partition([0], [1])
    status = job.wait(gloo_timeout + 30)
    elapsed = time.monotonic() - start
    log = job.logs()
    assert status == JobStatus.FAILED, log
    # Failed by gloo's own timeout (not by hanging until ours), with slack for a loaded host.
    assert elapsed < gloo_timeout + 10, (elapsed, log)
    failed = re.findall(r"FAILED rank=(\d+) step=\d+ after_s=([\d.]+) error=(.*)", log)
    assert failed, log
    for _, after_s, _ in failed:
        assert float(after_s) >= gloo_timeout * 0.8, failed  # it waited for the timeout, as configured
    ranks = {int(r) for r, _, _ in failed}
    assert any(f"rank {r}" in (job.error or "") for r in ranks), (job.error, failed)
    print(f"all_reduce across a partition: failed after {elapsed:.1f} s ({job.error})")


def _gbps(cluster: Cluster, task: Task) -> float:
    small = {"ALLREDUCE_MIB": "8", "ALLREDUCE_WARMUPS": "1", "ALLREDUCE_RUNS": "3"}
    res = cluster.run(task, env=small, timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.output
    (line,) = [x for x in res.ranks[0].stdout.splitlines() if x.startswith("GBPS ")]
    assert all("correct=1" in r.stdout for r in res.ranks), res.output
    return float(line.split()[1])


@pytest.mark.multinode(num_nodes=2)
@pytest.mark.no_kubernetes
def test_slow_link_lowers_allreduce_bandwidth(sky_cluster: Cluster):
    _needs_torch()
    task = Task.from_yaml(EXAMPLES / "allreduce_bandwidth" / "task.yaml")
    cap_mbit = 100  # 0.0125 GB/s each way
    fast = _gbps(sky_cluster, task)
    sky_cluster.degrade(1, rate_mbit=cap_mbit)
    slow = _gbps(sky_cluster, task)
    sky_cluster.heal()
    # A 2-rank all_reduce moves the tensor's size each way: its bandwidth is the link's.
    assert slow < 1.5 * cap_mbit / 8 / 1000, (fast, slow)
    assert fast / slow > 5, (fast, slow)
    print(f"all_reduce 8 MiB between 2 nodes: {fast:.3f} GB/s, capped at {cap_mbit} Mbit/s: {slow:.3f} GB/s")
