"""``python -m pytest_sky.cli``: the same as the ``pytest-sky`` command."""

from pytest_sky.cli import entry

entry()
