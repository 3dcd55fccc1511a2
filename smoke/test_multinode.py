"""The multi-node smoke suite: what SkyPilot's Kubernetes PR and MPI issue asked to see.

Each test is marked ``multinode`` (so ``pytest smoke -k multinode`` selects it) and asserts
on what every rank printed, not only on exit codes.  The same tests run on every backend.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from pytest_sky import Task, run_command_in_parallel
from pytest_sky.plugin import require_on_nodes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.multinode(num_nodes=2)
def test_echo_hi_on_two_nodes(sky_cluster):
    res = sky_cluster.run("echo hi")
    assert res.returncode == 0, res.output
    lines = res.output.splitlines()
    assert len(lines) == 2, res.output
    worker_ip = sky_cluster.node_ips[1]
    assert any(re.fullmatch(r"\(head, rank=0, pid=\d+\) hi", line) for line in lines), lines
    assert any(re.fullmatch(rf"\(worker1, rank=1, pid=\d+, ip={re.escape(worker_ip)}\) hi", line) for line in lines), (
        lines
    )
    assert [r.stdout for r in res.ranks] == ["hi\n", "hi\n"]


@pytest.mark.multinode(num_nodes=2)
def test_nodes_hold_no_kubernetes_credentials(sky_cluster):
    """A task gets no API credentials it was not given: pods mount no ServiceAccount token
    (``automountServiceAccountToken: false``), and local nodes have none either."""
    res = sky_cluster.run("ls /var/run/secrets/kubernetes.io/serviceaccount 2>&1 || true")
    assert res.returncode == 0, res.output
    for rank in res.ranks:
        assert "No such file or directory" in rank.stdout, rank.stdout  # no token, CA or namespace file


@pytest.mark.multinode
@pytest.mark.parametrize("num_nodes", [2, 3])
def test_node_ips_and_ranks(sky_launch, num_nodes):
    cluster = sky_launch(num_nodes=num_nodes)
    res = cluster.run(
        'echo "ips=$(echo "$SKYPILOT_NODE_IPS" | paste -sd,)";'
        'echo "count=$(echo "$SKYPILOT_NODE_IPS" | wc -l)";'
        'echo "rank=$SKYPILOT_NODE_RANK nodes=$SKYPILOT_NUM_NODES task=$SKYPILOT_TASK_ID";'
        "echo \"eth0=$(ip -4 -o addr show dev eth0 | awk '{print $4}' | cut -d/ -f1)\";"
        'echo "mine=$(echo "$SKYPILOT_NODE_IPS" | sed -n "$((SKYPILOT_NODE_RANK + 1))p")"'
    )
    assert res.returncode == 0, res.output
    assert len(cluster.node_ips) == num_nodes
    task_ids = set()
    for rank in res.ranks:
        fields = dict(kv.split("=", 1) for line in rank.stdout.split() if "=" in line for kv in [line])
        assert fields["ips"].split(",") == cluster.node_ips  # rank order, head first
        assert fields["count"] == str(num_nodes)
        assert fields["rank"] == str(rank.rank)
        assert fields["nodes"] == str(num_nodes)
        assert fields["eth0"] == fields["mine"] == cluster.node_ips[rank.rank]
        task_ids.add(fields["task"])
    assert len(task_ids) == 1
    (task_id,) = task_ids
    assert re.fullmatch(rf"sky-[0-9-]+_{re.escape(cluster.name)}_{res.job_id}", task_id), task_id


@pytest.mark.multinode(num_nodes=3)
def test_head_to_worker_ssh_without_agent(sky_cluster):
    """What mpirun needs: from a run section, rank 0 reaches every worker by IP and by name."""
    name = sky_cluster.name
    res = sky_cluster.run(
        "unset SSH_AUTH_SOCK SSH_AGENT_PID\n"
        'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then\n'
        '  for ip in $(echo "$SKYPILOT_NODE_IPS" | tail -n +2); do ssh "$ip" hostname; done\n'
        f"  ssh {name}-worker2 hostname\n"
        "fi\n"
    )
    assert res.returncode == 0, res.output
    # The workers' own hostnames (<cluster>-worker<i> where the backend names its machines).
    hostnames = sky_cluster.node_names
    assert res.ranks[0].stdout.split() == [hostnames[1], hostnames[2], hostnames[2]]


@pytest.mark.multinode(num_nodes=2)
def test_ssh_concurrency_20x10(sky_cluster):
    """The check from SkyPilot's PR: 20 concurrent `ssh <cluster> echo hi`, ten rounds."""
    cmd = ["ssh", "-F", sky_cluster.ssh_config, sky_cluster.name, "echo hi"]
    ok = 0
    rounds = []
    for _ in range(10):
        start = time.monotonic()
        results = run_command_in_parallel(cmd, 20, 20)
        rounds.append(time.monotonic() - start)
        ok += sum(1 for r in results if r.returncode == 0 and r.output.strip() == "hi")
    assert ok == 200, f"{ok}/200 succeeded"
    print(f"20x10 ssh: {ok}/200, rounds {min(rounds):.3f}-{max(rounds):.3f} s")


