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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.plain_sshd import PlainSshdPool
from bench.records import Figure, Target, median, percentile

if TYPE_CHECKING:
    import paramiko

    from pytest_sky import Cluster

DESIGN = "DESIGN §7"
ISSUE = "issue"
BRINGUP_TARGETS = {2: 0.3, 8: 0.6, 16: 1.0, 64: 1.0}  # seconds, DESIGN.md section 7
TEARDOWN_TARGETS = {16: 0.15, 64: 0.6}  # seconds, DESIGN.md section 7
#: Teardown against bring-up of the same clusters: DESIGN §7 says no slower at any N; the
#: issue accepts 1.5x at 8 nodes in --quick (few samples, on a busy machine).
TEARDOWN_RATIO = 1.0


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
    rootless_sizes: tuple[int, ...] = (2, 8)  # bring-up and teardown as an ordinary user

    @classmethod
    def full(cls) -> Plan:
        return cls(
            sizes=(2, 4, 8, 16, 32, 64),
            bringup_reps=5,
            run_sizes=(2, 8),
            run_warmups=2,
            run_reps=15,
            conc_rounds=10,
            rootless_sizes=(2, 8, 64),
        )

    @classmethod
    def quick(cls) -> Plan:
        return cls(sizes=(2, 4, 8), bringup_reps=2, run_sizes=(2, 8), run_warmups=2, run_reps=5, conc_rounds=3)


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


def _timed_launch_down(n: int, name: str, **backend_options: object) -> tuple[float, float, float]:
    """(bring-up, teardown, deferred) seconds.  Teardown leaves deleting the cluster's files to
    a thread (``state.drain_removals``): that is awaited here, outside both timings, so it
    never lands on the next bring-up, and its cost is returned as ``deferred``."""
    import pytest_sky
    from pytest_sky.state import drain_removals

    before = drain_removals()  # nothing of an earlier cluster is still being deleted
    t0 = time.perf_counter()
    c = pytest_sky.launch(num_nodes=n, name=name, backend_options=backend_options or None)
    try:
        t1 = time.perf_counter()
    finally:
        c.down()  # in a finally so that an interrupt right here still tears the cluster down
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, drain_removals() - before


@dataclass
class _Series:
    """Samples per cluster size, in seconds."""

    up: dict[int, list[float]]
    down: dict[int, list[float]]
    deferred: dict[int, list[float]]
    base_up: dict[int, list[float]]
    base_down: dict[int, list[float]]

    @classmethod
    def empty(cls, sizes: tuple[int, ...]) -> _Series:
        return cls(*({n: [] for n in sizes} for _ in range(5)))


def bringup(plan: Plan, namer: Namer, workdir: Path) -> list[Figure]:
    """``launch`` -> ready and ``down`` against N plain sshds on 127.0.0.1 to banner and back."""
    series = _Series.empty(plan.sizes)
    with PlainSshdPool(workdir / "plain-sshd", max(plan.sizes)) as pool:
        progress("bring-up: warm-up (imports, first key generation)")
        _timed_launch_down(2, namer("warm"))
        pool.trial(2)
        for rep in range(plan.bringup_reps):
            for n in plan.sizes:
                progress(f"bring-up: N={n} rep {rep + 1}/{plan.bringup_reps}")
                up, down, deferred = _timed_launch_down(n, namer(f"n{n}"))
                series.up[n].append(up)
                series.down[n].append(down)
                series.deferred[n].append(deferred)
                trial = pool.trial(n)
                series.base_up[n].append(trial.up)
                series.base_down[n].append(trial.down)
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
            value=median(series.up[widest]),
            baseline=median(shared_up),
            baseline_name=f"{widest} nodes sharing the host's files",
            samples=series.up[widest],
            baseline_samples=shared_up,
        )
    ]
    for n in plan.sizes:
        figures += _size_figures(n, series)
    return figures + _slope_figures(plan.sizes, series)


