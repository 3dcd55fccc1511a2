"""The pytest plugin: options, markers and fixtures of the public contract (DESIGN.md section 2).

Heavy modules (paramiko, the backends) are imported inside hooks and fixtures, so that
installing pytest-sky costs nothing to a test session that never asks for a cluster.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_sky import interrupts  # tiny; a signal handler is no place for an import

if TYPE_CHECKING:
    from pytest_sky.cluster import Cluster
    from pytest_sky.settings import Settings


MARKERS = {
    "multinode": "multinode(num_nodes=2, gpus=None, cpus=None, memory=None, shared_dir=None, capabilities=None, "
    "privileged=None, scope='function'): the test gets a cluster of that shape as `sky_cluster`; "
    "scope='class'/'module'/'session' shares one among that scope's tests of the same shape",
    "kubernetes": "run only with the Kubernetes backend (--kubernetes)",
    "no_kubernetes": "skip with the Kubernetes backend",
    "gpu": "needs a GPU; skipped with a reason where the backend has none",
}


SCOPES = ("function", "class", "module", "session")


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
    live: list[Cluster] = field(default_factory=list)
    shared: dict[_ShareKey, Cluster] = field(default_factory=dict)


_state_key = pytest.StashKey[_SessionState]()
# The clusters a test used, for its failure report (its own and the shared ones it was lent).
_item_clusters_key = pytest.StashKey[list["Cluster"]]()


def _reported(item: pytest.Item) -> list[Cluster]:
    return item.stash.setdefault(_item_clusters_key, [])


def pytest_addoption(parser: pytest.Parser) -> None:
    """Every row of the settings table is an option here, with its environment twin named."""
    from pytest_sky import settings

    group = parser.getgroup("sky", "pytest-sky: multi-node clusters (each option has a PYTEST_SKY_* twin)")
    for option in settings.OPTIONS:
        group.addoption(option.flag, dest=option.dest, default=None, **option.argparse_kwargs(option.env))


def settings_from(config: pytest.Config) -> Settings:
    """The session's settings: this command line's options over the environment's twins."""
    from pytest_sky import settings

    try:
        return settings.resolve(**{o.name: config.getoption(o.dest) for o in settings.OPTIONS})
    except settings.SettingsError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str | None:
    """The effective settings, each with where it came from (option, environment, default)."""
    from pytest_sky.backends import mode_of

    state = config.stash.get(_state_key, None)
    return state.settings.describe(mode_of(state.settings.backend)) if state is not None else None


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
        from pytest_sky.artifacts import ArtifactsError, check_writable

        try:
            check_writable(settings.artifacts)
        except ArtifactsError as exc:
            raise pytest.UsageError(str(exc)) from None
    config.stash[_state_key] = _SessionState(settings=settings)
    config.pluginmanager.register(_JunitWriter(config), "pytest-sky-junit")
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Reap clusters whose owner died (a run killed with SIGKILL), before making new ones."""
    from pytest_sky.errors import SkyError
    from pytest_sky.state import StateStore

    try:
        store = StateStore()
        if not store.records():
            return  # the common case: no backend, ssh or task module is imported (every pytest run pays it)
        from pytest_sky.lifecycle import reap as reap_orphans

        reaped = reap_orphans(store)
    except (SkyError, OSError) as exc:
        session.config.issue_config_time_warning(pytest.PytestWarning(f"pytest-sky: reaping failed: {exc}"), 2)
        return
    if reaped:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"pytest-sky: reaped {len(reaped)} cluster(s) left by a killed run: {', '.join(reaped)}"
            )


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
        if item.get_closest_marker("gpu"):
            if no_gpu == "":
                no_gpu = _backend_gpu_absence(settings)
            if no_gpu is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs a GPU; {no_gpu}"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    clusters = item.stash.get(_item_clusters_key, [])
    if report.when not in ("call", "setup") or not clusters:
        return report
    from pytest_sky import junit

    out = []
    if report.failed:
        out += _rank_sections(item, report, clusters)
    state = item.config.stash.get(_state_key, None)
    settings = state.settings if state is not None else None
    if settings is not None and settings.artifacts and (report.failed or (settings.artifacts_all and report.passed)):
        out.append(_keep_artifacts(report, settings.artifacts, clusters))
    if out and report.failed:
        junit.attach(item, report, "".join(out))
    return report


def _rank_sections(item: pytest.Item, report: pytest.TestReport, clusters: list[Cluster]) -> list[str]:
    """Each rank's lines as a section of the terminal report, a property of the test in the
    JUnit XML, and the text of its ``<system-out>`` (returned)."""
    from pytest_sky import junit

    out = []
    for cluster in clusters:
        for result in cluster.results[-3:]:
            for rank in result.ranks:
                title = f"sky {cluster.name} job {result.job_id} rank {rank.rank} ({rank.name}, exit {rank.returncode})"
                report.sections.append((title, rank.stdout or "(no output)\n"))
                item.user_properties.append(
                    (
                        f"sky {cluster.name} job {result.job_id} rank {rank.rank}",
                        f"{rank.name} {rank.ip} exit {rank.returncode}",
                    )
                )
                header = junit.rank_header(cluster.name, result.job_id, rank.rank, rank.name, rank.ip, rank.returncode)
                out.append(f"{header}\n{rank.stdout or '(no output)'}\n")
            if result.error:
                report.sections.append((f"sky {cluster.name} job {result.job_id}", result.error + "\n"))
                out.append(f"===== sky {cluster.name} job {result.job_id}: {result.error}\n")
    return out


def _keep_artifacts(report: pytest.TestReport, directory: str, clusters: list[Cluster]) -> str:
    """Write the test's artifacts (before its clusters go) and say where, in the report and
    as attachment lines; a failure to gather them is a line in the report, never an error."""
    from pytest_sky import artifacts, junit
    from pytest_sky.errors import SkyError

    try:
        where = artifacts.write(Path(directory).resolve(), report.nodeid, report.outcome, report.when, clusters)
    except (OSError, SkyError) as exc:
        report.sections.append(("sky artifacts", f"could not write artifacts under {directory}: {exc}\n"))
        return ""
    lines = f"artifacts: {where}\n"
    if (where / artifacts.TIMELINE).exists():
        lines += f"timeline: {where / artifacts.TIMELINE}\n"
    report.sections.append(("sky artifacts", lines))
    return lines + junit.attachment_lines(artifacts.files(where))


class _JunitWriter:
    """On the process that writes the JUnit XML (the controller, under xdist): the rank logs
    and attachment lines into each failed test case's ``<system-out>``.  One per session,
    holding its config: ``pytest_runtest_logreport`` is not given it."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from pytest_sky import junit

        text = getattr(report, junit.REPORT_ATTR, None)
        if text:
            junit.add_system_out(self.config, report, text)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Last line of defence: clusters of ours that are still up are torn down.  Then the
    files of every cluster this process tore down, deleted in the background, are gone too."""
    from pytest_sky.state import drain_removals

    state = session.config.stash.get(_state_key, None)
    if state is not None:
        if not state.settings.keep_clusters:
            for cluster in list(state.live):
                if not cluster.is_down:
                    cluster.down()
        state.live.clear()
    drain_removals()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Kept clusters, read from the state store: under xdist the workers kept them."""
    state = terminalreporter.config.stash.get(_state_key, None)
    if not state or not state.settings.keep_clusters:
        return
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


