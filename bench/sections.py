"""The three measurements: bring-up/teardown, ``cluster.run`` latency, SSH concurrency.

Each one interleaves our operation with its baseline inside the same loop, so a burst of
load from the other tests sharing this machine lands on both sides of a ratio rather than
on one.  Every cluster is torn down in a ``finally``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.plain_sshd import PlainSshdPool
from bench.records import Figure, Target, median, percentile

if TYPE_CHECKING:
    import paramiko

    from pytest_sky import Cluster

DESIGN = "DESIGN §7"
ISSUE = "issue"
BRINGUP_TARGETS = {2: 0.3, 8: 0.6, 16: 1.0}  # seconds, DESIGN.md section 7


@dataclass(frozen=True)
class Plan:
    """How much to measure: ``--quick`` is a smoke check, the full plan gives stable medians."""

    sizes: tuple[int, ...]
    bringup_reps: int
    run_sizes: tuple[int, ...]
    run_warmups: int
    run_reps: int
    conc_rounds: int
    conc_clients: int = 20

    @classmethod
    def full(cls) -> Plan:
        return cls(sizes=(2, 4, 8, 16), bringup_reps=5, run_sizes=(2, 8), run_warmups=2, run_reps=15, conc_rounds=10)

    @classmethod
    def quick(cls) -> Plan:
        return cls(sizes=(2, 4, 8), bringup_reps=2, run_sizes=(2, 8), run_warmups=1, run_reps=5, conc_rounds=3)


def progress(msg: str) -> None:
    """Progress goes to stderr: stdout carries only the table."""
    sys.stderr.write(f"bench: {msg}\n")
    sys.stderr.flush()


class Namer:
    """Cluster names unique to this process: other engineers launch clusters concurrently."""

    def __init__(self) -> None:
        self.prefix = f"bench{os.getpid() % 100000}"
        self.count = 0

    def __call__(self, tag: str) -> str:
        self.count += 1
        return f"{self.prefix}-{tag}-{self.count}"


@contextmanager
def cluster(num_nodes: int, name: str) -> Iterator[Cluster]:
    """A launched cluster, always torn down (``launch`` itself cleans up if it fails)."""
    import pytest_sky

    c = pytest_sky.launch(num_nodes=num_nodes, name=name)
    try:
        yield c
    finally:
        c.down()


# ---------------------------------------------------------------------------------- bring-up


def _timed_launch_down(n: int, name: str, **backend_options: object) -> tuple[float, float]:
    import pytest_sky

    t0 = time.perf_counter()
    c = pytest_sky.launch(num_nodes=n, name=name, backend_options=backend_options or None)
    try:
        t1 = time.perf_counter()
    finally:
        c.down()  # in a finally so that an interrupt right here still tears the cluster down
    return t1 - t0, time.perf_counter() - t1


def bringup(plan: Plan, namer: Namer, workdir: Path) -> list[Figure]:
    """``launch`` -> ready and ``down`` against N plain sshds on 127.0.0.1 to banner and back."""
    ours_up: dict[int, list[float]] = {n: [] for n in plan.sizes}
    ours_down: dict[int, list[float]] = {n: [] for n in plan.sizes}
    base_up: dict[int, list[float]] = {n: [] for n in plan.sizes}
    base_down: dict[int, list[float]] = {n: [] for n in plan.sizes}
    with PlainSshdPool(workdir / "plain-sshd", max(plan.sizes)) as pool:
        progress("bring-up: warm-up (imports, first key generation)")
        _timed_launch_down(2, namer("warm"))
        pool.trial(2)
        for rep in range(plan.bringup_reps):
            for n in plan.sizes:
                progress(f"bring-up: N={n} rep {rep + 1}/{plan.bringup_reps}")
                up, down = _timed_launch_down(n, namer(f"n{n}"))
                ours_up[n].append(up)
                ours_down[n].append(down)
                trial = pool.trial(n)
                base_up[n].append(trial.up)
                base_down[n].append(trial.down)
        # What each node's own root filesystem costs: the same launches, nodes sharing the host's.
        widest = max(plan.sizes)
        shared_up = [
            _timed_launch_down(widest, namer("nolayers"), private_root=False)[0] for _ in range(plan.bringup_reps)
        ]
    figures = [
        Figure(
            section="bring-up",
            name=f"ready, {widest} nodes, each with its own root filesystem",
            unit="s",
            value=median(ours_up[widest]),
            baseline=median(shared_up),
            baseline_name=f"{widest} nodes sharing the host's files",
            samples=ours_up[widest],
            baseline_samples=shared_up,
        )
    ]
    for n in plan.sizes:
        targets = [Target(BRINGUP_TARGETS[n], DESIGN)] if n in BRINGUP_TARGETS else []
        figures.append(
            Figure(
                section="bring-up",
                name=f"ready, {n} nodes",
                unit="s",
                value=median(ours_up[n]),
                baseline=median(base_up[n]),
                baseline_name=f"{n} plain sshd to banner",
                targets=targets,
                samples=ours_up[n],
                baseline_samples=base_up[n],
            )
        )
        figures.append(
            Figure(
                section="bring-up",
                name=f"teardown, {n} nodes",
                unit="s",
                value=median(ours_down[n]),
                baseline=median(base_down[n]),
                baseline_name=f"kill+reap {n} plain sshd",
                samples=ours_down[n],
                baseline_samples=base_down[n],
            )
        )
    return figures


# ------------------------------------------------------------------------------- run latency


def ssh_argv(c: Cluster, command: str) -> list[str]:
    return ["ssh", "-F", c.ssh_config, c.name, command]


def fresh_ssh(c: Cluster) -> float:
    """A new OpenSSH connection to the head per call: what ``cluster.run`` replaces."""
    t0 = time.perf_counter()
    proc = subprocess.run(ssh_argv(c, "echo hi"), stdin=subprocess.DEVNULL, capture_output=True, check=False)
    dt = time.perf_counter() - t0
    if proc.returncode != 0 or proc.stdout != b"hi\n":
        raise RuntimeError(f"ssh to {c.name} failed ({proc.returncode}): {proc.stderr.decode(errors='replace')}")
    return dt


def open_paramiko(c: Cluster) -> paramiko.SSHClient:
    """The floor for ``cluster.run``: one exec on an already open, host-key-checked connection."""
    import paramiko

    d = Path(c.ssh_config).parent  # StateStore.cluster_dir(name)
    client = paramiko.SSHClient()
    client.load_host_keys(str(d / "known_hosts"))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        c.info.head.route.hostname,
        port=c.info.head.route.port,
        username="root",
        pkey=paramiko.Ed25519Key.from_private_key_file(str(d / "id_ed25519")),
        allow_agent=False,
        look_for_keys=False,
        timeout=20,
    )
    return client


def paramiko_exec(client: paramiko.SSHClient) -> float:
    t0 = time.perf_counter()
    _, stdout, _ = client.exec_command("echo hi")
    out = stdout.read()
    rc = stdout.channel.recv_exit_status()
    dt = time.perf_counter() - t0
    if rc != 0 or out != b"hi\n":
        raise RuntimeError(f"paramiko exec returned {rc}: {out!r}")
    return dt


def cluster_run(c: Cluster) -> float:
    t0 = time.perf_counter()
    res = c.run("echo hi")
    dt = time.perf_counter() - t0
    if res.returncode != 0 or [r.stdout.strip() for r in res.ranks] != ["hi"] * c.num_nodes:
        raise RuntimeError(f"cluster.run('echo hi') failed: {res.error or res.output[-500:]}")
    return dt


def run_latency(plan: Plan, namer: Namer) -> list[Figure]:
    figures = []
    for n in plan.run_sizes:
        ours: list[float] = []
        fresh: list[float] = []
        exe: list[float] = []
        with cluster(n, namer(f"run{n}")) as c:
            client = open_paramiko(c)
            try:
                steps: list[tuple[list[float], Callable[[], float]]] = [
                    (ours, lambda c=c: cluster_run(c)),
                    (fresh, lambda c=c: fresh_ssh(c)),
                    (exe, lambda client=client: paramiko_exec(client)),
                ]
                progress(f"run latency: {n} nodes, {plan.run_warmups} warm-ups + {plan.run_reps} runs")
                for i in range(plan.run_warmups + plan.run_reps):
                    for sink, fn in steps:
                        dt = fn()
                        if i >= plan.run_warmups:
                            sink.append(dt * 1000)
            finally:
                client.close()
        targets = [Target(100, DESIGN), Target(150, ISSUE)] if n == 2 else []
        for samples, label in ((fresh, "fresh `ssh` to head"), (exe, "paramiko exec, open conn")):
            figures.append(
                Figure(
                    section="run latency",
                    name=f"run('echo hi'), {n} nodes",
                    unit="ms",
                    value=median(ours),
                    baseline=median(samples),
                    baseline_name=label,
                    targets=targets,
                    samples=ours,
                    baseline_samples=samples,
                )
            )
    return figures


# ------------------------------------------------------------------------------- concurrency


def concurrency(plan: Plan, namer: Namer) -> list[Figure]:
    """``run_command_in_parallel`` of 20 ``ssh echo hi`` per round against one sequential ssh.

    The library raises on a round's first failure without saying how many of the others
    succeeded, so a failed round counts 0 confirmed successes and its error is kept.
    """
    from pytest_sky import CommandFailedError, run_command_in_parallel

    k = plan.conc_clients
    total = k * plan.conc_rounds
    seq: list[float] = []
    walls: list[float] = []
    per_conn: list[float] = []
    errors: list[str] = []
    ok = 0
    with cluster(2, namer("conc")) as c:
        argv = ssh_argv(c, "echo hi")
        progress(f"concurrency: sequential baseline, then {plan.conc_rounds} rounds of {k}")
        fresh_ssh(c)  # warm-up: page cache, sshd's first fork
        for _ in range(10):
            seq.append(fresh_ssh(c))
        for _ in range(plan.conc_rounds):
            t0 = time.perf_counter()
            try:
                results = run_command_in_parallel(argv, k, k)
            except CommandFailedError as exc:
                walls.append(time.perf_counter() - t0)
                errors.append(str(exc))
                continue
            walls.append(time.perf_counter() - t0)
            good = [r for r in results if r.returncode == 0 and r.output.strip() == "hi"]
            ok += len(good)
            per_conn.extend(r.seconds for r in results)
    base = median(seq)
    note = f"{len(errors)} round(s) raised; first: {errors[0]}" if errors else ""
    common = {"section": "ssh concurrency", "baseline_samples": seq}
    seq_label = "1 sequential ssh"
    return [
        Figure(
            name=f"{k} concurrent ssh x {plan.conc_rounds} rounds: succeeded",
            unit="count",
            value=ok,
            total=total,
            targets=[Target(total, DESIGN, at_least=True)],
            note=note,
            section="ssh concurrency",
        ),
        Figure(
            name="round wall time, median",
            unit="s",
            value=median(walls),
            baseline=base,
            baseline_name=seq_label,
            targets=[Target(0.3, DESIGN)],
            samples=walls,
            **common,
        ),
        Figure(
            name="round wall time, max",
            unit="s",
            value=max(walls) if walls else None,
            baseline=base,
            baseline_name=seq_label,
            targets=[Target(0.3, DESIGN)],
            samples=walls,
            **common,
        ),
        Figure(
            name="per-connection latency, p50",
            unit="s",
            value=percentile(per_conn, 50),
            baseline=base,
            baseline_name=seq_label,
            samples=per_conn,
            **common,
        ),
        Figure(
            name="per-connection latency, p95",
            unit="s",
            value=percentile(per_conn, 95),
            baseline=base,
            baseline_name=seq_label,
            samples=per_conn,
            **common,
        ),
    ]


def allreduce(plan: Plan, namer: Namer) -> list[Figure]:
    """gloo all_reduce of 64 MiB: 2 local nodes against 2 plain processes on 127.0.0.1."""
    from bench.allreduce import measure

    progress("all_reduce: 64 MiB between 2 nodes and between 2 loopback processes")
    result = measure(
        runs=3 if plan.bringup_reps < 5 else 5, pairs=2 if plan.bringup_reps < 5 else 3, name=namer("allreduce")
    )
    return [
        Figure(
            section="all_reduce",
            name="gloo all_reduce 64 MiB, 2 nodes (GB/s)",
            unit="GB/s",
            value=result["nodes_gbps"],
            baseline=result["loopback_gbps"],
            baseline_name="2 processes on 127.0.0.1",
            targets=[Target(0.95, "DESIGN §7", at_least=True, on_ratio=True)],
            samples=list(result.get("nodes_rounds", [])),
            baseline_samples=list(result.get("loopback_rounds", [])),
        )
    ]
