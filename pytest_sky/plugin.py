"""The pytest plugin: options, markers and fixtures of the public contract (DESIGN.md section 2).

Heavy modules (paramiko, the backends) are imported inside hooks and fixtures, so that
installing pytest-sky costs nothing to a test session that never asks for a cluster.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_sky.cluster import Cluster
    from pytest_sky.settings import Settings


MARKERS = {
    "multinode": "multinode(num_nodes=2, gpus=None, cpus=None, memory=None): the test gets a cluster "
    "of that shape as `sky_cluster`",
    "kubernetes": "run only with the Kubernetes backend (--kubernetes)",
    "no_kubernetes": "skip with the Kubernetes backend",
    "gpu": "needs a GPU; skipped with a reason where the backend has none",
}


@dataclass
class _SessionState:
    settings: Settings
    started: float = field(default_factory=time.time)
    live: list[Cluster] = field(default_factory=list)


_state_key = pytest.StashKey[_SessionState]()
_item_clusters_key = pytest.StashKey[list["Cluster"]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("sky", "pytest-sky: multi-node clusters (each option has a PYTEST_SKY_* twin)")
    group.addoption(
        "--backend",
        dest="sky_backend",
        choices=("local", "kubernetes"),
        default=None,
        help="where clusters run: 'local' namespace nodes on this machine (default) or 'kubernetes' "
        "pods [PYTEST_SKY_BACKEND]",
    )
    group.addoption(
        "--kubernetes",
        dest="sky_kubernetes",
        action="store_true",
        default=None,
        help="same as --backend kubernetes: pods on the current kube context [PYTEST_SKY_KUBERNETES]",
    )
    group.addoption(
        "--kube-context",
        dest="sky_kube_context",
        default=None,
        metavar="CONTEXT",
        help="kubeconfig context to use [PYTEST_SKY_KUBE_CONTEXT]",
    )
    group.addoption(
        "--kube-namespace",
        dest="sky_kube_namespace",
        default=None,
        metavar="NAMESPACE",
        help="namespace for the cluster's pods [PYTEST_SKY_KUBE_NAMESPACE]",
    )
    group.addoption(
        "--kube-image",
        dest="sky_kube_image",
        default=None,
        metavar="IMAGE",
        help="container image of every pod [PYTEST_SKY_KUBE_IMAGE]",
    )
    group.addoption(
        "--kube-shared-pvc",
        dest="sky_kube_shared_pvc",
        default=None,
        metavar="CLAIM",
        help="ReadWriteMany PersistentVolumeClaim that holds a test's shared_dir [PYTEST_SKY_KUBE_SHARED_PVC]",
    )
    group.addoption(
        "--keep-clusters",
        dest="sky_keep_clusters",
        action="store_true",
        default=None,
        help="do not tear clusters down; print how to reach and delete them [PYTEST_SKY_KEEP_CLUSTERS]",
    )
    group.addoption(
        "--sky-mtu",
        dest="sky_mtu",
        type=int,
        default=None,
        metavar="MTU",
        help="MTU of local cluster links (default 65535) [PYTEST_SKY_MTU]",
    )


def settings_from(config: pytest.Config) -> Settings:
    """The session's settings: this command line's options over the environment's twins."""
    from pytest_sky import settings

    try:
        return settings.resolve(
            backend=config.getoption("sky_backend"),
            kubernetes=config.getoption("sky_kubernetes"),
            kube_context=config.getoption("sky_kube_context"),
            kube_namespace=config.getoption("sky_kube_namespace"),
            kube_image=config.getoption("sky_kube_image"),
            kube_shared_pvc=config.getoption("sky_kube_shared_pvc"),
            keep_clusters=config.getoption("sky_keep_clusters"),
            mtu=config.getoption("sky_mtu"),
        )
    except settings.SettingsError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str | None:
    """The effective settings, each with where it came from (option, environment, default)."""
    state = config.stash.get(_state_key, None)
    return state.settings.describe() if state is not None else None


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM (CI timeouts, `kill`) becomes what Ctrl-C is: pytest stops and tears down."""
    raise KeyboardInterrupt(f"pytest-sky: signal {signum}: tearing clusters down")


def pytest_configure(config: pytest.Config) -> None:
    for name, help_text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {help_text}" if not help_text.startswith(name) else help_text)
    config.stash[_state_key] = _SessionState(settings=settings_from(config))
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Reap clusters whose owner died (a run killed with SIGKILL), before making new ones."""
    from pytest_sky.errors import SkyError
    from pytest_sky.lifecycle import reap as reap_orphans
    from pytest_sky.state import StateStore

    try:
        store = StateStore()
        if not store.records():
            return
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