def _size_figures(n: int, series: _Series) -> list[Figure]:
    up, down = series.up[n], series.down[n]
    return [
        Figure(
            section="bring-up",
            name=f"ready, {n} nodes",
            unit="s",
            value=median(up),
            baseline=median(series.base_up[n]),
            baseline_name=f"{n} plain sshd to banner",
            targets=[Target(BRINGUP_TARGETS[n], DESIGN)] if n in BRINGUP_TARGETS else [],
            samples=up,
            baseline_samples=series.base_up[n],
        ),
        Figure(
            section="bring-up",
            name=f"teardown, {n} nodes",
            unit="s",
            value=median(down),
            baseline=median(series.base_down[n]),
            baseline_name=f"kill+reap {n} plain sshd",
            targets=[Target(TEARDOWN_TARGETS[n], DESIGN)] if n in TEARDOWN_TARGETS else [],
            samples=down,
            baseline_samples=series.base_down[n],
            note="" if n != 2 else TEARDOWN_NOTE,
        ),
        Figure(
            section="bring-up",
            name=f"teardown against bring-up, {n} nodes",
            unit="s",
            value=median(down),
            baseline=median(up),
            baseline_name=f"bring-up of the same {n}-node clusters",
            targets=[Target(TEARDOWN_RATIO, DESIGN, on_ratio=True)],
            samples=down,
            baseline_samples=up,
        ),
        Figure(
            section="bring-up",
            name=f"files deleted after teardown (background), {n} nodes",
            unit="s",
            value=median(series.deferred[n]),
            samples=series.deferred[n],
        ),
    ]


TEARDOWN_NOTE = (
    "teardown = until `down()` returns: every node's processes, cgroups and links are gone and its "
    "name is free; the cluster's files are deleted afterwards on a thread of the process (the "
    "'files deleted' rows, awaited by the benchmark outside every timing, by pytest at session "
    "end); the baseline kills and reaps plain sshd processes, which have no network, mounts or files"
)


def _slope_figures(sizes: tuple[int, ...], series: _Series) -> list[Figure]:
    """Time per extra node from 8 nodes to the largest size: flat scaling keeps it constant."""
    lo, hi = 8, max(sizes)
    if lo not in sizes or hi <= lo:
        return []

    def slope(samples: dict[int, list[float]]) -> float | None:
        a, b = median(samples[lo]), median(samples[hi])
        return None if a is None or b is None else (b - a) / (hi - lo) * 1000

    return [
        Figure(
            section="bring-up",
            name=f"ready: time per extra node, {lo} to {hi} nodes",
            unit="ms",
            value=slope(series.up),
            baseline=slope(series.base_up),
            baseline_name="plain sshd, same sizes",
        ),
        Figure(
            section="bring-up",
            name=f"teardown: time per extra node, {lo} to {hi} nodes",
            unit="ms",
            value=slope(series.down),
            baseline=slope(series.base_down),
            baseline_name="plain sshd, same sizes",
        ),
    ]


# ------------------------------------------------------------------------------- run latency


def ssh_argv(c: Cluster, command: str, *, raw: bool = False) -> list[str]:
    """``ssh -F <ssh_config> <cluster>`` as users run it (multiplexed over the cluster's
    master); ``raw``: a full handshake every time, the master bypassed."""
    bypass = ["-o", "ControlMaster=no", "-o", "ControlPath=none"] if raw else []
    return ["ssh", "-F", c.ssh_config, *bypass, c.name, command]


def fresh_ssh(c: Cluster, *, raw: bool = True) -> float:
    """A new OpenSSH connection (a full handshake) to the head per call: what ``cluster.run``
    replaces; ``raw=False``: one exec over the cluster's multiplexed master, the floor the
    issue judges a run against."""
    t0 = time.perf_counter()
    proc = subprocess.run(ssh_argv(c, "echo hi", raw=raw), stdin=subprocess.DEVNULL, capture_output=True, check=False)
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
        mux: list[float] = []
        exe: list[float] = []
        with cluster(n, namer(f"run{n}")) as c:
            client = open_paramiko(c)
            try:
                steps: list[tuple[list[float], Callable[[], float]]] = [
                    (ours, lambda c=c: cluster_run(c)),
                    (fresh, lambda c=c: fresh_ssh(c)),
                    (mux, lambda c=c: fresh_ssh(c, raw=False)),
                    (exe, lambda client=client: paramiko_exec(client)),
                ]
                progress(f"run latency: {n} nodes, {plan.run_warmups} warm-ups + {plan.run_reps} runs")
                # Warm-ups first (a cluster's first two runs start the agent servers), then
                # each way's runs back to back, a fresh ssh's last: its sshd session goes on
                # tearing down on the head after the client returns, and a run measured right
                # after it paid ~8 ms of that (measured: 16.5 ms alone, 24.5 ms after one).
                for _ in range(plan.run_warmups):
                    for _, fn in steps:
                        fn()
                for sink, fn in (*steps[:1], *steps[2:], steps[1]):
                    sink.extend(fn() * 1000 for _ in range(plan.run_reps))
            finally:
                client.close()
        bound = {2: 15, 8: 30}.get(n)
        rows = (
            (fresh, "fresh `ssh` to head", [Target(bound, DESIGN)] if bound else []),
            (mux, "multiplexed `ssh` exec", [Target(3, ISSUE, on_ratio=True)]),
            (exe, "paramiko exec, open conn", []),
        )
        for samples, label, targets in rows:
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


