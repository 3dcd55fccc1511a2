"""The pytest plugin: options, markers and fixtures of the public contract (DESIGN.md section 2).

Silent until asked: a session that asks for no cluster gets the options, the markers and
the report header's line, and nothing else: no file or directory made, no signal handler
changed, no reaper run, none of the cluster machinery imported (paramiko, the backends, the
state directory's module).  The first cluster request of a process (an xdist worker is one)
does that set-up, once (:func:`_set_up`); the xdist controller never makes one.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pytest

from pytest_sky import interrupts  # tiny; a signal handler is no place for an import
from pytest_sky.markers import MARKERS, MultinodeRequest, bound, marker_request
from pytest_sky.node_needs import missing_on_nodes, require_on_nodes  # noqa: F401 - where they always were

if TYPE_CHECKING:
    from _pytest.nodes import Node

    from pytest_sky.cluster import Cluster
    from pytest_sky.runner import StoppedRun
    from pytest_sky.settings import Settings


@dataclass(frozen=True)
class _ShareKey:
    """Which tests share a cluster: those of one scope node, asking for one shape, on one backend."""

    scope: str
    node_id: str
    shape: tuple[tuple[str, str], ...]
    backend: str


@dataclass
class _SessionState:
    settings: Settings
    started: float = field(default_factory=time.time)
    #: Every cluster this process made and has not torn down itself (one the user took down
    #: stays until the session ends, for the report of the test that did).
    live: list[Cluster] = field(default_factory=list)
    shared: dict[_ShareKey, Cluster] = field(default_factory=dict)
    #: Whether this process asked for a cluster, and so did the set-up (:func:`_set_up`).
    ready: bool = False
    #: The SIGTERM handler the set-up replaced, put back when the session ends.
    sigterm: Any = None
    #: Clusters of killed runs the set-up removed (under xdist the controller gathers the
    #: workers': its summary names them).
    reaped: list[str] = field(default_factory=list)
    #: What else of killed runs it removed, on the whole machine (bridges whose owner died:
    #: ``lifecycle.reap_strays``), each as the reaper names it.
    strays: list[str] = field(default_factory=list)
    #: The test running now (a factory's cluster is named after it).
    current: pytest.Item | None = None
    #: Runs stopped (Ctrl-C, SIGTERM) that no test's report showed: the terminal summary does.
    unreported: list[StoppedRun] = field(default_factory=list)
    #: Those a test's report showed (by ``id``).
    reported: set[int] = field(default_factory=set)
    #: The backends whose stale clusters this session has reaped (on its first cluster of each).
    reaped_stale: set[str] = field(default_factory=set)

    def note_unreported(self, cluster: Cluster) -> None:
        """Before ``cluster`` goes: its stopped runs that no report showed."""
        for stopped in cluster.stopped:
            if id(stopped) not in self.reported:
                self.reported.add(id(stopped))  # once: a cluster may go through here twice
                self.unreported.append(stopped)


_state_key = pytest.StashKey[_SessionState]()
# The clusters a test was lent by its fixtures, for its failure report (its own and shared ones).
_item_clusters_key = pytest.StashKey[list["Cluster"]]()
# When the test began (``time.time()``): of the session's other clusters, its report shows
# those used since then, and their runs since then.
_item_started_key = pytest.StashKey[float]()
#: What an xdist worker hands its controller (``workeroutput``): the clusters it reaped,
#: and the other leftovers it removed.
_REAPED_OUTPUT, _STRAYS_OUTPUT = "pytest_sky_reaped", "pytest_sky_strays"


def _reported(item: pytest.Item) -> list[Cluster]:
    return item.stash.setdefault(_item_clusters_key, [])


def pytest_addoption(parser: pytest.Parser) -> None:
    """Every row of the settings table is an option here, with its environment twin named,
    and an ini key (``sky_<name>``)."""
    from pytest_sky import settings

    group = parser.getgroup(
        "sky", "pytest-sky: multi-node clusters (each option has a PYTEST_SKY_* twin and a sky_* ini key)"
    )
    for option in settings.OPTIONS:
        group.addoption(option.flag, dest=option.dest, default=None, **option.argparse_kwargs(option.env))
        parser.addini(option.ini, f"pytest-sky: {option.help} (as {option.flag})", default="")


def settings_from(config: pytest.Config) -> Settings:
    """The session's settings: this command line's options over the environment's twins over
    the ini file's keys."""
    from pytest_sky import settings

    ini = {o.ini: str(config.getini(o.ini)) for o in settings.OPTIONS}
    where = config.inipath.name if config.inipath is not None else "the ini file"
    try:
        got = settings.resolve(ini=ini, ini_file=where, **{o.name: config.getoption(o.dest) for o in settings.OPTIONS})
    except settings.SettingsError as exc:
        raise pytest.UsageError(str(exc)) from None
    return got if got.rootdir else replace(got, rootdir=str(config.rootpath))  # local nodes see the test's tree


