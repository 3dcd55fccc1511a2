"""The peers' side of ``python -m bench --peers``, one trial per child process.

``python -m bench.peer_workers KIND ...`` runs one trial of a peer tool and prints one JSON
line (its own timings, measured inside the child so that importing Ray, torch or
parallel-ssh is not counted against them, as importing pytest-sky is not counted against
us).  Each kind runs in its own process so that the parent can bound it with a hard timeout
and end everything it started by process group, and so that Ray's global state, gevent
(parallel-ssh) and torch's spawn start method never leak into the benchmark process.

Kinds:

- ``ray N BUDGET TEMP_DIR``: a local ``ray.cluster_utils.Cluster`` of N nodes (``num_cpus=1``,
  75 MiB object store, no dashboard), ready when ``wait_for_nodes()`` returns, then
  ``shutdown()``; stops adding nodes once BUDGET seconds have passed and says so.
- ``torchmp N``: ``torch.multiprocessing.start_processes`` of a trivial function on N spawned
  processes, until all have started, returned and been joined.
- ``mptc``: a 2-rank gloo all_reduce test written as PyTorch's own distributed tests are
  (``MultiProcessTestCase`` with ``_spawn_processes``), run by ``unittest``.
- ``pssh KEY IP...``: one ``hostname`` fan-out with ``pssh.clients.ParallelSSHClient``
  (connect, exec, read every output).
"""

from __future__ import annotations

import json
import os
import sys
import time


def _emit(data: dict) -> None:
    sys.stdout.write("PEER_RESULT " + json.dumps(data) + "\n")
    sys.stdout.flush()


def noop(_index: int) -> None:
    """The function each torch-spawned process runs: nothing, so only spawn and join count."""


def ray_trial(n: int, budget: float, temp_dir: str) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's sessions (and every Ray process's command line) under our own dir, so the parent can
    # find what is left by it; set through RAY_TMPDIR because Cluster writes its address file
    # to the default temp dir whatever ``temp_dir`` a node is given.
    os.environ["RAY_TMPDIR"] = temp_dir
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": 1, "object_store_memory": 75 * 1024 * 1024, "include_dashboard": False}
    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=False, shutdown_at_exit=True)
    added = 0
    capped = False
    up = None
    try:
        for _ in range(n):
            cluster.add_node(**node_args)
            added += 1
            if added < n and time.perf_counter() - t0 > budget:
                capped = True
                break
        if not capped:
            cluster.wait_for_nodes(timeout=max(5.0, budget - (time.perf_counter() - t0)))
            up = time.perf_counter() - t0
        partial = time.perf_counter() - t0
    finally:
        t1 = time.perf_counter()
        cluster.shutdown()
        down = time.perf_counter() - t1
    _emit({"up": up, "down": down, "added": added, "capped": capped, "elapsed_when_capped": partial})


def torchmp_trial(n: int) -> None:
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    mp.start_processes(noop, nprocs=n, join=True, start_method="spawn")
    _emit({"seconds": time.perf_counter() - t0})


def mptc_trial() -> None:
    import unittest

    from bench import mptc_case

    suite = unittest.defaultTestLoader.loadTestsFromTestCase(mptc_case.GlooAllReduceTest)
    t0 = time.perf_counter()
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
    seconds = time.perf_counter() - t0
    problems = [str(x[1])[-500:] for x in result.errors + result.failures]
    _emit({"seconds": seconds, "ok": result.wasSuccessful() and result.testsRun == 1, "problems": problems})


def pssh_trial(key: str, ips: list[str]) -> None:
    from pssh.clients import ParallelSSHClient

    t0 = time.perf_counter()
    client = ParallelSSHClient(
        ips, user="root", pkey=key, num_retries=1, timeout=30, allow_agent=False, pool_size=len(ips)
    )
    output = client.run_command("hostname")
    client.join(output)
    names = []
    failures = []
    for host_out in output:
        lines = list(host_out.stdout or [])
        if host_out.exception is not None or host_out.exit_code != 0 or len(lines) != 1:
            failures.append(f"{host_out.host}: exit {host_out.exit_code} {host_out.exception!r}")
        names.extend(lines)
    seconds = time.perf_counter() - t0
    disconnect = getattr(client, "disconnect", None)
    if callable(disconnect):
        disconnect()
    _emit({"seconds": seconds, "names": names, "failures": failures})


def main(argv: list[str]) -> int:
    kind, *rest = argv
    if kind == "ray":
        ray_trial(int(rest[0]), float(rest[1]), rest[2])
    elif kind == "torchmp":
        torchmp_trial(int(rest[0]))
    elif kind == "mptc":
        mptc_trial()
    elif kind == "pssh":
        pssh_trial(rest[0], rest[1:])
    else:
        sys.stderr.write(f"unknown kind {kind!r}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