@pytest.mark.multinode(num_nodes=3)
def test_failing_rank_fails_the_run(sky_cluster):
    # The other ranks would sleep ten minutes: a result within the run's timeout (no
    # RunTimeoutError) is their prompt stop, whatever the machine's load.
    res = sky_cluster.run('if [ "$SKYPILOT_NODE_RANK" = 1 ]; then exit 3; fi; sleep 600; echo survived', timeout=300)
    assert res.returncode == 3
    assert res.error is not None and "rank 1" in res.error and "exit code 3" in res.error, res.error
    assert res.ranks[1].returncode == 3
    assert all(r.returncode != 0 for r in res.ranks)  # the others were stopped, not finished
    assert "survived" not in res.output


@pytest.mark.multinode(num_nodes=2)
def test_detached_job_is_listed_and_cancelled_leaving_nothing(sky_cluster):
    """``sky exec -d``, ``sky queue``, ``sky cancel``: the job runs on, listed, until cancelled,
    and then none of its processes is left on any node."""
    job = sky_cluster.submit("sleep 300")
    assert [(j["id"], j["status"]) for j in sky_cluster.queue()] in ([(job.id, "PENDING")], [(job.id, "RUNNING")])
    assert job.cancel() == "CANCELLED"
    assert [j["status"] for j in sky_cluster.queue()] == ["CANCELLED"]
    left = sky_cluster.run("pgrep -fa 'slee[p] 300' || echo none")
    assert [r.stdout.strip() for r in left.ranks] == ["none", "none"], left.output


@pytest.mark.multinode
def test_example_task_yaml_runs_unmodified(sky_launch):
    cluster = sky_launch(str(EXAMPLES / "hello_multinode" / "task.yaml"))
    res = cluster.last_result
    assert res is not None and res.returncode == 0, res.output if res else None
    assert cluster.num_nodes == 2
    for rank in res.ranks:
        lines = rank.stdout.splitlines()
        assert lines[0] == f"setup rank {rank.rank} of 2 on {cluster.node_names[rank.rank]}"
        assert lines[1] == (
            f"hello from rank {rank.rank} of 2 on {cluster.node_names[rank.rank]}; head is {cluster.node_ips[0]}"
        )
        assert lines[2] == "the workdir arrived"


@pytest.mark.multinode
def test_torch_gloo_allreduce_across_nodes(sky_launch):
    task = Task.from_yaml(EXAMPLES / "torch_allreduce" / "task.yaml")
    cluster = sky_launch(num_nodes=task.num_nodes)
    require_on_nodes(cluster, modules=["torch"], install=TORCH_INSTALL)
    res = cluster.run(task)
    assert res.returncode == 0, res.output
    reported = [[line for line in r.stdout.splitlines() if line.startswith("rank=")] for r in res.ranks]
    assert reported == [["rank=0 world=2 sum=3"], ["rank=1 world=2 sum=3"]], res.output


TORCH_INSTALL = "pip install 'pytest-sky[torch]'"


def _checkpoint_run(sky_launch, shared_dir: str | None = None):
    """The checkpoint example on a fresh cluster whose nodes have torch (else skipped)."""
    task = Task.from_yaml(EXAMPLES / "checkpoint_shared" / "task.yaml")
    cluster = sky_launch(num_nodes=task.num_nodes, shared_dir=shared_dir)
    require_on_nodes(cluster, modules=["torch"], install=TORCH_INSTALL)
    return cluster.run(task)


@pytest.mark.multinode
def test_checkpoint_saved_on_rank0_loads_everywhere_from_a_shared_dir(sky_launch, sky_settings):
    if sky_settings.backend == "kubernetes" and not sky_settings.kube_shared_pvc:
        pytest.skip("shared_dir on Kubernetes needs a ReadWriteMany claim: pass --kube-shared-pvc NAME")
    res = _checkpoint_run(sky_launch, shared_dir="/mnt/shared")
    assert res.returncode == 0, res.output
    sums = {line.split("checksum=")[1] for r in res.ranks for line in r.stdout.splitlines() if "checksum=" in line}
    assert len(sums) == 1 and all("loaded" in r.stdout for r in res.ranks), res.output


@pytest.mark.multinode
@pytest.mark.no_slurm("a site's shared filesystem (--slurm-shared-dir) is shared whether a test asks or not")
def test_checkpoint_without_a_shared_dir_fails_clearly_as_on_a_real_cluster(sky_launch):
    """Nodes share no disk unless asked: the worker finds no checkpoint and says why."""
    res = _checkpoint_run(sky_launch)
    assert res.returncode != 0
    assert "loaded checksum=" in res.ranks[0].stdout
    assert "no checkpoint at /mnt/shared/model.pt" in res.ranks[1].stdout
    assert "the nodes share no filesystem" in res.ranks[1].stdout
