"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def module_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A state directory (PYTEST_SKY_HOME) of the module's own, for the clusters it shares."""
    home = tmp_path_factory.mktemp("sky-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTEST_SKY_HOME", str(home))
        yield home