def _slug(text: str, limit: int) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    slug = re.sub(r"^test-?", "", slug) or "t"
    return slug[:limit].strip("-") or "t"


def unique_cluster_name(item: pytest.Item, index: int) -> str:
    """Names unique per test, per xdist worker and per process: ``sky-<test>-<worker>-<hex>``."""
    return _cluster_name(item.name, index)


def _cluster_name(label: str, index: int) -> str:
    """``sky-<label>-<worker>-<index>-<hex>``: the label is a test's name or a shared scope's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    token = os.urandom(2).hex()
    parts = ["sky", _slug(label, 18)]
    if worker:
        parts.append(worker)
    if index:
        parts.append(str(index))
    parts.append(token)
    name = "-".join(parts)
    if not name[0].isalpha():
        name = "s" + name
    return name[:40].rstrip("-")


@pytest.fixture(scope="session")
def sky_settings(request: pytest.FixtureRequest) -> Settings:
    """The session's resolved settings (what the report header shows), e.g. to skip a test
    that needs ``--kube-shared-pvc`` on Kubernetes."""
    return request.config.stash[_state_key].settings


@pytest.fixture(scope="session")
def sky_backend(request: pytest.FixtureRequest) -> str:
    """The selected backend's name: 'local' or 'kubernetes'."""
    return request.config.stash[_state_key].settings.backend


