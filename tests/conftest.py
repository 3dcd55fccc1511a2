"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


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
