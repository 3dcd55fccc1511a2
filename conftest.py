"""Repository-wide test settings: a private state directory (a killed run's removed by the
next run), and a leak check at the end.

The leak check is what the before-stop hook checks, made part of every run: after the
session, no namespace node, link or sshd of this run may remain on this machine.  Another
run on the same machine is told apart by paths: every link's alias and every node process's
command line name the cluster directory they belong to.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import pytest

#: README.md's and docs/'s code blocks are tests too (tests/doc_examples.py says how each runs).
pytest_plugins = ("tests.doc_examples",)

# Keep this repository's runs away from a user's own ~/.pytest_sky, and give each run its
# own state directory (xdist workers inherit the controller's, set here before they start).
_HOME_PREFIX = "pytest-sky-tests-"
#: In a run's own state directory: "<pid> <start time>" of the run, so that a later run can
#: tell the directory of one that was killed (it kept no promise to remove it).
_OWNER_FILE = "tests-owner"


def _sweep_killed_runs() -> None:
    """The state directories of this user's runs that were killed (SIGKILL, a CI timeout):
    what they left is reaped as a killed run's clusters are, then the directory goes."""
    from pytest_sky import procs

    for home in Path(tempfile.gettempdir()).glob(_HOME_PREFIX + "*"):
        try:
            if home.stat().st_uid != os.getuid():
                continue
            pid, start = (int(word) for word in (home / _OWNER_FILE).read_text().split())
        except (OSError, ValueError):
            continue  # another user's, or a run that has not written its owner yet
        if procs.is_alive(pid, start):
            continue
        from pytest_sky.lifecycle import reap
        from pytest_sky.state import StateStore

        reap(StateStore(home))
        shutil.rmtree(home, ignore_errors=True)


if "PYTEST_SKY_HOME" not in os.environ:
    _sweep_killed_runs()
    os.environ["PYTEST_SKY_HOME"] = _OWN_HOME = tempfile.mkdtemp(prefix=_HOME_PREFIX)
    from pytest_sky.procs import start_time

    Path(_OWN_HOME, _OWNER_FILE).write_text(f"{os.getpid()} {start_time(os.getpid())}\n")
else:
    _OWN_HOME = ""


def _testbeds_up() -> tuple[str, ...]:
    """The cluster directories of the Slurm testbeds already up in this state directory when
    the session began: what the session runs against (``scripts/with-slurm-testbed``, whose
    testbed lives in ``$PYTEST_SKY_HOME/slurm-testbed`` where a caller sets the same home),
    not what it left.  A testbed a test starts is named afresh, so the check still sees it."""
    clusters = Path(os.environ["PYTEST_SKY_HOME"]) / "slurm-testbed" / "clusters"
    return tuple(str(path) for path in clusters.glob("*"))


_TESTBEDS_UP = _testbeds_up()


def leaked_resources(scopes: list[str], exempt: tuple[str, ...] = ()) -> list[str]:
    """Links and node processes of ours that belong to this run: their alias or command line
    names a path under one of ``scopes`` (another run on the same machine is not ours) and
    none under ``exempt``."""
    from pytest_sky.doctor import link_owners, node_processes

    def mine(text: str) -> bool:
        return any(scope in text for scope in scopes) and not any(path in text for path in exempt)

    leaks = [f"link {n} ({owner})" for n, owner in link_owners().items() if mine(owner)]
    leaks += [f"process {p}: {c}" for p, c in node_processes() if mine(c)]
    from pytest_sky.backends.netns import orphaned_cgroups
    from pytest_sky.state import drain_removals

    drain_removals()
    trash = [f"files {p}" for scope in scopes for p in (Path(scope) / "trash").glob("*")]
    return leaks + [f"cgroup {path}" for path in orphaned_cgroups()] + trash


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches the pytest runs the tests start, as it does from a terminal.

    A shell starts a background job (``pytest ... &``, ``nohup``) with SIGINT ignored, and
    children inherit an ignored signal: the inner runs of the interrupt tests would then
    never see the Ctrl-C they are sent (they ran on, and their clusters outlived the test).
    A handler of our own is reset to the default at exec, so children get Python's usual
    KeyboardInterrupt again."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    _pass_plugins_off_to_inner_runs(config)
    config.addinivalue_line(
        "markers",
        "long(seconds): takes about that long alone on a 2-core machine; the longest start first"
        " (see pytest_collection_modifyitems)",
    )


def _seconds(item: pytest.Item) -> float:
    marker = item.get_closest_marker("long")
    return float(marker.args[0]) if marker and marker.args else 0.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The long tests start first, longest first, one per xdist worker, instead of wherever
    they fall.

    The suite is CPU-bound on 2 cores, so its wall time is its CPU time over two, plus
    whatever time it spends at the end with one long test running alone: in collection
    order the smoke tests came last and the run ended waiting ~20 s on NeMo and elastic
    training.  xdist's worksteal gives each worker a contiguous share of this list and steals
    from the shares' ends, so each share begins with its turn of the long tests (the order
    must be the same in every worker, and is: it depends on the list and the worker count).
    """
    long = sorted((item for item in items if item.get_closest_marker("long")), key=_seconds, reverse=True)
    if not long:
        return
    rest = [item for item in items if not item.get_closest_marker("long")]
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    ordered: list[pytest.Item] = []
    left = len(items)
    for share in range(workers):
        size = left // (workers - share)  # as worksteal sizes the shares it sends first
        head = long[share::workers][:size]
        ordered += head + rest[: size - len(head)]
        del rest[: size - len(head)]
        left -= size
    placed = {id(item) for item in ordered}
    items[:] = ordered + [item for item in long if id(item) not in placed] + rest


def _pass_plugins_off_to_inner_runs(config: pytest.Config) -> None:
    """The inner pytest runs the tests start (pytester, the interrupt and reaping tests, xdist
    workers) skip the plugins pyproject's addopts switch off (``-p no:NAME``), as this run
    does: an inner run reads no pyproject."""
    args = config.getini("addopts")
    off = [f"-p {name}" for flag, name in itertools.pairwise(args) if flag == "-p" and name.startswith("no:")]
    given = os.environ.get("PYTEST_ADDOPTS", "")
    os.environ["PYTEST_ADDOPTS"] = " ".join([given, *(o for o in off if o not in given)]).strip()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # xdist workers: the controller checks once everything is done
    scopes = [os.environ["PYTEST_SKY_HOME"]]
    factory = getattr(session.config, "_tmp_path_factory", None)
    if factory is not None:
        scopes.append(str(factory.getbasetemp()))
    leaks = leaked_resources(scopes, _TESTBEDS_UP)
    if leaks:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("pytest-sky leak check: left on this machine: " + "; ".join(leaks), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    elif _OWN_HOME and not any((Path(_OWN_HOME) / "clusters").glob("*/record.json")):
        shutil.rmtree(_OWN_HOME, ignore_errors=True)
