"""gloo all_reduce bandwidth between two local nodes, against two plain processes on loopback.

DESIGN.md section 7 asks for "gloo all_reduce 64 MiB between two local nodes >= 0.95x two
plain processes on loopback": a cluster's veth/bridge path must not be what slows a
distributed test down.  :func:`measure` runs the same script
(``examples/allreduce_bandwidth/allreduce_bw.py``) both ways within one call and returns
both figures and their ratio.  On a shared 2-core machine the load from other work moves
either figure by tens of percent between rounds, so the two are measured in alternating
rounds (nodes, loopback; loopback, nodes; nodes, loopback: a load that rises or falls
steadily over the call lands on both sides) and each side's figure is the median of its
rounds, every round itself the median of ``runs`` timed all_reduces after two warm-ups.

Run it alone with ``python -m bench.allreduce``.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pytest_sky import Cluster

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "allreduce_bandwidth"
SCRIPT = EXAMPLE / "allreduce_bw.py"
TASK = EXAMPLE / "task.yaml"
TARGET = 0.95  # nodes / loopback, DESIGN.md section 7
RUN_TIMEOUT = 300.0


def _gbps(stdout: str, where: str) -> float:
    """The figure from rank 0's ``GBPS <value>`` line."""
    for line in stdout.splitlines():
        if line.startswith("GBPS "):
            return float(line.split()[1])
    raise RuntimeError(f"no GBPS line from rank 0 ({where}):\n{stdout}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _settings(runs: int, mib: int) -> dict[str, str]:
    return {"ALLREDUCE_RUNS": str(runs), "ALLREDUCE_MIB": str(mib), "ALLREDUCE_WARMUPS": "2"}


def _on_nodes(cluster: Cluster, runs: int, mib: int) -> float:
    """One round on the cluster: the example task, unmodified but for its sizes."""
    from pytest_sky import Task

    res = cluster.run(Task.from_yaml(TASK), env=_settings(runs, mib), timeout=RUN_TIMEOUT)
    if res.returncode != 0:
        raise RuntimeError(f"all_reduce on the nodes failed: {res.error}\n{res.output}")
    return _gbps(res.ranks[0].stdout, "nodes")


def _on_loopback(runs: int, mib: int) -> float:
    """One round as two plain processes on 127.0.0.1, rank and world from their own variables."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            **_settings(runs, mib),
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",  # the data path too, not only the store, on loopback
            "PYTHONUNBUFFERED": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT)],
                cwd=EXAMPLE,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=RUN_TIMEOUT)
            outputs.append(out)
            if proc.returncode != 0:
                raise RuntimeError(f"all_reduce on loopback failed (exit {proc.returncode}):\n{out}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return _gbps(outputs[0], "loopback")


def measure(runs: int = 5, *, pairs: int = 3, mib: int = 64, name: str | None = None) -> dict:
    """Bandwidth of a ``mib`` MiB float32 gloo all_reduce: 2 local nodes vs 2 loopback processes.

    Returns ``nodes_gbps`` and ``loopback_gbps`` (GB/s, 1e9 bytes: tensor bytes / median
    time; each the median over ``pairs`` rounds), ``ratio`` (nodes / loopback), ``target``
    (0.95) and ``meets_target``, each round's figure in time order, ``runs``, ``mib``, the
    1-minute load average at the start and the seconds the call took.  ``name`` names the
    cluster (default: unique to this process); it is torn down before returning, whatever
    happens.
    """
    import pytest_sky  # here, not at the top: bench.cli settles PYTEST_SKY_HOME first

    name = name or f"allreduce{os.getpid() % 100000}-{int(time.time() * 1000) % 100000}"
    load = os.getloadavg()[0]
    nodes: list[float] = []
    loopback: list[float] = []
    started = time.perf_counter()
    cluster = pytest_sky.launch(num_nodes=2, name=name)
    try:
        for pair in range(pairs):
            first_nodes = pair % 2 == 0
            if first_nodes:
                nodes.append(_on_nodes(cluster, runs, mib))
            loopback.append(_on_loopback(runs, mib))
            if not first_nodes:
                nodes.append(_on_nodes(cluster, runs, mib))
    finally:
        cluster.down()
    nodes_gbps, loopback_gbps = statistics.median(nodes), statistics.median(loopback)
    ratio = nodes_gbps / loopback_gbps
    return {
        "nodes_gbps": nodes_gbps,
        "loopback_gbps": loopback_gbps,
        "ratio": round(ratio, 3),
        "target": TARGET,
        "meets_target": ratio >= TARGET,
        "nodes_rounds": nodes,
        "loopback_rounds": loopback,
        "runs": runs,
        "mib": mib,
        "load_at_start": load,
        "seconds": round(time.perf_counter() - started, 1),
    }


if __name__ == "__main__":
    print(measure())
