"""``python -m bench --peers``: pytest-sky against the tools people use instead, in one run.

DESIGN.md section 7 quotes peers measured on this kind of machine; this module and its two
siblings measure them again next to pytest-sky, interleaved in the same loops, so each
comparison is a same-run ratio:

- bring-up and teardown of N nodes against a local Ray test cluster
  (``ray.cluster_utils.Cluster``) and against spawning N processes with torch multiprocessing;
- a 2-rank gloo all_reduce test, launch to teardown, against PyTorch's ``MultiProcessTestCase``;
- a 16-node ``hostname`` fan-out against parallel-ssh and a paramiko thread pool
  (:mod:`bench.fanout`);
- 20 x 10 concurrent ssh on the Kubernetes backend (through the repository's API emulator)
  against the same measurement on the local backend (:mod:`bench.kube_concurrency`).

This module holds what they share: the plan of a run and the child processes peers run in.

The peers are optional (``pip install ray parallel-ssh matplotlib``; PyTorch's test helpers
also need ``expecttest``): a peer that is not installed gives a row that says so.  Peer trials
run in child processes (:mod:`bench.peer_workers`) in their own session, bounded by a hard
timeout after which their whole process group is killed; Ray's processes are also found by
their private temp dir and killed by pid.  Every cluster is torn down in a ``finally``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from bench.records import Figure, Machine, Target, median
from bench.sections import DESIGN, Namer, progress

if TYPE_CHECKING:
    pass

REPO = Path(__file__).resolve().parent.parent
#: Each run's plot, beside its results; ``--update-docs`` copies it to the docs (cli.DOCS_PLOT).
PLOT = Path(__file__).resolve().parent / "results" / "bringup.png"
GLOO_TINY = Path(__file__).resolve().parent / "gloo_tiny.py"
INSTALL_HINT = "pip install ray parallel-ssh matplotlib expecttest"


@dataclass(frozen=True)
class PeerPlan:
    sizes: tuple[int, ...]
    ours_reps: int
    peer_reps_small: int  # Ray and torch mp at N <= 4
    peer_reps_large: int  # Ray and torch mp at N > 4: tens of seconds each on 2 cores
    ray_budget: float  # seconds of Ray bring-up before it stops adding nodes
    gloo_reps: int
    fanout_nodes: int
    fanout_rounds: int
    kube_rounds: int

    @classmethod
    def full(cls) -> PeerPlan:
        return cls(
            sizes=(2, 4, 8, 16, 32),
            ours_reps=3,
            peer_reps_small=2,
            peer_reps_large=1,
            ray_budget=75.0,
            gloo_reps=3,
            fanout_nodes=16,
            fanout_rounds=7,
            kube_rounds=10,
        )

    @classmethod
    def quick(cls) -> PeerPlan:
        return cls(
            sizes=(2, 4, 8),
            ours_reps=1,
            peer_reps_small=1,
            peer_reps_large=1,
            ray_budget=30.0,
            gloo_reps=1,
            fanout_nodes=16,
            fanout_rounds=2,
            kube_rounds=3,
        )


def missing(*modules: str) -> list[str]:
    out = []
    for m in modules:
        try:
            if importlib.util.find_spec(m) is None:
                out.append(m)
        except (ImportError, ValueError):
            out.append(m)
    return out


def mptc_importable() -> str | None:
    """None when PyTorch's ``MultiProcessTestCase`` imports here; otherwise why not."""
    proc = subprocess.run(
        [sys.executable, "-c", "from torch.testing._internal.common_distributed import MultiProcessTestCase"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode == 0:
        return None
    return (proc.stderr.strip().splitlines() or ["import failed"])[-1]


# ------------------------------------------------------------------------------ child trials


class PeerError(RuntimeError):
    """A peer's trial failed; ``timed_out`` when it was killed at its budget (the caller then
    skips larger sizes rather than paying the budget again)."""

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    """End the child's own session (it and everything it spawned), gently, then for sure."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _pids_mentioning(text: str) -> list[int]:
    """Pids whose command line mentions ``text`` (Ray's private temp dir): ours alone."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry))
    return pids


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def child(args: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run ``python -m bench.peer_workers ARGS`` and return its JSON; bounded by ``timeout``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.peer_workers", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.communicate()
        raise PeerError(f"did not finish within {timeout:.0f} s (killed)", timed_out=True) from None
    finally:
        _kill_group(proc)
        try:  # the child is gone; anything it left in its session goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for line in reversed(out.splitlines()):
        if line.startswith("PEER_RESULT "):
            return json.loads(line[len("PEER_RESULT ") :])
    tail = (err.strip().splitlines() or ["no output"])[-1]
    raise PeerError(f"exit {proc.returncode}: {tail[-300:]}")


def ray_trial(n: int, budget: float) -> dict:
    temp_dir = tempfile.mkdtemp(prefix="psky-ray-", dir="/tmp")
    try:
        return child(
            ["ray", str(n), str(budget), temp_dir],
            timeout=budget + 120,
            env={"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_IMPORT_WARNING": "1"},
        )
    finally:
        _kill_pids(_pids_mentioning(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------- bring-up


@dataclass
class Series:
    samples: dict[int, list[float]] = field(default_factory=dict)
    notes: dict[int, str] = field(default_factory=dict)

    def add(self, n: int, value: float) -> None:
        self.samples.setdefault(n, []).append(value)

    def med(self, n: int) -> float | None:
        return median(self.samples.get(n, []))


#: What each of torch's spawned processes imports (``torch.multiprocessing``'s bootstrap),
#: run on every node, so "launch + down" does the same work as the torch baseline.
TORCH_IMPORT = "python -c 'import torch.multiprocessing'"


TORCH_NOTE = (
    "each of torch's spawned processes imports torch (its spawn bootstrap) and runs a no-op; ours "
    f"launches the nodes, runs `{TORCH_IMPORT}` on every node (cluster.run) and tears down"
)


def _ours_up_down(n: int, name: str) -> tuple[float, float, float]:
    """(ready, teardown, total): total = launch, ``TORCH_IMPORT`` on every node, down."""
    import pytest_sky
    from pytest_sky.state import drain_removals

    drain_removals()  # an earlier cluster's files are not deleted during this one
    t0 = time.perf_counter()
    c = pytest_sky.launch(num_nodes=n, name=name)
    try:
        t1 = time.perf_counter()
        res = c.run(TORCH_IMPORT)
        if res.returncode != 0:
            raise RuntimeError(f"{TORCH_IMPORT} failed on the nodes: {res.error or res.output[-300:]}")
    finally:
        t2 = time.perf_counter()
        c.down()
    t3 = time.perf_counter()
    return t1 - t0, t3 - t2, t3 - t0


@dataclass
class _Bringup:
    """What the peers' bring-up section measures, by N."""

    ours_up: Series = field(default_factory=Series)
    ours_down: Series = field(default_factory=Series)
    ours_total: Series = field(default_factory=Series)
    ray_up: Series = field(default_factory=Series)
    ray_down: Series = field(default_factory=Series)
    torch_total: Series = field(default_factory=Series)
    #: Once Ray misses its budget at some N, larger N are not attempted.
    ray_gave_up: bool = False


def bringup(plan: PeerPlan, namer: Namer) -> tuple[list[Figure], dict[str, Series]]:
    got = _Bringup()
    ray_missing = missing("ray")
    _ours_up_down(2, namer("pwarm"))
    if not ray_missing:
        progress("peers bring-up: Ray warm-up (first import, first session)")
        try:
            ray_trial(1, plan.ray_budget)
        except PeerError as exc:
            progress(f"peers bring-up: Ray warm-up failed: {exc}")
    for n in plan.sizes:
        peer_reps = plan.peer_reps_small if n <= 4 else plan.peer_reps_large
        for rep in range(max(plan.ours_reps, peer_reps)):
            progress(f"peers bring-up: N={n} rep {rep + 1}")
            if rep < plan.ours_reps:
                up, down, total = _ours_up_down(n, namer(f"p{n}"))
                got.ours_up.add(n, up)
                got.ours_down.add(n, down)
                got.ours_total.add(n, total)
            if rep < peer_reps:
                _ray_rep(n, plan, got, ray_missing)
                _torch_rep(n, got)
    series = {"pytest-sky (launch -> ready)": got.ours_up, "Ray Cluster": got.ray_up}
    return _bringup_figures(plan, got), {**series, "torch mp spawn+join": got.torch_total}


def _ray_rep(n: int, plan: PeerPlan, got: _Bringup, ray_missing: bool) -> None:
    """One Ray test cluster of ``n`` nodes, up and down, or the note that says why not."""
    if ray_missing:
        got.ray_up.notes[n] = f"Ray not installed ({INSTALL_HINT})"
        return
    if got.ray_gave_up:
        got.ray_up.notes[n] = f"not attempted: Ray missed the {plan.ray_budget:.0f} s budget at a smaller N"
        return
    try:
        r = ray_trial(n, plan.ray_budget)
    except PeerError as exc:
        got.ray_up.notes[n] = f"Ray trial failed: {exc}"
        got.ray_gave_up = exc.timed_out
        return
    got.ray_down.add(n, r["down"])
    if r["capped"] or r["up"] is None:
        got.ray_gave_up = True
        got.ray_up.notes[n] = (
            f"Ray stopped at the {plan.ray_budget:.0f} s budget with {r['added']} of {n} nodes "
            f"added after {r['elapsed_when_capped']:.1f} s (shutdown {r['down']:.1f} s)"
        )
    else:
        got.ray_up.add(n, r["up"])


def _torch_rep(n: int, got: _Bringup) -> None:
    """torch's multiprocessing spawn and join of ``n`` processes, each importing torch."""
    try:
        t = child(["torchmp", str(n)], timeout=120 + 10 * n)
        got.torch_total.add(n, t["seconds"])
    except PeerError as exc:
        got.torch_total.notes[n] = f"torch mp spawn failed: {exc}"


def _bringup_figures(plan: PeerPlan, got: _Bringup) -> list[Figure]:
    figures = []
    section = "peers: bring-up"
    for n in plan.sizes:
        ray_note = got.ray_up.notes.get(n, "")
        rows = (
            ("ready", got.ours_up, got.ray_up, f"Ray Cluster, {n} nodes to wait_for_nodes", ray_note),
            ("teardown", got.ours_down, got.ray_down, f"Ray Cluster.shutdown(), {n} nodes", ""),
            (
                "launch + import torch on every node + down",
                got.ours_total,
                got.torch_total,
                f"torch mp spawn+join {n} procs",
                got.torch_total.notes.get(n, "") or (TORCH_NOTE if n == plan.sizes[0] else ""),
            ),
        )
        for what, ours, peer, peer_name, note in rows:
            figures.append(
                Figure(
                    section=section,
                    name=f"{what}, {n} nodes",
                    unit="s",
                    value=ours.med(n),
                    baseline=peer.med(n),
                    baseline_name=peer_name,
                    samples=ours.samples.get(n, []),
                    baseline_samples=peer.samples.get(n, []),
                    note=note,
                )
            )
    return figures


def plot(series: dict[str, Series], sizes: tuple[int, ...], machine: Machine, path: Path = PLOT) -> str:
    """Bring-up time against N, one line per tool; returns a line saying what it wrote."""
    if missing("matplotlib"):
        return f"plot: matplotlib not installed ({INSTALL_HINT}); {path.name} not written"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=110)
    for (label, s), marker in zip(series.items(), ("o", "s", "^"), strict=False):
        xs = [n for n in sizes if s.med(n) is not None]
        ys = [s.med(n) for n in xs]
        gaps = [str(n) for n in sizes if s.med(n) is None]
        if gaps:
            label += f" (not measured at N={','.join(gaps)})"
        ax.plot(xs, ys, marker=marker, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(sizes))
    ax.set_xticklabels([str(n) for n in sizes])
    ax.set_xlabel("nodes / processes (N)")
    ax.set_ylabel("seconds (median), log scale")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(
        f"Local bring-up vs N: {machine.cpus} CPUs, {machine.uname}\n{machine.date_utc}, `python -m bench --peers`",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return f"plot: wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}"


# ------------------------------------------------------------------------- gloo test overhead


def _ours_gloo_test(name: str) -> float:
    import pytest_sky

    t0 = time.perf_counter()
    c = pytest_sky.launch(num_nodes=2, name=name)
    try:
        res = c.run(f"{sys.executable} {GLOO_TINY}", timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"gloo test on the nodes failed: {res.error}\n{res.output[-800:]}")
    finally:
        c.down()
    return time.perf_counter() - t0


def gloo_test(plan: PeerPlan, namer: Namer) -> list[Figure]:
    why = mptc_importable()
    ours: list[float] = []
    peer: list[float] = []
    peer_wall: list[float] = []
    notes = []
    _ours_gloo_test(namer("gwarm"))
    for rep in range(plan.gloo_reps):
        progress(f"peers gloo test: rep {rep + 1}/{plan.gloo_reps}")
        ours.append(_ours_gloo_test(namer("gloo")))
        if why is None:
            t0 = time.perf_counter()
            try:
                r = child(["mptc"], timeout=180)
            except PeerError as exc:
                notes.append(f"MultiProcessTestCase run failed: {exc}")
                continue
            peer_wall.append(time.perf_counter() - t0)
            if not r["ok"]:
                notes.append(f"MultiProcessTestCase test did not pass: {r['problems']}")
                continue
            peer.append(r["seconds"])
    if why is not None:
        notes.append(f"MultiProcessTestCase not importable here ({why}; {INSTALL_HINT})")
    if peer_wall:
        notes.append(
            f"baseline = unittest run inside the child (spawn, 2 ranks, join); with the child's interpreter "
            f"start and torch import it was {statistics.median(peer_wall):.2f} s"
        )
    return [
        Figure(
            section="peers: gloo test",
            name="2-rank gloo all_reduce test, launch to teardown",
            unit="s",
            value=median(ours),
            baseline=median(peer),
            baseline_name="MultiProcessTestCase, 2 spawned ranks",
            targets=[Target(1.5, DESIGN)],
            samples=ours,
            baseline_samples=peer,
            note="; ".join(dict.fromkeys(notes)),
        )
    ]
