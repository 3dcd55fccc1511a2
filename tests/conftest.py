"""Fixtures shared by the test modules."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _pytest.pytester as _pytester
import pytest

if TYPE_CHECKING:
    from kube_emulator import Emulator

#: What every pytest run that a test starts goes without, as pyproject.toml says for this one:
#: hydra's and anyio's plugins (installed with NeMo, never used here) cost each run ~0.6 s of
#: CPU, and a suite starts sixty-odd.  The runs read no pyproject of ours, so it goes through
#: the environment: set here for plain subprocesses, and again for pytester's runs (pytester
#: clears PYTEST_ADDOPTS).
LEAN_INNER_RUNS = "-p no:hydra_pytest -p no:anyio"
os.environ["PYTEST_ADDOPTS"] = LEAN_INNER_RUNS


#: Packages whose modules pytester must never drop.  pytester puts ``sys.modules`` back as it
#: was after each test that uses it and after each in-process run, dropping every module first
#: imported in between.  The kubernetes client imports its models on first use and keeps them
#: in its package's namespace, so a model first used inside such a run outlived its module:
#: the next import made a second class of the same name, and the client's pydantic checks
#: refused one for the other (``V1DeleteOptions``: "Input should be a valid dictionary or
#: instance of V1DeleteOptions"), failing every later Kubernetes teardown in that worker.
#: pytester keeps zope's modules for the same reason.
KEPT_ACROSS_INNER_RUNS = ("kubernetes", "pydantic", "pydantic_core")


class _KeepsClientModules(_pytester.SysModulesSnapshot):
    def __init__(self, preserve: Callable[[str], bool] | None = None) -> None:
        def keep(name: str) -> bool:
            return name.startswith(KEPT_ACROSS_INNER_RUNS) or (preserve is not None and preserve(name))

        super().__init__(preserve=keep)


_pytester.SysModulesSnapshot = _KeepsClientModules  # type: ignore[misc]


@pytest.fixture(autouse=True)
def _lean_inner_runs(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")
        monkeypatch.setenv("PYTEST_ADDOPTS", LEAN_INNER_RUNS)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state directory (PYTEST_SKY_HOME) of the test's own."""
    monkeypatch.setenv("PYTEST_SKY_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture(scope="module")
def module_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A state directory (PYTEST_SKY_HOME) of the module's own, for the clusters it shares."""
    home = tmp_path_factory.mktemp("sky-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_SKY_HOME", str(home))
        yield home


@pytest.fixture(scope="module", autouse=True)
def ready_node_image() -> Iterator[str]:
    """Kubernetes clusters in these tests run the node image of examples/kubernetes/Dockerfile
    (``PYTEST_SKY_KUBE_IMAGE``), as CI's smoke stage passes ``--kube-image``: the emulator
    models images, and the default one has no sshd and, like a cluster without egress, cannot
    install one.  ``tests/test_kube_images.py`` unsets it to test exactly that."""
    try:
        from kube_emulator.images import READY_IMAGE
    except ImportError:  # no aiohttp: no emulator, and the Kubernetes tests skip
        yield ""
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_SKY_KUBE_IMAGE", READY_IMAGE)
        yield READY_IMAGE


@contextlib.contextmanager
def _emulator(tmp_path_factory: pytest.TempPathFactory, **config: Any) -> Iterator[Emulator]:
    """A Kubernetes API emulator with ``Emulator`` keywords ``config`` and a state directory
    of its own; once it has stopped, nothing of it may be left on this machine."""
    pytest.importorskip("kubernetes", reason="pip install kubernetes")
    pytest.importorskip("aiohttp", reason="the emulator needs aiohttp")
    if os.geteuid() != 0:  # CI runs these as root; its rootless stage runs the smoke suite
        pytest.skip("the emulator's pods are namespace nodes in this host's network: needs root")
    from kube_emulator import Emulator
    from tests.kube_helpers import leftovers

    state_dir = tmp_path_factory.mktemp("kube-emulator")
    with Emulator(state_dir=state_dir, **config) as emulator:
        yield emulator
    assert leftovers(str(state_dir)) == []
    assert not any(state_dir.iterdir())


@pytest.fixture(scope="session")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """One emulator in its default configuration (three nodes, policies on), for every module
    that needs no other: starting one per module cost a bridge, a DNS server and seconds
    each.  Modules that share it name their clusters, pods and namespaces after themselves,
    clear the faults they set, and leave nothing of theirs behind, so that no module's
    result depends on which ran before it."""
    with _emulator(tmp_path_factory) as emulator:
        yield emulator


@pytest.fixture(scope="module")
def start_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Emulator]]:
    """Starts an emulator of a configuration the module needs (``start_emulator(nodes=1,
    kube_version="1.35")``), stopped when the module is done; a module that needs one
    overrides ``emu`` with it."""
    with contextlib.ExitStack() as stack:

        def start(**config: Any) -> Emulator:
            return stack.enter_context(_emulator(tmp_path_factory, **config))

        yield start


@pytest.fixture
def memory_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The in-memory backend (tests/fake_backend.py) registered as ``memory``, with a fresh
    ledger: for lifecycle, plugin and CLI logic that needs no node to exist."""
    import importlib

    from pytest_sky import registry

    # The module the registry's factory will import: an in-process pytester run restores
    # sys.modules afterwards, and ``from tests import fake_backend`` could then name an older
    # copy, whose ledger the backend never writes to.
    fake_backend = importlib.import_module("tests.fake_backend")
    monkeypatch.setattr(registry, "BACKENDS", (*registry.BACKENDS, fake_backend.ENTRY))
    monkeypatch.setattr(fake_backend, "LEDGER", fake_backend.Ledger())
    yield fake_backend.LEDGER


@pytest.fixture
def inner_sky_home(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """For tests that run pytest inside (pytester): a private state directory, an output
    directory for inner tests (``SKY_TEST_OUT``) and an environment without our settings.

    Afterwards, any cluster still recorded there (a failed assertion before cleanup) is removed,
    so a failing test never leaks namespace nodes onto the machine.
    """
    import pytest_sky

    for key in list(os.environ):
        if key.startswith(("PYTEST_SKY_", "PYTEST_XDIST_")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("PYTEST_ADDOPTS", LEAN_INNER_RUNS)
    home = pytester.path.resolve() / "skyhome"
    out = pytester.path / "out"
    out.mkdir()
    monkeypatch.setenv("PYTEST_SKY_HOME", str(home))
    monkeypatch.setenv("SKY_TEST_OUT", str(out))
    yield home
    clusters = home / "clusters"
    for d in sorted(clusters.iterdir()) if clusters.is_dir() else []:
        try:
            pytest_sky.get_cluster(d.name).down()
        except pytest_sky.SkyError:
            pass