def pytest_report_header(config: pytest.Config) -> str | None:
    """The effective settings, each with where it came from (option, environment, default)."""
    state = config.stash.get(_state_key, None)
    return state.settings.describe(_backend_mode(state.settings.backend)) if state is not None else None


def _backend_mode(backend: str) -> str:
    """How the backend would run here, for the header, asked of nothing but this process's
    capabilities (the backends are not imported, and nothing is tried): the local one runs
    rootless for an ordinary user.  Whether it can, its first launch says, in one line."""
    from pytest_sky import registry
    from pytest_sky.procs import holds_root_caps

    local = registry.lookup(backend).name == "local"
    return "rootless" if local and os.geteuid() != 0 and not holds_root_caps() else ""


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (CI timeouts, `kill`) becomes what Ctrl-C is: pytest stops and tears down."""
    interrupts.request(signum)


@pytest.hookimpl(tryfirst=True)
def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    """The stop was seen, and pytest's report of it must not fail (``interrupts.reportable``)."""
    interrupts.seen()
    interrupts.reportable(excinfo)


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}" if not help_text.startswith(name) else help_text)
    settings = settings_from(config)
    if settings.artifacts:
        from pytest_sky.failure_report import artifacts_problem

        problem = artifacts_problem(settings.artifacts)
        if problem:
            raise pytest.UsageError(problem)
    config.stash[_state_key] = _SessionState(settings=settings)
    from pytest_sky.failure_report import JunitWriter

    config.pluginmanager.register(JunitWriter(config), "pytest-sky-junit")


def _set_up(state: _SessionState) -> None:
    """The first cluster request of this process, once: SIGTERM becomes what Ctrl-C is (so a
    CI job's cancel tears clusters down), and clusters whose owner died (a run killed with
    SIGKILL) are reaped before new ones are made, with whatever else of such runs is left
    on the machine (``lifecycle.reap_strays``); what a backend's site still runs for an owner
    that is gone goes per backend, in :func:`_reap_stale`."""
    if state.ready:
        return
    state.ready = True
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        state.sigterm = signal.signal(signal.SIGTERM, _terminate)
    import warnings

    from pytest_sky.errors import SkyError
    from pytest_sky.lifecycle import reap_clusters, reap_strays
    from pytest_sky.state import StateStore

    try:
        store = StateStore()
        state.reaped += reap_clusters(store)
        state.strays += reap_strays(store)
    except (SkyError, OSError) as exc:
        warnings.warn(pytest.PytestWarning(f"pytest-sky: reaping failed: {exc}"), stacklevel=2)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The test's start, before its fixtures: what its report shows of clusters begins here."""
    item.stash[_item_started_key] = time.time()
    state = item.config.stash.get(_state_key, None)
    if state is not None:
        state.current = item
        state.live[:] = [c for c in state.live if not c.is_down]  # the user's own down(), seen by its test


def _backend_gpu_absence(settings: Settings) -> str | None:
    """None where the backend has a GPU, else why not (the GPU tests' skip reason)."""
    from pytest_sky.backends import get_backend
    from pytest_sky.errors import SkyError

    try:
        backend = get_backend(settings.backend, **settings.backend_options())
        return None if backend.has_gpus() else backend.gpus_unseen()
    except SkyError:  # the backend is unusable; its tests fail with the reason on their own
        return f"the {settings.backend} backend has none on this machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Backend-dependent skips, as markers: the report then points at the test, with the reason."""
    settings = config.stash[_state_key].settings
    on_k8s = settings.backend == "kubernetes"
    no_gpu: str | None = ""  # "": not asked yet
    for item in items:
        if item.get_closest_marker("kubernetes") and not on_k8s:
            item.add_marker(pytest.mark.skip(reason="runs only on the Kubernetes backend (--kubernetes)"))
        if item.get_closest_marker("no_kubernetes") and on_k8s:
            item.add_marker(pytest.mark.skip(reason="not supported on the Kubernetes backend"))
        no_slurm = item.get_closest_marker("no_slurm")
        if no_slurm is not None and settings.backend == "slurm":
            item.add_marker(pytest.mark.skip(reason=": ".join(["not supported on Slurm", *no_slurm.args[:1]])))
        if item.get_closest_marker("gpu"):
            if no_gpu == "":
                no_gpu = _backend_gpu_absence(settings)
            if no_gpu is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs a GPU; {no_gpu}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when not in ("call", "setup"):
        return report
    clusters = _used_by(item)
    if clusters:
        from pytest_sky import failure_report

        state = item.config.stash.get(_state_key, None)
        since = item.stash.get(_item_started_key, 0.0)
        settings = state.settings if state is not None else None
        failure_report.add(item, report, clusters, since, settings, state.reported if state is not None else None)
    return report


