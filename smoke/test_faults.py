"""Training under faults: a collective across a partition, an all_reduce over a slow link, a
node that crashes mid-training and comes back.

Each test runs an example from ``examples/`` on a real cluster, breaks it with the fault API
(``Cluster.partition``, ``Cluster.degrade``, ``Cluster.kill_node``/``restart_node``) and
asserts on what the ranks printed: a gloo all_reduce whose peer is cut off fails within its
configured timeout, naming its rank, instead of hanging; an all_reduce over a link capped by
``degrade(rate_mbit=...)`` is measurably slower than over the same link uncapped; elastic
torchrun training finishes after its rank 1 node was killed and restarted, resuming from its
last checkpoint.  Network faults and restart_node are the local backend's (on Kubernetes
and Slurm they raise NotSupportedError), hence ``no_kubernetes`` and ``no_slurm``.  The elastic test carries no
``multinode`` marker (it asks ``sky_launch`` for its cluster), so ``-k multinode`` leaves its
minute out; ``-k elastic`` selects it.
"""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

import pytest

from pytest_sky import Cluster, RunResult, Task
from pytest_sky.job import Job, JobStatus
from pytest_sky.plugin import require_on_nodes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_TIMEOUT = 120.0  # seconds: torch imports on 2 loaded cores, far below anything that hangs


def _needs_torch(cluster: Cluster) -> None:
    """Asked of the nodes (``require_on_nodes``), not of this client."""
    require_on_nodes(cluster, modules=("torch",), install="pip install 'pytest-sky[torch]'")


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


@pytest.mark.long(12)
@pytest.mark.multinode(num_nodes=2)
@pytest.mark.no_kubernetes
@pytest.mark.no_slurm("a job may not partition or slow the site's network")
def test_allreduce_across_a_partition_fails_naming_the_rank(sky_cluster: Cluster):
    _needs_torch(sky_cluster)
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


@pytest.mark.long(7)
@pytest.mark.multinode(num_nodes=2)
@pytest.mark.no_kubernetes
@pytest.mark.no_slurm("a job may not partition or slow the site's network")
def test_slow_link_lowers_allreduce_bandwidth(sky_cluster: Cluster):
    _needs_torch(sky_cluster)
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


# ------------------------------------------------------------------------ elastic training

ELASTIC = EXAMPLES / "torch_elastic"
ELASTIC_TIMEOUT = 300.0  # seconds: two rendezvous and four torch imports on 2 loaded cores


def _node_agent(task: Task, rank: int, *, carry_workdir: bool) -> Task:
    """The example's torchrun agent of node ``rank`` alone, as a job of its own.

    Each node's agent is its own job so that one node's crash fails only that node's job
    (a job stops all its ranks when one fails, which would stop the survivor's agent too).
    Only the first submission carries the workdir: a second copy replaces ``~/sky_workdir``,
    the directory the head's agent runs in and starts its next workers from; later ones run
    in the copy the nodes already have (it survives a restart, as a disk does).
    """
    run = task.run if carry_workdir else f"cd ~/sky_workdir\n{task.run}"
    return Task(
        run=run,
        num_nodes=task.num_nodes,
        envs={**task.envs, "ELASTIC_NODE_RANK": str(rank)},
        name=f"{task.name}-node{rank}",
        workdir=task.workdir if carry_workdir else None,
    )


def _on_head(cluster: Cluster, script: str, ok: tuple[int, ...] = (0,)) -> RunResult:
    """``script`` on the head alone (a one-node task), its exit code one of ``ok``."""
    res = cluster.run(Task(run=script, num_nodes=1), timeout=30)
    assert res.returncode in ok, f"{res.error}\n{res.output}"
    return res


def _wait_for_checkpoint(cluster: Cluster, path: str, jobs: list[Job]) -> None:
    """Until ``path`` exists on the head (training got that far), failing as soon as a job ended.

    Each probe watches for the file for up to 5 s on the head, so the wait notices it within
    0.1 s, and the jobs are looked at between probes.
    """
    probe = f"for _ in $(seq 50); do [ -e {shlex.quote(path)} ] && exit 0; sleep 0.1; done; exit 1"
    deadline = time.monotonic() + ELASTIC_TIMEOUT
    while _on_head(cluster, probe, ok=(0, 1)).returncode != 0:
        ended = [job for job in jobs if job.status not in (JobStatus.PENDING, JobStatus.RUNNING)]
        if ended:
            pytest.fail(f"a job ended before {path} was written\n{_job_logs(jobs)}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {path} after {ELASTIC_TIMEOUT:g} s\n{_job_logs(jobs)}")


def _job_logs(jobs: list[Job]) -> str:
    return "\n".join(f"--- job {job.id} ({job.status}: {job.error})\n{job.logs()}" for job in jobs)


def _progress(cluster: Cluster, ckpt_dir: str) -> list[dict[str, str]]:
    """Every node's progress lines, in time order (all nodes share this machine's clock)."""
    out = _on_head(cluster, f"cat {shlex.quote(ckpt_dir)}/progress/*.log").ranks[0].stdout
    lines = [{"tag": line.split()[0], **_fields(line)} for line in out.splitlines() if line.strip()]
    return sorted(lines, key=lambda f: float(f["t"]))


