"""Distributed training across ranks: torchrun (static and c10d), gloo bandwidth, OpenMPI.

Each test runs an unmodified example task YAML from ``examples/`` and asserts on what every
rank printed (world size, every global rank exactly once, identical reduced values), not
only on exit codes: a launcher that silently starts two independent single-node jobs also
exits 0.

Runs are given a timeout (``cluster.run(..., timeout=...)``) so that a rendezvous that
never completes fails the test in bounded time instead of hanging it for torchrun's
15-minute default.  CPU cost: every torchrun agent imports torch and every DDP worker also
imports ``torch._dynamo`` (DDP's constructor does), a few CPU-seconds each, so the c10d
tests use one process per node; the static test keeps the example's two.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from pytest_sky import Cluster, RunResult, Task
from pytest_sky.plugin import require_on_nodes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TORCH_DDP = EXAMPLES / "torch_ddp"
MPI = EXAMPLES / "mpi"

RUN_TIMEOUT = 120.0  # seconds; generous for 2 loaded cores, far below torchrun's own 900


# What each test needs on the nodes (asked there: a Kubernetes image need not have what this
# client has), and how to get it on the local backend, whose nodes run this machine's software.
TORCH = {"modules": ("torch",), "install": "pip install 'pytest-sky[torch]'"}
MPIRUN = {"commands": ("mpirun",), "install": "apt-get install openmpi-bin"}
MPI4PY = {
    "commands": ("mpirun",),
    "modules": ("mpi4py",),
    "install": "apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py",
}


def _launch_and_run(
    sky_launch: Callable[..., Cluster], task: Task, num_nodes: int, needs: dict[str, Sequence[str] | str]
) -> tuple[Cluster, RunResult]:
    """``sky_launch(task, num_nodes=n)``, skipped unless the nodes have what ``needs`` names,
    and with a run timeout (the fixture has none)."""
    cluster = sky_launch(num_nodes=num_nodes)
    require_on_nodes(cluster, **needs)
    res = cluster.run(task.with_overrides(num_nodes=num_nodes), timeout=RUN_TIMEOUT)
    assert res.returncode == 0, f"{res.error}\n{res.output}"
    return cluster, res


def _fields(line: str) -> dict[str, str]:
    """``TAG a=1 b=x`` -> ``{"a": "1", "b": "x"}``."""
    return dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)


def _tagged(stdout: str, tag: str) -> list[dict[str, str]]:
    return [_fields(line) for line in stdout.splitlines() if line.startswith(tag + " ")]


# ------------------------------------------------------------------------------ torchrun DDP


def _check_ddp(cluster: Cluster, res: RunResult, nproc: int, *, static: bool) -> None:
    """Every node ran ``nproc`` workers of one process group of ``nodes x nproc`` ranks."""
    world = cluster.num_nodes * nproc
    seen: list[dict[str, str]] = []
    group_ranks = []
    for rank in res.ranks:
        lines = _tagged(rank.stdout, "RESULT")
        assert len(lines) == nproc, f"node {rank.rank}: {len(lines)} RESULT lines, expected {nproc}\n{res.output}"
        node_ranks = {f["node_rank"] for f in lines}
        assert len(node_ranks) == 1, lines  # one torchrun agent per node
        group_rank = int(node_ranks.pop())
        group_ranks.append(group_rank)
        if static:  # --node_rank=$SKYPILOT_NODE_RANK; c10d assigns its own order
            assert group_rank == rank.rank, lines
        for f in lines:
            assert f["host"] == cluster.node_names[rank.rank], (f, cluster.node_names)
            assert int(f["world"]) == world, f
            assert int(f["rank"]) == group_rank * nproc + int(f["local_rank"]), f
        seen.extend(lines)
    assert sorted(group_ranks) == list(range(cluster.num_nodes)), group_ranks
    assert sorted(int(f["rank"]) for f in seen) == list(range(world)), res.output  # each exactly once
    losses = {f["loss"] for f in seen}
    assert len(losses) == 1, f"ranks disagree on the all-reduced loss: {losses}"
    assert math.isfinite(float(losses.pop()))
    params = {f["params"] for f in seen}
    assert len(params) == 1, f"DDP replicas diverged: parameter checksums {params}"


@pytest.mark.long(8)
@pytest.mark.multinode
def test_torchrun_ddp_static_rendezvous(sky_launch):
    """2 nodes x 2 processes, ``--node_rank`` from SKYPILOT_NODE_RANK, master at the head."""
    task = Task.from_yaml(TORCH_DDP / "task.yaml")
    nproc = int(task.envs["NPROC_PER_NODE"])
    assert nproc == 2
    cluster, res = _launch_and_run(sky_launch, task, 2, TORCH)
    _check_ddp(cluster, res, nproc, static=True)


@pytest.mark.long(8)
@pytest.mark.multinode
@pytest.mark.parametrize("num_nodes", [2, 3])
def test_torchrun_ddp_c10d_rendezvous(sky_launch, num_nodes):
    """The nodes meet at the head's c10d endpoint under SKYPILOT_TASK_ID; torchrun ranks them."""
    # One process per node: the rendezvous across nodes is what is tested, and every extra
    # worker costs seconds of torch/_dynamo imports on a 2-core machine.
    task = Task.from_yaml(TORCH_DDP / "task_c10d.yaml").with_overrides(envs={"NPROC_PER_NODE": 1})
    cluster, res = _launch_and_run(sky_launch, task, num_nodes, TORCH)
    _check_ddp(cluster, res, 1, static=False)