def _used_by(item: pytest.Item) -> list[Cluster]:
    """The clusters the test's fixtures lent it, then the session's others it used
    (a factory's, held by a user's fixture of any scope): made or run on since it began."""
    lent = item.stash.get(_item_clusters_key, [])
    state = item.config.stash.get(_state_key, None)
    if state is None or not state.live:
        return list(lent)
    from pytest_sky.artifacts import used_since

    since = item.stash.get(_item_started_key, 0.0)
    return [*lent, *(c for c in state.live if c not in lent and used_since(c, since))]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Last line of defence, in a process that asked for clusters: those of ours still up are
    torn down, then the files of every cluster it tore down, deleted in the background, are
    gone too, and SIGTERM is what it was.  An xdist worker tells its controller what it reaped."""
    state = session.config.stash.get(_state_key, None)
    if state is None or not state.ready:
        return
    from pytest_sky.state import drain_removals

    try:
        if not state.settings.keep_clusters:
            for cluster in list(state.live):
                state.note_unreported(cluster)
                if not cluster.is_down:
                    cluster.down()
        state.live.clear()
        drain_removals()
    finally:
        _restore_sigterm(state)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[_REAPED_OUTPUT] = list(state.reaped)
        workeroutput[_STRAYS_OUTPUT] = list(state.strays)


def _restore_sigterm(state: _SessionState) -> None:
    if state.sigterm is not None:
        import signal

        signal.signal(signal.SIGTERM, state.sigterm)
        state.sigterm = None


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """xdist's controller: a worker ended, with what it reaped (its summary names them)."""
    state = node.config.stash.get(_state_key, None)
    if state is not None:
        output = getattr(node, "workeroutput", {})
        state.reaped += output.get(_REAPED_OUTPUT, [])
        state.strays += output.get(_STRAYS_OUTPUT, [])


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int) -> None:
    """Where the ranks were when the session was interrupted (runs no test's report showed);
    what a killed run had left and this one reaped; kept clusters, read from the state store
    (under xdist the workers kept them)."""
    state = terminalreporter.config.stash.get(_state_key, None)
    if state is not None and exitstatus == pytest.ExitCode.INTERRUPTED:
        for stopped in state.unreported:
            terminalreporter.section(f"pytest-sky: {stopped.capture.cluster}: where every rank was")
            terminalreporter.write(stopped.capture.summary())
    if state is None:
        return
    if state.reaped:
        terminalreporter.write_line(
            f"pytest-sky: reaped {len(state.reaped)} cluster(s) left by a killed run: {', '.join(state.reaped)}"
        )
    if state.strays:
        terminalreporter.write_line(f"pytest-sky: removed what killed runs had left: {', '.join(state.strays)}")
    if state.settings.keep_clusters:
        _summarise_kept(terminalreporter, state)


def _summarise_kept(terminalreporter: Any, state: _SessionState) -> None:
    from pytest_sky.settings import state_home

    if not (state_home() / "clusters").is_dir():
        return  # no cluster was ever made here: nothing can have been kept
    from pytest_sky.state import StateStore

    store = StateStore()
    kept = [r for r in store.records() if r.keep and r.created >= state.started]
    if not kept:
        return
    terminalreporter.section("pytest-sky: kept clusters")
    for r in kept:
        cfg = store.cluster_dir(r.name) / "ssh_config"
        terminalreporter.write_line(
            f"{r.name}: {r.num_nodes} node(s), head {r.node_ips[0] if r.node_ips else '?'}; "
            f"ssh -F {cfg} {r.name}; remove with: pytest-sky down {r.name}"
        )


@pytest.fixture(scope="session")
def sky_settings(request: pytest.FixtureRequest) -> Settings:
    """The session's resolved settings (what the report header shows), e.g. to skip a test
    that needs ``--kube-shared-pvc`` on Kubernetes."""
    return request.config.stash[_state_key].settings


@pytest.fixture(scope="session")
def sky_backend(request: pytest.FixtureRequest) -> str:
    """The selected backend's name: 'local', 'kubernetes' or 'slurm'."""
    return request.config.stash[_state_key].settings.backend