def _backend_has_gpu(settings: Settings) -> bool:
    from pytest_sky.backends import get_backend
    from pytest_sky.errors import SkyError

    try:
        return get_backend(settings.backend, **settings.backend_options()).has_gpus()
    except SkyError:
        return False  # the backend is unusable; its tests fail with the reason on their own


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Backend-dependent skips, as markers: the report then points at the test, with the reason."""
    settings = config.stash[_state_key].settings
    on_k8s = settings.backend == "kubernetes"
    has_gpu: bool | None = None
    for item in items:
        if item.get_closest_marker("kubernetes") and not on_k8s:
            item.add_marker(pytest.mark.skip(reason="runs only on the Kubernetes backend (--kubernetes)"))
        if item.get_closest_marker("no_kubernetes") and on_k8s:
            item.add_marker(pytest.mark.skip(reason="not supported on the Kubernetes backend"))
        if item.get_closest_marker("gpu"):
            if has_gpu is None:
                has_gpu = _backend_has_gpu(settings)
            if not has_gpu:
                item.add_marker(
                    pytest.mark.skip(reason=f"needs a GPU; the {settings.backend} backend has none on this machine")
                )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report = yield
    if report.failed and report.when in ("call", "setup"):
        for cluster in item.stash.get(_item_clusters_key, []):
            for result in cluster.results[-3:]:
                for rank in result.ranks:
                    title = (
                        f"sky {cluster.name} job {result.job_id} rank {rank.rank} ({rank.name}, exit {rank.returncode})"
                    )
                    report.sections.append((title, rank.stdout or "(no output)\n"))
                if result.error:
                    report.sections.append((f"sky {cluster.name} job {result.job_id}", result.error + "\n"))
    return report


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Last line of defence: clusters of ours that are still up are torn down."""
    state = session.config.stash.get(_state_key, None)
    if state is None:
        return
    if not state.settings.keep_clusters:
        for cluster in list(state.live):
            if not cluster.is_down:
                cluster.down()
    state.live.clear()


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
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    token = os.urandom(2).hex()
    parts = ["sky", _slug(item.name, 18)]
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
    from pytest_sky.cluster import launch
    from pytest_sky.errors import SkyError

    state = request.config.stash[_state_key]
    settings = state.settings
    mine: list[Cluster] = []
    item = request.node
    item.stash[_item_clusters_key] = mine

    def factory(
        task: Any = None,
        *,
        num_nodes: int | None = None,
        name: str | None = None,
        timeout: float | None = None,
        **resources: Any,
    ) -> Cluster:
        try:
            cluster = launch(
                task,
                num_nodes=num_nodes,
                name=name or unique_cluster_name(item, len(mine)),
                settings=settings,
                keep=settings.keep_clusters,
                on_created=_track,
                run_timeout=timeout,
                **resources,
            )
        except SkyError as exc:
            problem = str(exc)
        else:
            return cluster
        # Outside the except block: the report shows one line, not a chained traceback.
        pytest.fail(f"pytest-sky: {problem}", pytrace=False)

    def _track(cluster: Cluster) -> None:
        mine.append(cluster)
        state.live.append(cluster)

    try:
        yield factory
    finally:
        _tear_down(state, mine)


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


def multinode_shape(
    num_nodes: int = 2,
    *,
    gpus: object = None,
    cpus: object = None,
    memory: object = None,
    shared_dir: str | None = None,
) -> dict[str, Any]:
    """The signature of ``@pytest.mark.multinode``: the marker's arguments are bound to it.

    Python's own binding refuses an unknown keyword or a second positional argument;
    :func:`_marker_shape` only turns its TypeError into a line that says what to write.
    """
    shape = {"num_nodes": num_nodes, "gpus": gpus, "cpus": cpus, "memory": memory, "shared_dir": shared_dir}
    return {k: v for k, v in shape.items() if v is not None}


def _marker_shape(item: pytest.Item) -> dict[str, Any]:
    marker = item.get_closest_marker("multinode")
    if marker is None:
        return multinode_shape()
    try:
        return multinode_shape(*marker.args, **marker.kwargs)
    except TypeError:
        pass  # said below, outside the handler: the user gets one line, not a chain
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
    """One cluster for this test, shaped by its ``multinode`` marker (default: 2 nodes)."""
    shape = _marker_shape(request.node)
    return sky_launch(**shape)