# ------------------------------------------------------------------------ all_reduce bandwidth


@pytest.mark.multinode
def test_allreduce_bandwidth_between_nodes(sky_launch):
    task = Task.from_yaml(EXAMPLES / "allreduce_bandwidth" / "task.yaml")
    cluster, res = _launch_and_run(sky_launch, task, 2, TORCH)
    for rank in res.ranks:
        (line,) = _tagged(rank.stdout, "RANK")
        assert line["rank"] == str(rank.rank) and line["world"] == "2", line
        assert line["host"] == cluster.node_names[rank.rank], line
        assert line["correct"] == "1", f"rank {rank.rank}: wrong all_reduce result\n{res.output}"
        assert float(line["median_s"]) > 0, line
    gbps = [line for line in res.ranks[0].stdout.splitlines() if line.startswith("GBPS ")]
    assert len(gbps) == 1, res.output
    assert float(gbps[0].split()[1]) > 0, gbps
    assert not any(line.startswith("GBPS ") for line in res.ranks[1].stdout.splitlines())
    print(f"all_reduce 64 MiB between 2 nodes: {gbps[0]}")


# --------------------------------------------------------------------------------- OpenMPI


def _check_worker_ranks_idle(res: RunResult) -> None:
    """SkyPilot-style MPI: only the head runs mpirun; the workers' run sections just exit 0."""
    for rank in res.ranks[1:]:
        assert rank.returncode == 0
        assert rank.stdout.splitlines() == [f"worker rank {rank.rank}: mpirun on the head drives this node"], (
            rank.stdout
        )


def _check_mpi_allreduce(cluster: Cluster, head_stdout: str, procs_per_node: int) -> None:
    size = cluster.num_nodes * procs_per_node
    lines = _tagged(head_stdout, "MPI")
    assert sorted(int(f["rank"]) for f in lines) == list(range(size)), head_stdout  # each once
    for f in lines:
        assert f["size"] == str(size), f
        assert f["sum"] == f["expected"] == str(size * (size + 1) // 2), f
        assert f["ok"] == "1", f
        # --map-by node: MPI rank i runs on node i mod n
        assert f["host"] == cluster.node_names[int(f["rank"]) % cluster.num_nodes], (f, cluster.node_names)


OPENMPI_SETPGID_RACE = re.compile(r"plm:rsh: Warning: setpgid\(\d+,\d+\) failed in parent with errno=Permission denied")


@pytest.mark.multinode
@pytest.mark.parametrize("num_nodes", [2, 3])
def test_mpirun_hostname_across_nodes(sky_launch, num_nodes):
    cluster, res = _launch_and_run(sky_launch, Task.from_yaml(MPI / "hostname.yaml"), num_nodes, MPIRUN)
    expected = cluster.node_names  # each node's hostname (<cluster>-head, ... where the backend names them)
    # OpenMPI's rsh launcher calls setpgid() on each ssh child from both sides; when the child
    # has already exec'd, the parent's call fails with EACCES and mpirun warns (harmless, and
    # as likely on a real cluster under load).  Every other line must be a node's hostname.
    lines = [line for line in res.ranks[0].stdout.splitlines() if not OPENMPI_SETPGID_RACE.search(line)]
    assert sorted(lines) == sorted(expected), res.output
    _check_worker_ranks_idle(res)


@pytest.mark.multinode
@pytest.mark.parametrize("num_nodes", [2, 3])
def test_mpi4py_allreduce_across_nodes(sky_launch, num_nodes):
    task = Task.from_yaml(MPI / "allreduce.yaml")
    cluster, res = _launch_and_run(sky_launch, task, num_nodes, MPI4PY)
    _check_mpi_allreduce(cluster, res.ranks[0].stdout, int(task.envs["MPI_PROCS_PER_NODE"]))
    _check_worker_ranks_idle(res)


@pytest.mark.multinode(num_nodes=2)
def test_mpi4py_allreduce_as_detached_job(sky_cluster):
    """mpirun from a detached job: no client session, no ssh-agent, only the cluster's keys."""
    require_on_nodes(sky_cluster, **MPI4PY)
    task = Task.from_yaml(MPI / "allreduce.yaml")
    job = sky_cluster.submit(task, env={"SSH_AUTH_SOCK": ""})  # and the YAML unsets it
    status = job.wait(RUN_TIMEOUT)
    assert status == "SUCCEEDED", f"job {job.id}: {status}\n{job.logs()}"
    res = job.result()
    assert res is not None and res.returncode == 0, job.logs()
    procs_per_node = int(task.envs["MPI_PROCS_PER_NODE"])
    _check_mpi_allreduce(sky_cluster, res.ranks[0].stdout, procs_per_node)
    _check_worker_ranks_idle(res)
    # The merged log has every MPI rank's line under the head's SkyPilot prefix.
    logs = job.logs()
    size = sky_cluster.num_nodes * procs_per_node
    for mpi_rank in range(size):
        pattern = rf"^\(head, rank=0, pid=\d+\) MPI rank={mpi_rank} size={size} .* sum={size * (size + 1) // 2} "
        assert re.search(pattern, logs, re.M), f"MPI rank {mpi_rank} missing from the job log:\n{logs}"