@pytest.fixture
def sky_launch(request: pytest.FixtureRequest, sky_backend: str) -> Iterator[Callable[..., Cluster]]:
    """Factory: ``sky_launch(task=None, *, num_nodes=None, name=None, **resources) -> Cluster``.

    A task given (a Task or a YAML path) is launched and its result kept as
    ``cluster.last_result``; ``timeout=`` bounds that run (default: ``--sky-run-timeout``,
    as for every run on the cluster).  Every cluster is torn down after the test, pass or
    fail, and only after its report has what it needs: a launch whose task fails or times
    out leaves its cluster to this fixture.
    """
    state = request.config.stash[_state_key]
    mine: list[Cluster] = []
    item = request.node
    reported = _reported(item)

    from pytest_sky.settings import SESSION_DEADLINE

    def factory(
        task: Any = None,
        *,
        num_nodes: int | None = None,
        name: str | None = None,
        timeout: Any = SESSION_DEADLINE,
        **resources: Any,
    ) -> Cluster:
        return _launch_or_fail(
            state,
            task,
            num_nodes=num_nodes,
            name=name,
            name_label=_name_label(item.name, len(mine)),
            on_created=_track,
            run_timeout=timeout,
            **resources,
        )

    def _track(cluster: Cluster) -> None:
        mine.append(cluster)
        reported.append(cluster)

    try:
        yield factory
    finally:
        _tear_down(state, mine)


def _name_label(label: str, index: int) -> str:
    from pytest_sky import cluster_names

    return cluster_names.label(label, os.environ.get("PYTEST_XDIST_WORKER", ""), index)


def _launch_or_fail(state: _SessionState, task: Any = None, **options: Any) -> Cluster:
    """``launch`` with the session's settings, tracked for the last-line teardown, which the
    plugin owns from the moment the cluster is up (``on_created``); a problem fails the test
    with one line."""
    from pytest_sky.cluster import launch
    from pytest_sky.errors import SkyError

    on_created = options.pop("on_created", None)

    settings = state.settings

    def track(cluster: Cluster) -> None:
        cluster.keep_up = settings.keep_clusters  # kept, whoever asks it to go
        cluster.run_timeout = state.settings.run_deadline  # every run of the test has a deadline
        state.live.append(cluster)
        if on_created is not None:
            on_created(cluster)

    _set_up(state)
    _reap_stale(state, settings)
    try:
        return launch(task, settings=settings, keep=settings.keep_clusters, on_created=track, **options)
    except SkyError as exc:
        problem = str(exc)
    # Outside the except block: the report shows one line, not a chained traceback.
    pytest.fail(f"pytest-sky: {problem}", pytrace=False)


def _reap_stale(state: _SessionState, settings: Settings) -> None:
    """Before this session's first cluster on a backend: that backend's clusters whose owner is
    gone, found on its site rather than in a state directory (a CI runner that vanished, on
    any machine: its Kubernetes lease expired; a Slurm allocation whose session was killed on
    a state directory since deleted) are removed, and the session's summary names them with
    the other clusters of killed runs; a failure to is a warning, never the test's.  Only a
    session that asks for a cluster looks."""
    import warnings

    from pytest_sky.backends import get_backend
    from pytest_sky.errors import SkyError

    if settings.backend in state.reaped_stale:
        return
    state.reaped_stale.add(settings.backend)
    try:
        state.reaped += get_backend(settings.backend, **settings.backend_options()).reap_stale()
    except SkyError as exc:
        warnings.warn(pytest.PytestWarning(f"pytest-sky: could not reap stale clusters: {exc}"), stacklevel=2)


def _tear_down(state: _SessionState, clusters: list[Cluster]) -> None:
    """Every cluster of one test, newest first, unless kept; each failure reported, none skipped."""
    errors = []
    for cluster in reversed(clusters):
        state.note_unreported(cluster)
        if state.settings.keep_clusters:
            continue
        try:
            cluster.down()
        except Exception as exc:  # noqa: BLE001 - report every failed teardown, not the first
            errors.append(f"{cluster.name}: {exc}")
        if cluster in state.live:
            state.live.remove(cluster)
    if errors:
        pytest.fail("pytest-sky: teardown failed: " + "; ".join(errors), pytrace=False)


@pytest.fixture
def sky_cluster(request: pytest.FixtureRequest, sky_launch: Callable[..., Cluster]) -> Cluster:
    """One cluster for this test, shaped by its ``multinode`` marker (default: 2 nodes); with
    ``scope=`` other than "function", the one its scope's tests of that shape share."""
    want = marker_request(request.node)
    if want.scope == "function":
        return sky_launch(**want.shape)
    return _shared_cluster(request.node, want)