def _fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


@pytest.mark.long(44)
@pytest.mark.no_kubernetes  # restart_node is the local backend's
@pytest.mark.no_slurm("a job may not kill or restart a node of the site")
def test_elastic_training_resumes_from_checkpoint_after_node_restart(sky_launch):
    """Kill rank 1 mid-training, restart it: training finishes every step, the restarted
    node rejoins with a new torchrun agent, and training resumes after the last checkpoint.

    Each node's torchrun agent is a job of its own (see ``_node_agent``): the crash fails
    node 1's job, naming rank 1, while the head's agent lives on, restarts its worker and
    waits at the rendezvous; the test then plays the restarted machine's supervisor and
    starts node 1's agent again.  Mid-training is a real signal: the checkpoint file of
    step ``2 * ELASTIC_CKPT_EVERY - 1`` exists in the shared directory.
    """
    cluster = sky_launch(num_nodes=2, shared_dir="/mnt/shared")
    _needs_torch(cluster)
    task = Task.from_yaml(ELASTIC / "task.yaml")
    steps, every = int(task.envs["ELASTIC_STEPS"]), int(task.envs["ELASTIC_CKPT_EVERY"])
    ckpt_dir = task.envs["CKPT_DIR"]
    wait_step = 2 * every - 1  # the second checkpoint: mid-training, with one before it
    jobs = [cluster.submit(_node_agent(task, 0, carry_workdir=True))]
    jobs.append(cluster.submit(_node_agent(task, 1, carry_workdir=False)))
    _wait_for_checkpoint(cluster, f"{ckpt_dir}/step-{wait_step:06d}.pt", jobs)

    killed_at = time.time()
    cluster.kill_node(1)
    assert jobs[1].wait(30) == JobStatus.FAILED, _job_logs(jobs)
    assert "rank 1" in (jobs[1].error or ""), jobs[1].error
    cluster.restart_node(1)
    jobs.append(cluster.submit(_node_agent(task, 1, carry_workdir=False)))
    for job in (jobs[0], jobs[2]):
        assert job.wait(ELASTIC_TIMEOUT) == JobStatus.SUCCEEDED, _job_logs(jobs)

    events = _progress(cluster, ckpt_dir)
    print(_check_elastic_recovery(events, cluster.node_names, steps, wait_step, killed_at))


def _check_elastic_recovery(
    events: list[dict[str, str]], hosts: list[str], steps: int, wait_step: int, killed_at: float
) -> str:
    """What the progress lines must show (see the test's docstring); a summary of them."""
    starts = [e for e in events if e["tag"] == "START"]
    before = [e for e in starts if float(e["t"]) < killed_at]
    after = [e for e in starts if float(e["t"]) > killed_at]
    assert {e["host"] for e in before} == set(hosts), before
    last_before = max(int(e["step"]) for e in events if e["tag"] == "STEP" and float(e["t"]) < killed_at)
    assert last_before < steps - 1, f"training ended (step {last_before}) before node 1 was killed"
    for start in after:  # every worker started after the kill resumed from the newest checkpoint
        newest = max(int(e["step"]) for e in events if e["tag"] == "CKPT" and float(e["t"]) < float(start["t"]))
        assert newest >= wait_step and int(start["resume_from"]) == newest, (start, newest)
        own = [int(e["step"]) for e in events if e["tag"] == "STEP" and e["worker"] == start["worker"]]
        assert own[:1] in ([], [newest + 1]), (start, own)  # the step after it, not step 0
    finished = [e for e in events if e["tag"] == "DONE"]
    assert sorted(e["host"] for e in finished) == sorted(hosts), finished
    for done in finished:  # the group that finished did every step after its checkpoint, once
        start = next(e for e in after if e["worker"] == done["worker"])
        own = [int(e["step"]) for e in events if e["tag"] == "STEP" and e["worker"] == done["worker"]]
        assert own == list(range(int(start["resume_from"]) + 1, steps)), (done, own)
        assert int(done["world"]) == len(hosts), done
    # The restarted node rejoined: its steps after the crash came from a new torchrun agent.
    ((old_agent, old_pid),) = {(e["agent"], e["agent_pid"]) for e in before if e["host"] == hosts[1]}
    (new_done,) = [e for e in finished if e["host"] == hosts[1]]
    assert new_done["agent"] != old_agent, (old_agent, new_done)
    assert [int(e["step"]) for e in events if e["tag"] == "CKPT"][-1] == steps - 1
    resumed = min(float(e["t"]) for e in events if e["tag"] == "STEP" and float(e["t"]) > killed_at)
    return (
        f"node 1 killed after step {last_before}; {len(after)} worker(s) started after it, the group that "
        f"finished resumed at step {int(start['resume_from']) + 1} {resumed - killed_at:.1f} s after the kill; "
        f"node 1's torchrun pid {old_pid} before, {new_done['agent_pid']} after"
    )
