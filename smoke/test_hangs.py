"""A hung distributed job says where every rank waits (issue 47), for the hangs CI meets most:
a rank that skips a collective, a torchrun node that never starts its agent, an MPI rank
alone at a barrier.

Each runs on the local backend and, in CI's Kubernetes stage, on emulated pods, which hold no
``SYS_PTRACE``: the stacks come from each interpreter's own faulthandler, armed on every node
(``pytest_sky/agent/site_hook.py``), for the ranks mpirun starts over ssh too.  The assertions
read the report a person reads (``Capture.summary``, what the failure report shows).
"""

from __future__ import annotations

import time

import pytest

from pytest_sky import Cluster, RunTimeoutError
from pytest_sky.diagnosis import Capture
from pytest_sky.plugin import require_on_nodes

TORCH = {"modules": ("torch",), "install": "pip install 'pytest-sky[torch]'"}
#: Deadlines long enough for the job to reach its wait on two loaded cores (torchrun imports
#: torch first; mpirun starts a remote rank over ssh), and no longer: a test waits them out.
TORCHRUN_DEADLINE = 30
MPI_DEADLINE = 20
MPI4PY = {
    "commands": ("mpirun",),
    "modules": ("mpi4py",),
    "install": "apt-get install openmpi-bin libopenmpi-dev; pip install mpi4py",
}

GLOO = """\
import os, time
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    rank = int(os.environ["SKYPILOT_NODE_RANK"])
    head = os.environ["SKYPILOT_NODE_IPS"].splitlines()[0]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{head}:29531", rank=rank, world_size=2, timeout=timedelta(seconds=600)
    )
    print(f"rank {rank} joined", flush=True)
    if rank == 1:
        time.sleep(3600)  # skips the all_reduce
    dist.all_reduce(torch.ones(1))


main()
"""
MPI = """\
import time

from mpi4py import MPI

comm = MPI.COMM_WORLD


def main():
    rank = comm.Get_rank()
    print(f"mpi rank {rank} up", flush=True)
    if rank == 0:
        time.sleep(3600)  # never reaches the barrier
    comm.Barrier()


main()
"""


def _line(script: str, text: str) -> int:
    return next(i for i, line in enumerate(script.splitlines(), 1) if line.strip().startswith(text))


def _written(name: str, script: str) -> str:
    """Bash that writes ``script`` to ``~/<name>`` on the node it runs on."""
    return f"cat > ~/{name} <<'EOF'\n{script}EOF\n"


def _stopped(cluster: Cluster, run: str, timeout: float, **env: str) -> tuple[Capture, float]:
    started = time.monotonic()
    with pytest.raises(RunTimeoutError) as info:
        cluster.run(run, env=env or None, timeout=timeout)
    capture = info.value.capture
    assert isinstance(capture, Capture) and capture.error is None, capture
    return capture, time.monotonic() - started


@pytest.mark.long(8)
@pytest.mark.multinode
def test_a_rank_that_skips_an_all_reduce_is_named_with_its_peer_waiting_in_it(sky_launch):
    """Issue 47: rank 1 skips an all_reduce and sleeps; run(timeout=20) fails within 25 s and
    names rank 0 in all_reduce at the script's line, rank 1 in time.sleep at its own."""
    cluster = sky_launch(num_nodes=2)
    require_on_nodes(cluster, **TORCH)
    assert cluster.run("python3 -c 'import torch.distributed'", timeout=300).ok  # a warm disk cache, not a deadline
    capture, seconds = _stopped(cluster, _written("gloo_hang.py", GLOO) + "exec python3 ~/gloo_hang.py", 20)
    assert seconds < 25, f"the issue's bound: a 20 s deadline fails within 25 s ({seconds:.1f} s)"
    summary = capture.summary()
    reduce_line, sleep_line = _line(GLOO, "dist.all_reduce"), _line(GLOO, "time.sleep(3600)")
    assert [r.state for r in capture.ranks] == ["running", "running"], summary
    rank0, rank1 = summary.split("\nrank 1 (worker1")
    assert f"main thread: gloo_hang.py:{reduce_line} main: dist.all_reduce(torch.ones(1))" in rank0, summary
    assert "waits in torch.distributed.all_reduce" in rank0 and "| rank 0 joined" in rank0, summary
    assert f"main thread: gloo_hang.py:{sleep_line} main: time.sleep(3600)" in rank1, summary
    assert "waits in time.sleep" in rank1 and "| rank 1 joined" in rank1, summary


@pytest.mark.long(10)
@pytest.mark.multinode
def test_a_torchrun_node_that_never_starts_leaves_its_peer_waiting_in_the_rendezvous(sky_launch):
    """torchrun's c10d rendezvous for two nodes; node 1 never starts its agent."""
    cluster = sky_launch(num_nodes=2)
    require_on_nodes(cluster, **TORCH)
    run = (
        'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then exec sleep 3600; fi\n'
        "exec torchrun --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d "
        '--rdzv_endpoint="$(echo "$SKYPILOT_NODE_IPS" | head -n1):29532" --rdzv_id="$SKYPILOT_TASK_ID" '
        "-m this\n"
    )
    capture, _ = _stopped(cluster, run, TORCHRUN_DEADLINE)
    summary = capture.summary()
    rank0, rank1 = summary.split("\nrank 1 (worker1")
    assert "torchrun --nnodes=2" in rank0 and "(no frame of the user's own files)" in rank0, summary
    assert "waits in the c10d rendezvous (torch.distributed.elastic.rendezvous.dynamic_rendezvous." in rank0
    assert "dynamic_rendezvous.py" in capture.full()
    assert "sleep 3600 [S" in rank1, summary


@pytest.mark.long(8)
@pytest.mark.multinode
def test_an_mpi_rank_alone_at_a_barrier_and_its_peer_are_both_shown(sky_launch):
    """mpirun on the head starts MPI rank 1 on the worker over ssh (no environment of the
    rank's but the job's token); MPI rank 0 sleeps, rank 1 blocks in comm.Barrier()."""
    cluster = sky_launch(num_nodes=2)
    require_on_nodes(cluster, **MPI4PY)
    worker = cluster.node_ips[1]
    run = (
        'if [ "$SKYPILOT_NODE_RANK" != 0 ]; then echo "mpirun on the head drives this node"; exit 0; fi\n'
        + _written("mpi_hang.py", MPI)
        + f"ssh {worker} 'cat > mpi_hang.py' < ~/mpi_hang.py\n"
        + 'hosts=$(echo "$SKYPILOT_NODE_IPS" | sed "s/$/:1/" | paste -sd,)\n'
        + 'mpirun --host "$hosts" -np 2 --map-by node -x PATH python3 mpi_hang.py\n'
    )
    env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    capture, _ = _stopped(cluster, run, MPI_DEADLINE, **env)
    summary = capture.summary()
    assert [r.state for r in capture.ranks] == ["running", "exited (0)"], summary
    rank0, rank1 = summary.split("\nrank 1 (worker1")
    assert f"main thread: mpi_hang.py:{_line(MPI, 'time.sleep(3600)')} main: time.sleep(3600)" in rank0, summary
    assert f"main thread: mpi_hang.py:{_line(MPI, 'comm.Barrier()')} main: comm.Barrier()" in rank1, summary
    assert "waits in comm.Barrier" in rank1, summary