def _scope_node(item: pytest.Item, scope: str) -> Node:
    """The node whose end ends a shared cluster; a class scope outside a class is the module's,
    as for pytest's own class-scoped fixtures."""
    if scope == "session":
        return item.session
    node = item.getparent(pytest.Class) if scope == "class" else None
    return node or item.getparent(pytest.Module) or item.session


def _shared_cluster(item: pytest.Item, want: MultinodeRequest) -> Cluster:
    """The cluster this scope's tests of this shape share (per process, so per xdist worker).

    The first test launches it and registers its teardown on the scope's node, so it goes
    when the scope ends, whatever its last test did; each later test gets it reset
    (:func:`pytest_sky.cluster.reset_for_next_test`), or a fresh one where that failed.
    """
    state = item.config.stash[_state_key]
    node = _scope_node(item, want.scope)
    key = _ShareKey(
        want.scope, node.nodeid, tuple(sorted((k, repr(v)) for k, v in want.shape.items())), state.settings.backend
    )
    cluster = state.shared.get(key)
    if cluster is not None:
        cluster = _reset_or_drop(state, item, cluster)
    if cluster is None:
        label = "session" if node is item.session else os.path.splitext(node.name)[0]
        cluster = _launch_or_fail(state, name_label=_name_label(label, 0), **want.shape)
        if key not in state.shared:
            node.addfinalizer(lambda: _release(state, key))
        state.shared[key] = cluster
    _reported(item).append(cluster)
    return cluster


def _reset_or_drop(state: _SessionState, item: pytest.Item, cluster: Cluster) -> Cluster | None:
    """The shared cluster made clean for the next test; None (and it torn down) where it could
    not be, or an earlier test took it down itself."""
    from pytest_sky.cluster import reset_for_next_test
    from pytest_sky.errors import SkyError

    if not cluster.is_down:
        try:
            reset_for_next_test(cluster)
            return cluster
        except SkyError as exc:
            item.warn(pytest.PytestWarning(f"pytest-sky: {exc}; this test gets a fresh cluster"))
    _tear_down(state, [cluster])
    return None


def _release(state: _SessionState, key: _ShareKey) -> None:
    """The end of a shared cluster's scope: it goes through the one teardown path."""
    cluster = state.shared.pop(key, None)
    if cluster is not None:
        _tear_down(state, [cluster])


class ClusterFactory:
    """What ``sky_cluster_factory`` gives: ``factory(num_nodes=2, **marker_args) -> Cluster``,
    with the ``multinode`` marker's arguments (but ``scope``: the fixture that holds the
    cluster has one of its own).

    The cluster is the caller's, for as long as it likes: it goes at ``cluster.down()`` or
    at the end of a ``with`` block, and at the latest when the session ends, pass or fail
    (``--keep-clusters`` keeps it, whatever asks it to go).  A failing test that ran
    something on it gets those ranks' lines in its report."""

    def __init__(self, state: _SessionState) -> None:
        self._state = state
        self._made: list[Cluster] = []

    def __call__(self, num_nodes: int = 2, **marker_args: Any) -> Cluster:
        if "scope" in marker_args:
            pytest.fail(
                "pytest-sky: sky_cluster_factory() takes no scope: the cluster lives until down(), the end of its "
                "`with` block, or the session's end (e.g. a module-scoped fixture: "
                "`with sky_cluster_factory(num_nodes=2) as c: yield c`)",
                pytrace=False,
            )
        want = bound((num_nodes,), marker_args, "sky_cluster_factory()", "sky_cluster_factory")
        current = self._state.current
        label = current.name if current is not None else "session"
        cluster = _launch_or_fail(self._state, name_label=_name_label(label, len(self._made) + 1), **want.shape)
        self._made.append(cluster)
        return cluster

    def _close(self) -> None:
        """The session's end: every cluster still up goes, through the one teardown."""
        _tear_down(self._state, self._made)


@pytest.fixture(scope="session")
def sky_cluster_factory(request: pytest.FixtureRequest) -> Iterator[ClusterFactory]:
    """Session-scoped, like ``tmp_path_factory``: ``sky_cluster_factory(num_nodes=2,
    **marker_args) -> Cluster`` for a user's own fixtures of any scope, e.g. one cluster for
    a module's tests::

        @pytest.fixture(scope="module")
        def cluster(sky_cluster_factory):
            with sky_cluster_factory(num_nodes=2) as c:
                yield c
    """
    factory = ClusterFactory(request.config.stash[_state_key])
    try:
        yield factory
    finally:
        factory._close()
