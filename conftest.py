"""Repository-wide test settings: a private state directory and a leak check at the end.

The leak check is what the before-stop hook checks, made part of every run: after the
session, no namespace node, link or sshd of ours may remain on this machine.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

# Keep this repository's runs away from a user's own ~/.pytest_sky.
os.environ.setdefault("PYTEST_SKY_HOME", os.path.join(tempfile.gettempdir(), "pytest-sky-tests-home"))


def leaked_resources() -> list[str]:
    """Links named psky* and sshd processes on this machine (ours by construction)."""
    leaks = []
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=False).stdout
    for line in links.splitlines():
        name = line.split(": ")[1].split("@")[0] if ": " in line else ""
        if name.startswith("psky"):
            leaks.append(f"link {name}")
    procs = subprocess.run(["pgrep", "-a", "-x", "sshd"], capture_output=True, text=True, check=False).stdout
    leaks += [f"process {p}" for p in procs.splitlines() if "pytest-sky" in p or "sshd_config" in p]
    return leaks


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
