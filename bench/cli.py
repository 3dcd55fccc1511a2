"""``python -m bench [--quick] [--peers] [--update-docs]``: measure, print, save, optionally publish.

The benchmark keeps its cluster state in a private ``PYTEST_SKY_HOME`` (unless one is set)
so it never mixes with the records of tests that other engineers run on this machine at the
same time, and it tears down anything it launched even when interrupted or sent SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench import report
from bench.records import Figure, Machine

if TYPE_CHECKING:  # imported for real only once PYTEST_SKY_HOME is settled (main)
    from bench.peers import PeerPlan, Series
    from bench.sections import Namer

BENCH_DIR = Path(__file__).resolve().parent
RESULTS = BENCH_DIR / "results" / "latest.json"
#: The docs' performance page: its table and plot are this program's, never typed.
PAGE = BENCH_DIR.parent / "docs" / "performance.md"
DOCS_PLOT = PAGE.parent / "img" / "bringup.png"
#: The page's link to the plot, relative to the page.
PLOT_LINK = str(DOCS_PLOT.relative_to(PAGE.parent))
#: The results the page's table was generated from, committed with it (``results/`` is each
#: run's own scratch and not kept): a later run can be compared with them figure by figure.
PUBLISHED = BENCH_DIR / "published.json"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Benchmark pytest-sky's local backend against same-run baselines (DESIGN.md section 7).",
    )
    p.add_argument("--quick", action="store_true", help="fewer repetitions, clusters up to 8 nodes (< 30 s)")
    p.add_argument(
        "--update-docs",
        "--update-readme",  # its name while the table lived in the README
        dest="update_docs",
        action="store_true",
        help=(
            f"write the results table (and the --peers plot) into {PAGE.relative_to(BENCH_DIR.parent)} between "
            f"{report.PAGE_START} and {report.PAGE_END}, and the figures into {PUBLISHED.relative_to(BENCH_DIR.parent)}"
        ),
    )
    p.add_argument(
        "--republish",
        action="store_true",
        help=f"measure nothing: render the page's table again from {PUBLISHED.relative_to(BENCH_DIR.parent)}",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help=(
            "also measure against peers in the same run (off by default; slow, several minutes): "
            "bring-up vs a local Ray test cluster and torch multiprocessing spawn for N=2..32, a 2-rank "
            "gloo test vs PyTorch's MultiProcessTestCase, a 16-node hostname fan-out vs parallel-ssh and a "
            "paramiko thread pool, 20x10 concurrent ssh on the Kubernetes backend (API emulator); plots "
            "bring-up vs N to bench/results/bringup.png (--update-docs publishes it). Peers are optional: "
            "pip install ray parallel-ssh matplotlib expecttest; a missing one is reported in its row"
        ),
    )
    p.add_argument(
        "--shared-clusters",
        action="store_true",
        help=(
            'also measure a module of 10 multinode tests with scope="module" against the same tests with a '
            "cluster each, on the Kubernetes backend (API emulator); part of --peers too (a few minutes)"
        ),
    )
    return p.parse_args(argv)


def _terminate(signum: int, _frame: object) -> None:
    """SIGTERM/SIGHUP become SystemExit so every ``finally`` (cluster teardown) runs."""
    raise SystemExit(128 + signum)


def _sweep(prefix: str) -> None:
    """Safety net after the run: any record of ours still in the state store is torn down."""
    from pytest_sky import get_cluster
    from pytest_sky.state import StateStore

    store = StateStore()
    for record in store.records():
        if record.name.startswith(prefix + "-"):
            sys.stderr.write(f"bench: tearing down leftover cluster {record.name}\n")
            get_cluster(record.name, store).down()


Steps = list[tuple[str, Callable[[], list[Figure]]]]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.republish:
        print(report.update_page(PAGE, published_block(report.load(PUBLISHED))))
        return 0
    if os.geteuid() != 0:
        sys.stderr.write("bench: the local backend needs root (network namespaces): run it as root\n")
        return 2
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGHUP, _terminate)

    own_home = None
    if not os.environ.get("PYTEST_SKY_HOME"):
        own_home = tempfile.mkdtemp(prefix="pytest-sky-bench-home-")
        os.environ["PYTEST_SKY_HOME"] = own_home
    workdir = Path(tempfile.mkdtemp(prefix="pytest-sky-bench-"))
    # A peer that imports torch's distributed test helpers here (MultiProcessTestCase) leaves
    # /tmp/torchinductor_<user> behind; peers inherit this, and the workdir goes at the end.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(workdir / "torchinductor"))

    from bench import sections  # after PYTEST_SKY_HOME is settled

    mode = ("quick" if args.quick else "full") + (", peers" if args.peers else "")
    mode += ", shared clusters" if args.shared_clusters and not args.peers else ""
    namer = sections.Namer()
    machine = Machine.detect()
    figures: list[Figure] = []
    errors: list[str] = []
    peer_series: dict[str, Series] = {}
    started = time.perf_counter()
    steps, peer_plan = _steps(args, namer, workdir, figures, peer_series)
    try:
        _measure(steps, figures, errors)
    finally:
        try:
            _sweep(namer.prefix)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if own_home is not None:
                shutil.rmtree(own_home, ignore_errors=True)
    duration = time.perf_counter() - started
    machine = machine.finished()
    plot_line = None
    if peer_plan is not None and peer_series:
        from bench import peers

        try:
            plot_line = peers.plot(peer_series, peer_plan.sizes, machine)
        except Exception as exc:  # noqa: BLE001 - a broken plot must not lose the table
            plot_line = f"plot: failed: {type(exc).__name__}: {exc}"
            errors.append(plot_line)
    _report(args, machine, mode, duration, figures, errors, plot_line)
    return 1 if errors else 0


def _steps(
    args: argparse.Namespace, namer: Namer, workdir: Path, figures: list[Figure], peer_series: dict[str, Series]
) -> tuple[Steps, PeerPlan | None]:
    """The sections this run measures, in order, and the peers' plan (None without ``--peers``).
    ``figures`` is the list the run fills: the Kubernetes section reads the local rows in it."""
    from bench import hang_report, rootless, sections, slurm

    plan = sections.Plan.quick() if args.quick else sections.Plan.full()
    steps: Steps = [
        ("bring-up", lambda: sections.bringup(plan, namer, workdir)),
        ("run latency", lambda: sections.run_latency(plan, namer)),
        ("ssh concurrency", lambda: sections.concurrency(plan, namer)),
        ("all_reduce", lambda: sections.allreduce(plan, namer)),
        (hang_report.SECTION, lambda: hang_report.measure(plan, namer)),
        (rootless.SECTION, lambda: rootless.versus_root(plan, namer)),
        (slurm.SECTION, lambda: slurm.versus_local(plan, namer)),
    ]
    peer_plan = None
    if args.peers:
        from bench import fanout, kube_concurrency, peers

        peer_plan = peers.PeerPlan.quick() if args.quick else peers.PeerPlan.full()

        def peer_bringup() -> list[Figure]:
            figs, series = peers.bringup(peer_plan, namer)
            peer_series.update(series)
            return figs

        steps += [
            ("peers: bring-up", peer_bringup),
            ("peers: gloo test", lambda: peers.gloo_test(peer_plan, namer)),
            ("peers: ssh fan-out", lambda: fanout.measure(peer_plan, namer)),
            ("peers: ssh concurrency, kubernetes", lambda: kube_concurrency.measure(peer_plan, namer, figures)),
        ]
    if args.peers or args.shared_clusters:
        from bench.shared_clusters import SECTION, shared_clusters

        steps.append((SECTION, lambda: shared_clusters(args.quick)))
    return steps, peer_plan


def _measure(steps: Steps, figures: list[Figure], errors: list[str]) -> None:
    """Each section in turn, its figures into ``figures``; one that fails is a row saying so."""
    for name, step in steps:
        try:
            figures += step()
        except Exception as exc:  # noqa: BLE001 - one failed section must not hide the others
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            figures.append(Figure(section=name, name="(not measured)", unit="s", value=None, error=str(exc)))


def _report(
    args: argparse.Namespace,
    machine: Machine,
    mode: str,
    duration: float,
    figures: list[Figure],
    errors: list[str],
    plot_line: str | None,
) -> None:
    """The table on stdout, the results file, and with ``--update-docs`` the page's table and plot."""
    print(report.header(machine, mode))
    print()
    print(report.text_table(figures))
    print()
    print(report.LEGEND)
    for line in report.notes(figures, errors):
        print(line)
    if plot_line:
        print(plot_line)
    report.write_json(RESULTS, machine, mode, duration, figures, errors)
    print(f"total {duration:.1f} s; results in {RESULTS.relative_to(BENCH_DIR.parent)}")
    if args.update_docs:
        from bench import peers

        plotted = bool(plot_line and plot_line.startswith("plot: wrote"))
        if plotted:
            DOCS_PLOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(peers.PLOT, DOCS_PLOT)
        report.write_json(PUBLISHED, machine, mode, duration, figures, errors, plotted=plotted)
        block = published_block(report.load(PUBLISHED))
        print(report.update_page(PAGE, block) + f"; its figures in {PUBLISHED.relative_to(BENCH_DIR.parent)}")


def published_block(published: report.Published) -> str:
    """The page's block, from the results file alone: a run's ``--update-docs`` and
    ``--republish`` write the same block from the same file (tests/test_docs_site.py holds the
    page to it)."""
    return report.markdown(
        published.machine,
        published.mode,
        published.figures,
        image=PLOT_LINK if published.plotted else None,
        source=str(PUBLISHED.relative_to(BENCH_DIR.parent)),
    )