@pytest.fixture
def sky_launch(request: pytest.FixtureRequest, sky_backend: str) -> Iterator[Callable[..., Cluster]]:
    """Factory: ``sky_launch(task=None, *, num_nodes=None, name=None, **resources) -> Cluster``.

    A task given (a Task or a YAML path) is launched and its result kept as
    ``cluster.last_result``; ``timeout=`` bounds that run.  Every cluster is torn down after
    the test, pass or fail.
    """
    state = request.config.stash[_state_key]
    mine: list[Cluster] = []
    item = request.node
    reported = _reported(item)

    def factory(
        task: Any = None,
        *,
        num_nodes: int | None = None,
        name: str | None = None,
        timeout: float | None = None,
        **resources: Any,
    ) -> Cluster:
        return _launch_or_fail(
            state,
            task,
            num_nodes=num_nodes,
            name=name or unique_cluster_name(item, len(mine)),
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


def _launch_or_fail(state: _SessionState, task: Any = None, **options: Any) -> Cluster:
    """``launch`` with the session's settings, tracked for the last-line teardown; a problem
    fails the test with one line."""
    from pytest_sky.cluster import launch
    from pytest_sky.errors import SkyError

    on_created = options.pop("on_created", None)

    def track(cluster: Cluster) -> None:
        state.live.append(cluster)
        if on_created is not None:
            on_created(cluster)

    settings = state.settings
    try:
        return launch(task, settings=settings, keep=settings.keep_clusters, on_created=track, **options)
    except SkyError as exc:
        problem = str(exc)
    # Outside the except block: the report shows one line, not a chained traceback.
    pytest.fail(f"pytest-sky: {problem}", pytrace=False)


def _tear_down(state: _SessionState, clusters: list[Cluster]) -> None:
    """Every cluster of one test, newest first, unless kept; each failure reported, none skipped."""
    errors = []
    for cluster in reversed(clusters):
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


@dataclass(frozen=True)
class MultinodeRequest:
    """What a ``multinode`` marker asks for: the cluster's shape (``launch``'s keywords) and
    the scope whose tests of that shape share it."""

    shape: dict[str, Any]
    scope: str = "function"


def multinode_shape(
    num_nodes: int = 2,
    *,
    gpus: object = None,
    cpus: object = None,
    memory: object = None,
    shared_dir: str | None = None,
    capabilities: tuple[str, ...] | None = None,
    privileged: bool | None = None,
    scope: str = "function",
) -> MultinodeRequest:
    """The signature of ``@pytest.mark.multinode``: the marker's arguments are bound to it.

    Python's own binding refuses an unknown keyword or a second positional argument;
    :func:`_marker_shape` only turns its TypeError into a line that says what to write.
    """
    shape = {
        "num_nodes": num_nodes,
        "gpus": gpus,
        "cpus": cpus,
        "memory": memory,
        "shared_dir": shared_dir,
        "capabilities": capabilities,
        "privileged": privileged,
    }
    return MultinodeRequest({k: v for k, v in shape.items() if v is not None}, scope)


def _marker_shape(item: pytest.Item) -> MultinodeRequest:
    marker = item.get_closest_marker("multinode")
    if marker is None:
        return multinode_shape()
    try:
        request = multinode_shape(*marker.args, **marker.kwargs)
    except TypeError:
        pass  # said below, outside the handler: the user gets one line, not a chain
    else:
        if request.scope in SCOPES:
            return request
        pytest.fail(
            f"pytest-sky: multinode() got scope={request.scope!r}; use one of {', '.join(map(repr, SCOPES))} "
            "(e.g. @pytest.mark.multinode(num_nodes=2, scope='module'))",
            pytrace=False,
        )
    import inspect

    allowed = sorted(inspect.signature(multinode_shape).parameters)
    unknown = sorted(set(marker.kwargs) - set(allowed))
    if unknown:
        pytest.fail(
            f"pytest-sky: multinode() got unknown argument(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}",
            pytrace=False,
        )
    pytest.fail(
        "pytest-sky: multinode() takes num_nodes once, as its only positional argument "
        "or as num_nodes=N (e.g. @pytest.mark.multinode(num_nodes=3))",
        pytrace=False,
    )


@pytest.fixture
def sky_cluster(request: pytest.FixtureRequest, sky_launch: Callable[..., Cluster]) -> Cluster:
    """One cluster for this test, shaped by its ``multinode`` marker (default: 2 nodes); with
    ``scope=`` other than "function", the one its scope's tests of that shape share."""
    want = _marker_shape(request.node)
    if want.scope == "function":
        return sky_launch(**want.shape)
    return _shared_cluster(request.node, want)


def _scope_node(item: pytest.Item, scope: str) -> pytest.Node:
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
        cluster = _launch_or_fail(state, name=_cluster_name(label, 0), **want.shape)
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


#: What the node image of examples/kubernetes/Dockerfile has (a skip for anything else says
#: to add it there).
NODE_IMAGE_HAS = frozenset({"python3", "torch", "mpi4py", "mpirun", "ssh", "sshd"})


def missing_on_nodes(cluster: Cluster, *, commands: Sequence[str] = (), modules: Sequence[str] = ()) -> list[str]:
    """Which of ``commands`` (on PATH) and ``modules`` (importable by ``python3``) some node of
    ``cluster`` lacks, asked on the nodes themselves: they need not have what this client has."""
    import shlex

    from pytest_sky import shell

    args = [*commands, *(f"py:{m}" for m in modules)]
    res = cluster.run(f"set -- {shlex.join(args)}\n{shell.script(shell.PROBE_NODES)}", timeout=120)
    missing: list[str] = []
    mark = shell.MISSING_MARK + " "
    for rank in res.ranks:
        for line in rank.stdout.splitlines():
            name = line.removeprefix(mark).strip()
            if line.startswith(mark) and name not in missing:
                missing.append(name)
    return missing


def require_on_nodes(
    cluster: Cluster, *, commands: Sequence[str] = (), modules: Sequence[str] = (), install: str = ""
) -> None:
    """Skip the test unless every node has ``commands`` and ``modules`` (``missing_on_nodes``),
    naming the image and the fix; ``install`` says how to get what is missing (on the local
    backend the nodes run this machine's software)."""
    missing = missing_on_nodes(cluster, commands=commands, modules=modules)
    if not missing:
        return
    what = ", ".join(missing)
    image = cluster.node_image
    if image is not None:
        extra = "" if NODE_IMAGE_HAS.issuperset(missing) else f" with {install or what} added"
        pytest.skip(
            f"image {image} has no {what} on the nodes: "
            f"build examples/kubernetes/Dockerfile{extra} and pass --kube-image"
        )
    pytest.skip(f"the nodes (this machine's software) have no {what}" + (f": {install}" if install else ""))