@dataclass
class Rounds:
    """Rounds of ``k`` concurrent ssh: wall times, per-connection times, successes, failures.
    A success prints exactly ``hi``: a warning on stderr (a race for the master) counts."""

    walls: list[float] = field(default_factory=list)
    per_conn: list[float] = field(default_factory=list)
    ok: int = 0
    failures: list[str] = field(default_factory=list)

    def run(self, argv: list[str], k: int) -> None:
        from pytest_sky import run_command_in_parallel

        t0 = time.perf_counter()
        results = run_command_in_parallel(argv, k, k, timeout=60, fail_fast=False)
        self.walls.append(time.perf_counter() - t0)
        for r in results:
            if r.returncode == 0 and r.output == "hi\n":
                self.ok += 1
            else:
                self.failures.append(f"exit {r.returncode}: {r.output.strip()[-200:]}")
        self.per_conn.extend(r.seconds for r in results)

    @property
    def note(self) -> str:
        return f"{len(self.failures)} failed; first: {self.failures[0]}" if self.failures else ""


CONCURRENCY_NOTE = (
    "`ssh -F <ssh_config> <cluster>` as users run it: the generated config multiplexes every client "
    "over one master connection to the head (ControlMaster; opened by the launch in the background, as "
    "on Kubernetes); the raw rows bypass it (-o ControlMaster=no -o ControlPath=none): a full handshake "
    "per connection, which is what the 1-sequential-ssh baseline does once"
)


def concurrency(plan: Plan, namer: Namer) -> list[Figure]:
    """20 concurrent ``ssh echo hi`` per round, through the generated config (multiplexed) and
    with full handshakes, rounds interleaved, against one sequential full-handshake ssh."""
    k = plan.conc_clients
    total = k * plan.conc_rounds
    seq: list[float] = []
    mux, raw = Rounds(), Rounds()
    with cluster(2, namer("conc")) as c:
        progress(f"concurrency: sequential baseline, then {plan.conc_rounds} rounds of {k}, multiplexed and raw")
        fresh_ssh(c)  # warm-up: page cache, sshd's first fork
        for _ in range(10):
            seq.append(fresh_ssh(c))
        for _ in range(plan.conc_rounds):
            mux.run(ssh_argv(c, "echo hi"), k)
            raw.run(ssh_argv(c, "echo hi", raw=True), k)
    base = median(seq)
    seq_label = "1 sequential ssh (full handshake)"
    common = {"section": "ssh concurrency", "baseline_samples": seq, "baseline": base, "baseline_name": seq_label}
    figures = []
    for rounds, how in ((mux, "via the ssh config (multiplexed)"), (raw, "raw handshakes")):
        figures += [
            Figure(
                name=f"{k} concurrent ssh x {plan.conc_rounds} rounds, {how}: succeeded",
                unit="count",
                value=rounds.ok,
                total=total,
                targets=[Target(total, DESIGN, at_least=True)],
                note=rounds.note,
                section="ssh concurrency",
            ),
            Figure(
                name=f"round wall time, {how}, median",
                unit="s",
                value=median(rounds.walls),
                targets=[Target(0.3, DESIGN)] if rounds is mux else [],
                samples=rounds.walls,
                note=CONCURRENCY_NOTE if rounds is mux else "",
                **common,
            ),
            Figure(
                name=f"round wall time, {how}, max",
                unit="s",
                value=max(rounds.walls) if rounds.walls else None,
                samples=rounds.walls,
                **common,
            ),
            Figure(
                name=f"per-connection latency, {how}, p95",
                unit="s",
                value=percentile(rounds.per_conn, 95),
                samples=rounds.per_conn,
                **common,
            ),
        ]
    return figures


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
