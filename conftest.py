"""Repository-wide test settings: a private state directory and a leak check at the end.

The leak check is what the before-stop hook checks, made part of every run: after the
session, no namespace node, link or sshd of ours may remain on this machine (this assumes
no other pytest-sky run shares the machine at the same moment).
"""

from __future__ import annotations

import os
import tempfile

import pytest

# Keep this repository's runs away from a user's own ~/.pytest_sky.
os.environ.setdefault("PYTEST_SKY_HOME", os.path.join(tempfile.gettempdir(), "pytest-sky-tests-home"))


def leaked_resources() -> list[str]:
    from pytest_sky.doctor import leaked_links, node_processes

    return [f"link {n}" for n in leaked_links()] + [f"process {p}: {c}" for p, c in node_processes()]


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):
        return  # xdist workers: the controller checks once everything is done
    leaks = leaked_resources()
    if leaks:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("pytest-sky leak check: left on this machine: " + ", ".join(leaks), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
